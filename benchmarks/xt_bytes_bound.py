"""The V:2:M X^T path's calls against the time their bytes take at the rates measured for them.

    python benchmarks/xt_bytes_bound.py RUNS.jsonl [...] [--copy-rate 9.0] [--dram-rate 4.6]

RUNS: ``sweep_split_k.py --json`` rows (cuBLAS and the product timed in chains over distinct weight copies, each cold
in L2). Only the cells that take the X^T path are kept, each with its plan: tile_config.h's ``sm90_vnm_xt`` and
``sm90_vnm_xt_plan``, compiled on the host (``fit_xt_width.choices_for``). Per cell:

- L2 -> SM: the GEMM's bytes (``profile_xt_chain.feed_bytes``: per tile and k-tile the B tile, twice at V = 64, A and
  metadata; then Y) and split-K's fp32 partial sums, each written and read once, at the copy rate (the cp.async rate
  of ``roofline_sm90.cu streams`` on an H200: 8.9-9.0 TB/s);
- DRAM: the packed weight (A and metadata) and X, at the DRAM rate (the same tool: 4.6-4.7 TB/s);
- bound = the larger of the two + the transpose (X read, X^T written) at the copy rate.

It leaves out what every call pays whatever its bytes (launches, the first and last stages of the ring), so at small
calls the bound is below what any kernel reaches. Printed: a markdown row per cell with the plan, both chain medians,
the bytes, the bound as x cuBLAS and the share of it the call reaches.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_kernels import parse
from compare_sweeps import load, median_of
from fit_xt_width import Cell, choices_for, plan_inputs
from profile_xt_chain import A_AND_META_BYTES, feed_bytes, xt_tiles


def bound_us(cell: Cell, bn: int, splits: int, copy_tbs: float, dram_tbs: float) -> tuple[float, int, int]:
    """(bound µs, L2 -> SM bytes, DRAM bytes) of a cell under plan (bn, splits)."""
    pattern, k, rows, tokens = cell
    v, _ = parse(pattern)
    rows_padded, _, k_tiles = plan_inputs(cell)
    feed = feed_bytes(rows_padded, tokens, k_tiles, bn, 1 if v >= 128 else 2)
    if splits > 1:
        feed += 2 * xt_tiles(rows_padded, tokens, bn) * splits * 128 * bn * 4
    dram = -(-rows_padded // 128) * k_tiles * A_AND_META_BYTES + k * tokens * 2
    transpose = 2 * k * tokens * 2
    return max(feed / (copy_tbs * 1e6), dram / (dram_tbs * 1e6)) + transpose / (copy_tbs * 1e6), feed, dram


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="sweep_split_k.py --json files")
    parser.add_argument("--copy-rate", type=float, default=9.0, help="L2 -> shared memory, TB/s")
    parser.add_argument("--dram-rate", type=float, default=4.6, help="DRAM -> SM, TB/s")
    args = parser.parse_args()
    rows = load(args.runs)
    with tempfile.TemporaryDirectory() as work:
        choices = choices_for(None, sorted(rows), Path(work))
    cells = sorted((c for c, (xt, _) in choices.items() if xt), key=lambda c: (c[0], c[1] * c[2], c[1], c[3]))
    if not cells:
        raise SystemExit("no cell in these files takes the X^T path")
    print(
        "| pattern | shape | tokens | tile / splits | cuBLAS µs | call µs (x cuBLAS) | L2 -> SM / DRAM MB |"
        " bound µs (x cuBLAS) | reached |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for cell in cells:
        pattern, k, r, tokens = cell
        _, (bn, splits) = choices[cell]
        bound, feed, dram = bound_us(cell, bn, splits, args.copy_rate, args.dram_rate)
        dense, ours = median_of(rows[cell], "dense_chain"), median_of(rows[cell], "product_chain")
        print(
            f"| {pattern} | {k} -> {r} | {tokens} | {bn} / {splits} | {dense:.1f} | {ours:.1f} ({dense / ours:.2f}x) |"
            f" {feed / 1e6:.0f} / {dram / 1e6:.0f} | {bound:.1f} ({dense / bound:.2f}x) | {100 * bound / ours:.0f}% |"
        )


if __name__ == "__main__":
    main()
