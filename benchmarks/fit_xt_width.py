"""Score values of ``kVnmXtKTileFixedTokens`` (csrc/tile_config.h) against measured X^T-path plans.

    python benchmarks/fit_xt_width.py --runs J3/ab_b_base.jsonl=192 J3/ab_b_f64.jsonl=64 ... --values 192 64 32 16

Each ``--runs`` file holds ``sweep_split_k.py --json`` rows timed on a tree whose constant had the value after ``=``.
The constant only decides the X^T path's width (128 or 256 tokens) and so its plan (width, splits), so every row is a
timing of the plan that value gives its cell. The rows of one (cell, plan) from every file are pooled, their median
chain time (each call over distinct weight copies, cold in L2) is that plan's time. For each candidate value: over the
cells where two plans or more were timed and the candidate's plan is one of them, the geometric mean and the worst of
its plan's time over the cell's fastest plan (1.000: the fastest plan of every cell). ``--table OLD NEW`` prints, for
the cells whose plan changes between two values, both plans' cold medians and cuBLAS ratios (markdown).

The plans come from tile_config.h itself, compiled with the host compiler once per value (the constant replaced in a
copy of the header), as tests/ops/test_tile_choice.py compiles it; 132 SMs, an H100 / H200.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench_kernels import parse
from compare_sweeps import load, median_of

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SMS = 132
CHOOSER = r"""
#include "tile_config.h"
#include <cstdio>
int main() {
  int m, v, rows;
  long long k, rows_padded, tokens, k_tiles;
  while (std::scanf("%d %d %d %lld %lld %lld %lld", &m, &v, &rows, &k, &rows_padded, &tokens, &k_tiles) == 7) {
    const hf_sparse::Sm90SplitPlan p = hf_sparse::sm90_vnm_xt_plan(rows_padded, tokens, k_tiles, SMS);
    std::printf("%d %d %d\n", (int)hf_sparse::sm90_vnm_xt(m, tokens, rows, k, v), p.bn, p.splits);
  }
}
"""

Cell = tuple[str, int, int, int]  # pattern, in features (K), out features (rows), tokens
Plan = tuple[int, int]  # tile tokens, splits


def plan_inputs(cell: Cell) -> tuple[int, int, int]:
    """(rows_padded, tokens, k-tiles) of a V:2:M cell as the X^T launch computes them: rows padded to V, K / M groups
    in steps of 8, two steps a k-tile."""
    pattern, k, rows, tokens = cell
    v, m = parse(pattern)
    steps = (k // m + 7) // 8
    return (rows + v - 1) // v * v, tokens, (steps + 1) // 2


def choices_for(value: int | None, cells: list[Cell], workdir: Path) -> dict[Cell, tuple[bool, Plan]]:
    """Every cell's (whether the V:2:M SpMM takes the X^T path, the X^T plan) under kVnmXtKTileFixedTokens = value
    (None: the header as it is)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("needs a host C++ compiler (g++ or c++)")
    patched = (CSRC / "tile_config.h").read_text()
    if value is not None:
        patched, n = re.subn(r"(constexpr int kVnmXtKTileFixedTokens = )\d+;", rf"\g<1>{value};", patched)
        if n != 1:
            raise SystemExit("kVnmXtKTileFixedTokens not found in csrc/tile_config.h: update this script")
    folder = workdir / ("header" if value is None else f"fixed{value}")
    folder.mkdir()
    (folder / "tile_config.h").write_text(patched)
    (folder / "main.cpp").write_text(CHOOSER.replace("SMS", str(SMS)))
    exe = folder / "choose"
    # the patched header first, then csrc/ for what it includes
    subprocess.run(
        [cxx, "-std=c++17", f"-I{folder}", f"-I{CSRC}", str(folder / "main.cpp"), "-o", str(exe)], check=True
    )
    lines = []
    for cell in cells:
        pattern, k, rows, _ = cell
        v, m = parse(pattern)
        lines.append(" ".join(map(str, (m, v, rows, k, *plan_inputs(cell)))) + "\n")
    out = subprocess.run([str(exe)], input="".join(lines), capture_output=True, text=True, check=True).stdout.split()
    return {c: (out[3 * i] == "1", (int(out[3 * i + 1]), int(out[3 * i + 2]))) for i, c in enumerate(cells)}


