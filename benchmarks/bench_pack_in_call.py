"""What a training call pays for making its packs from the fp32 values (the extension's ``pack_in_call``, bound as
``pack_values``): the GPU time of each pack a compact layer makes per call, against the bytes it must move, at the
Llama-style and BERT-large projection shapes.

    python benchmarks/bench_pack_in_call.py [--repeats 50]

Per shape: 2:4 with a transposable mask (the forward's pack, the backward's transposed pack) and 64:2:8 (the forward's
2:4 view). fp32 values pruned by magnitude, bf16 packs; the median GPU time of ``--repeats`` calls of each by
:func:`hf_sparse.ops.dispatch.costs` (each call queued behind a spin kernel: the host's time is not counted). "GB/s"
counts the fp32 values read and the bf16 pack written once each; a diagnostic, the user-visible figure is
``bench_trainer.py``'s.
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (1024, 1024), (4096, 1024), (1024, 4096)]  # (out, in)


def measure(spec: str, rows: int, cols: int, repeats: int) -> dict[str, tuple[float, float]]:
    """``{pack: (ms, GB/s)}`` for one ``(rows, cols)`` layer at pattern ``spec``."""
    from hf_sparse.masks import compute_mask
    from hf_sparse.nn import SparseLinear
    from hf_sparse.nn.compact import positions
    from hf_sparse.nn.refresh import PACK, TRANSPOSED, VIEW24
    from hf_sparse.ops import dispatch
    from hf_sparse.patterns import parse_pattern

    dense = torch.nn.Linear(cols, rows, bias=False, device="cuda")
    transposable = spec == "2:4"
    mask = compute_mask(dense.weight.detach().abs(), parse_pattern(spec), transposable=transposable)
    layer = SparseLinear.from_dense(dense, mask, spec)
    k = layer.kernel_state(torch.bfloat16)
    k._ensure_transposed(layer)
    if spec != "2:4":
        k._ensure_view24(layer)
    sel, sel_columns, v = positions(layer)
    weight = layer.weight.detach()
    packs = {"pack": (PACK, k.packed), "transposed": (TRANSPOSED, k.packed_t), "view24": (VIEW24, k.packed24)}
    calls = {
        name: (lambda kind=kind, meta=packed.meta: k.refresher.pack_values(
            kind, weight, meta, sel, sel_columns, rows, cols, v, k.m, torch.bfloat16))
        for name, (kind, packed) in packs.items()
        if packed is not None and (name != "pack" or spec == "2:4")
    }  # fmt: skip
    times = dispatch.costs(calls, rounds=repeats)
    out = {}
    for name, ms in times.items():
        written = calls[name]().numel() * 2
        out[name] = (ms, (weight.numel() * 4 + written) / ms / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_pack_in_call: needs a CUDA GPU", file=sys.stderr)
        return 1
    from hf_sparse.nn.compact import _extension

    ext = _extension()
    if ext is None or not hasattr(ext, "pack_values"):
        print("bench_pack_in_call: the extension has no pack_values", file=sys.stderr)
        return 1
    print(f"# bench_pack_in_call: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| out x in | pattern | pack | ms | GB/s |")
    print("| --- | --- | --- | ---: | ---: |")
    for rows, cols in SHAPES:
        for spec in ("2:4", "64:2:8"):
            for name, (ms, gbs) in measure(spec, rows, cols, args.repeats).items():
                print(f"| {rows} x {cols} | {spec} | {name} | {ms:.4f} | {gbs:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
