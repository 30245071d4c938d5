"""GPU time of computing the masks of a BERT-large-sized model (144 linears, 302M scores): the mask-selection kernels
(``csrc/mask_select.cu``) against the torch forms of the same rules, and a check that both give the same masks.

A gradual schedule recomputes every mask at each pruning step (``SparsityConfig.update_every``), so this is the cost
of one such step's selection (scores already computed).

    python benchmarks/bench_mask_kernels.py [--layers 24] [--reps 3]    (CUDA only; benchmarks/bench_masks.py times
    compute_mask on any device)
"""

from __future__ import annotations

import argparse
import datetime

import torch

from hf_sparse import masks
from hf_sparse.ops._build import load_extension

SHAPES = [(1024, 1024)] * 4 + [(4096, 1024), (1024, 4096)]

RULES = {
    "2:4": (lambda s: masks.nm_mask(s, 2, 4), lambda s: masks._nm_mask_torch(s, 2, 4)),
    "64:2:8": (lambda s: masks.vnm_mask(s, 64, 2, 8), lambda s: masks._vnm_mask_torch(s, 64, 2, 8, 4)),
    "64:2:32": (lambda s: masks.vnm_mask(s, 64, 2, 32), lambda s: masks._vnm_mask_torch(s, 64, 2, 32, 4)),
    "transposable 2:4": (masks.transposable_2to4_mask, masks._transposable_2to4_mask_torch),
}


def gpu_ms(fn, scores: list[torch.Tensor], reps: int) -> float:
    """CUDA-event time of one pass of ``fn`` over every score (median of ``reps`` passes), launches included."""
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in scores:
            fn(s)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[1:])[reps // 2]  # the first pass warms up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    load_extension()  # the mask functions take the kernels once the extension is loaded
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = [torch.rand(shape, device="cuda", generator=gen) for _ in range(args.layers) for shape in SHAPES]
    total = sum(s.numel() for s in scores)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )
    print(f"# {len(scores)} fp32 scores, {total / 1e6:.0f}M entries; ms per pass over all of them\n")
    print("| mask | kernels | torch | torch / kernels | same masks |")
    print("|---|---|---|---|---|")
    for name, (kernel, reference) in RULES.items():
        same = all(torch.equal(kernel(s), reference(s)) for s in scores[: len(SHAPES)])
        k_ms, t_ms = gpu_ms(kernel, scores, args.reps), gpu_ms(reference, scores, args.reps)
        print(f"| {name} | {k_ms:.2f} | {t_ms:.2f} | {t_ms / k_ms:.1f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
