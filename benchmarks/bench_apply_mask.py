"""GPU time of zeroing the pruned weights of a BERT-large-sized model, once per way of writing it in torch.

The pruner zeroes every pruned weight after each optimizer step and every pruned gradient entry after each
backward (``hf_sparse.masks.apply_mask`` / ``apply_masks``), so this runs twice per training step over 302M weights. All
candidates write ``+0.0`` except ``mul_``, which writes ``-0.0`` for negative weights (shown for reference only). The
time is that of the whole pass, launches included.

    python benchmarks/bench_apply_mask.py [--layers 24] [--reps 20]
"""

from __future__ import annotations

import argparse
import datetime

import torch

from hf_sparse.masks import apply_mask, apply_masks, nm_mask
from hf_sparse.ops._build import load_extension

SHAPES = [(1024, 1024)] * 4 + [(4096, 1024), (1024, 4096)]


def gpu_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(s, device="cuda") for _ in range(args.layers) for s in SHAPES]
    masks = [nm_mask(w.abs(), 2, 4) for w in weights]
    pruned = [~m for m in masks]
    zero_dev = torch.zeros((), device="cuda")
    pairs = list(zip(weights, masks, strict=True))
    n = sum(w.numel() for w in weights)
    load_extension()  # what the kernel path does; apply_mask(s) then use the fused kernel (csrc/mask.cu)
    cases = {
        "hf_sparse.masks.apply_mask, per tensor (fused kernel, one launch each)": lambda: [
            apply_mask(w, m) for w, m in pairs
        ],
        "hf_sparse.masks.apply_masks, all tensors (fused kernel, one launch per 64)": lambda: apply_masks(pairs),
        "where(mask, w, cpu 0-dim zero, out=w)": lambda: [torch.where(m, w, torch.zeros(()), out=w) for w, m in pairs],
        "where(mask, w, cuda 0-dim zero, out=w)": lambda: [torch.where(m, w, zero_dev, out=w) for w, m in pairs],
        "masked_fill_(~mask, 0)": lambda: [w.masked_fill_(~m, 0.0) for w, m in pairs],
        "masked_fill_(inverse kept, 0)": lambda: [
            w.masked_fill_(p, 0.0) for w, p in zip(weights, pruned, strict=True)
        ],
        "mul_(mask) (-0.0, reference)": lambda: [w.mul_(m) for w, m in pairs],
    }
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )
    print(f"# {len(weights)} fp32 tensors, {n / 1e6:.0f}M weights; GPU ms per pass over all of them")
    print("| way | ms | GB/s (9 B per weight) |")
    print("|---|---|---|")
    for name, fn in cases.items():
        ms = gpu_ms(fn, args.reps)
        print(f"| {name} | {ms:.3f} | {9 * n / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
