"""What a V:2:M layer pays in inference for holding one copy of its values: the GPU time of making its 2:4 view per
call (the extension's ``view24``) against the 2:4 SpMM that runs on the view, at the Llama-style projection shapes.

    python benchmarks/bench_view24.py [--pattern 64:2:8] [--tokens 8192] [--repeats 50]

bf16, fresh random weights pruned by magnitude; the median GPU time of ``--repeats`` calls of each, by
:func:`hf_sparse.ops.dispatch.costs` (each call queued behind a spin kernel, so the host's time to issue it is not
counted; a diagnostic, the user-visible figure is ``bench_trainer.py``'s prefill).
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in) of the Llama-style projections


def measure(ext, pattern, rows: int, cols: int, tokens: int, repeats: int) -> tuple[float, float]:
    """(view24 ms, 2:4 SpMM on the view ms) for one ``(rows, cols)`` weight at ``tokens`` tokens."""
    from hf_sparse.masks import compute_mask
    from hf_sparse.ops import dispatch, pack
    from hf_sparse.ops.spmm import spmm_function

    w = torch.randn(rows, cols, device="cuda")
    mask = compute_mask(w.abs(), pattern)
    vnm = pack(w, mask, pattern.v, pattern.m, torch.bfloat16)
    view = pack(w, mask, 64, 4, torch.bfloat16)
    x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
    fn = spmm_function(4, x.device)
    times = dispatch.costs(
        {
            "view24": lambda: ext.view24(vnm.values, vnm.meta, vnm.columns, rows, cols, pattern.m),
            "spmm": lambda: fn(x, view.values, view.meta, view.columns, None, rows, cols, 64, 4, 0),
        },
        rounds=repeats,
    )
    return times["view24"], times["spmm"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", default="64:2:8")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()

    from hf_sparse.ops._build import load_extension
    from hf_sparse.patterns import parse_pattern

    ext = load_extension()
    pattern = parse_pattern(args.pattern)
    print(f"# view24 against the 2:4 SpMM, {args.pattern}, {args.tokens} tokens, {torch.cuda.get_device_name()}")
    print("| out x in | view24 ms | SpMM on the view ms | view / SpMM |")
    print("| --- | ---: | ---: | ---: |")
    for rows, cols in SHAPES:
        make, run = measure(ext, pattern, rows, cols, args.tokens, args.repeats)
        print(f"| {rows} x {cols} | {make:.4f} | {run:.4f} | {make / run:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
