"""Compare two sets of ``sweep_split_k.py --json`` rows (an A/B of two commits timed in one lease).

    python benchmarks/compare_sweeps.py OUT/ab_m8_base.jsonl OUT/ab_m8_m8.jsonl [--base-more F ...] [--new-more F ...]

One line per cell (pattern, in -> out, tokens): the product's median time on each side, base / new (> 1: new is
faster) by do_bench (L2 flushed) and in the chain over cold weights, and both sides against cuBLAS; then the
geometric means and the range per pattern and token count. Rows of the same cell from several files (rounds) are
reduced to their median; cuBLAS is the median of both sides' dense times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

Cell = tuple[str, int, int, int]


def load(paths: list[str]) -> dict[Cell, list[dict]]:
    """The rows of ``sweep_split_k.py --json`` files by cell. A line that is not whole JSON is the row a run killed by
    a call's limit was writing: it is left out, and said so on stderr."""
    rows: dict[Cell, list[dict]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    print(
                        f"compare_sweeps.load: {path}:{number} is not a whole row (a killed run's?); left out",
                        file=sys.stderr,
                    )
                    continue
                rows[(r["pattern"], r["k"], r["r"], r["tokens"])].append(r)
    return rows


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--base-more", nargs="*", default=[], help="more rounds of the base")
    parser.add_argument("--new-more", nargs="*", default=[], help="more rounds of the new tree")
    args = parser.parse_args()
    base, new = load([args.base, *args.base_more]), load([args.new, *args.new_more])
    cells = sorted(set(base) & set(new))
    if not cells:
        raise SystemExit("compare_sweeps: the two sides share no cell (pattern, shape, tokens)")
    groups: dict[tuple[str, int], list[tuple[float, float, float]]] = defaultdict(list)
    ratios, chains = [], []
    for cell in cells:
        b, n = median_of(base[cell], "product"), median_of(new[cell], "product")
        bc, nc = median_of(base[cell], "product_chain"), median_of(new[cell], "product_chain")
        dense = median_of(base[cell] + new[cell], "dense")
        pattern, k, r, tokens = cell
        print(
            f"{pattern:9s} {k:5d} -> {r:5d} {tokens:4d} tokens: {b:7.1f} -> {n:7.1f} µs  x{b / n:5.2f}"
            f"  chain x{bc / nc:5.2f}  cuBLAS x{dense / b:5.2f} -> x{dense / n:5.2f}"
        )
        ratios.append(b / n)
        chains.append(bc / nc)
        groups[(pattern, tokens)].append((b / n, bc / nc, dense / n))
    print(
        f"{len(cells)} cells: geometric mean x{statistics.geometric_mean(ratios):.3f} (chain"
        f" x{statistics.geometric_mean(chains):.3f}), x{min(ratios):.2f}-{max(ratios):.2f}"
    )
    for (pattern, tokens), values in sorted(groups.items()):
        speed, chain, against = zip(*values, strict=True)
        print(
            f"{pattern:9s} {tokens:4d} tokens: x{min(speed):.2f}-{max(speed):.2f}, chain x{min(chain):.2f}-"
            f"{max(chain):.2f}; new against cuBLAS x{min(against):.2f}-{max(against):.2f}"
        )


if __name__ == "__main__":
    main()