def plans_for(value: int | None, cells: list[Cell], workdir: Path) -> dict[Cell, Plan]:
    """Every cell's X^T plan under kVnmXtKTileFixedTokens = value (None: the header as it is)."""
    return {cell: plan for cell, (_, plan) in choices_for(value, cells, workdir).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="FILE=VALUE: sweep rows and their tree's constant")
    parser.add_argument("--values", nargs="+", type=int, required=True, help="the candidate values to score")
    parser.add_argument("--table", nargs=2, type=int, metavar=("OLD", "NEW"), help="the cells whose plan changes")
    args = parser.parse_args()

    runs: list[tuple[str, int]] = []
    for spec in args.runs:
        path, sep, value = spec.rpartition("=")
        if not sep or not value.isdigit():
            raise SystemExit(f"--runs takes FILE=VALUE, got {spec!r}")
        runs.append((path, int(value)))
    rows_by_file = {path: load([path]) for path, _ in runs}
    cells = sorted({c for rows in rows_by_file.values() for c in rows})
    values = sorted({v for _, v in runs} | set(args.values) | set(args.table or ()), reverse=True)
    with tempfile.TemporaryDirectory() as tmp:
        plans = {v: plans_for(v, cells, Path(tmp)) for v in values}

    timings: dict[tuple[Cell, Plan], list[dict]] = {}
    for path, value in runs:
        for cell, rows in rows_by_file[path].items():
            timings.setdefault((cell, plans[value][cell]), []).extend(rows)
    chain = {key: median_of(rows, "product_chain") for key, rows in timings.items()}

    for value in args.values:
        ratios = []
        for cell in cells:
            timed = {plan: t for (c, plan), t in chain.items() if c == cell}
            mine = timed.get(plans[value][cell])
            if len(timed) < 2 or mine is None:
                continue
            ratios.append((mine / min(timed.values()), cell))
        if not ratios:
            print(f"{value:4d}: no cell with two plans timed, one of them this value's")
            continue
        worst, mean = max(ratios), statistics.geometric_mean([r for r, _ in ratios])
        print(
            f"{value:4d}: {len(ratios)} cells, x{mean:.3f} the fastest plan's chain time "
            f"(geometric mean), worst x{worst[0]:.2f} ({worst[1][0]} {worst[1][1]} -> {worst[1][2]}, {worst[1][3]} "
            "tokens)"
        )

    if args.table:
        old, new = args.table
        print("\n| pattern | shape | tokens | plan (width/splits) | µs | x | chain x | x cuBLAS |")
        print("| --- | --- | ---: | --- | --- | ---: | ---: | --- |")
        cold, chains = [], []
        for cell in cells:
            a, b = plans[old][cell], plans[new][cell]
            ra, rb = timings.get((cell, a)), timings.get((cell, b))
            if a == b or not ra or not rb:
                continue
            ta, tb = median_of(ra, "product"), median_of(rb, "product")
            ca, cb = chain[(cell, a)], chain[(cell, b)]
            dense = median_of(ra + rb, "dense")
            cold.append(ta / tb)
            chains.append(ca / cb)
            pattern, k, rows, tokens = cell
            print(
                f"| {pattern} | {k} -> {rows} | {tokens} | {a[0]}/{a[1]} -> {b[0]}/{b[1]} | {ta:.1f} -> {tb:.1f} | "
                f"{ta / tb:.2f} | {ca / cb:.2f} | {dense / ta:.2f}x -> {dense / tb:.2f}x |"
            )
        if cold:
            print(
                f"\n{len(cold)} cells: cold x{statistics.geometric_mean(cold):.3f} ({min(cold):.2f}-{max(cold):.2f}), "
                f"chain x{statistics.geometric_mean(chains):.3f} ({min(chains):.2f}-{max(chains):.2f})"
            )


if __name__ == "__main__":
    main()
