"""How long masking every linear layer of a BERT-large-sized model takes, per pattern.

BERT-large: 24 layers of 4 x (1024x1024) attention projections + (4096x1024) + (1024x4096) FFN = 302M weights.
Run: python benchmarks/bench_masks.py [--layers 24] [--device cpu|cuda] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import platform
import time

import torch

from hf_sparse.masks import compute_mask, unstructured_mask, unstructured_threshold
from hf_sparse.patterns import parse_pattern

SHAPES = [(1024, 1024)] * 4 + [(4096, 1024), (1024, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(shape, device=args.device) for shape in SHAPES]  # one block; reused for every layer
    total = sum(w.numel() for w in weights) * args.layers
    print(
        f"{args.layers} layers, {total / 1e6:.0f}M weights on {args.device} "
        f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    rows = []
    cases = [
        ("2:4", False),
        ("2:4", True),
        ("2:8", False),
        ("64:2:8", False),
        ("64:2:16", False),
        ("128:2:32", False),
        ("unstructured:0.9", False),
        ("unstructured:0.9 (global)", False),
    ]
    for spec, transposable in cases:
        pattern = parse_pattern(spec.split(" ")[0])
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(args.layers):
            scores = [w.abs() for w in weights]
            if spec.endswith("(global)"):
                threshold = unstructured_threshold(scores, pattern.sparsity)
                masks = [unstructured_mask(s, pattern.sparsity, threshold) for s in scores]
            else:
                masks = [compute_mask(s, pattern, transposable=transposable) for s in scores]
        sync()
        seconds = time.perf_counter() - start
        name = spec + (" transposable" if transposable else "")
        rows.append({"pattern": name, "seconds": round(seconds, 2), "weights_per_s": round(total / seconds / 1e6, 1)})
        print(
            f"{name:>28}: {seconds:6.2f} s  ({total / seconds / 1e6:6.1f} M weights/s)  kept {float(masks[0].float().mean()):.3f}"
        )
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
