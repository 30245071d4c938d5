"""Issue 17 item 2 (small token counts) cell by cell, from a ``sweep_split_k.py --product-only --cold --bound`` run.

    python benchmarks/item2_status.py SWEEP.jsonl [...]

Per pattern a markdown table (shape x tokens) of cuBLAS / product in GPU time (``do_bench``), the same in a chain
over distinct weights, each call cold in the L2 (``chain``), the bound (cuBLAS on a dense weight of the pack's bytes,
in the chain: what moving the call's bytes at cuBLAS's rate allows) and the share of it the chain reaches; for V:2:M
also its 2:4 view held as a weight of its own (a compact layer in inference holds only its pack: its view and dense
candidates are made in each call, so the pack's figure is what it runs at). Then a summary: the cells
at the item's target, those whose bound lies under it (out of reach of any kernel that moves those bytes), and the
share of the bound the rest reach. Rows of a pattern the item sets no target for are left out.
"""

from __future__ import annotations

import argparse

from compare_sweeps import load, median_of

# Issue 17 item 2: cuBLAS / ours in GPU time at 1-256 tokens on every Llama-7B/13B/70B projection shape.
TARGETS = {"2:4": 1.3, "64:2:8": 1.8, "64:2:16": 2.5}


def cell_status(rows: list[dict], target: float) -> dict:
    """One cell's ratios (medians over its rows) and where it stands: ``met`` (do_bench at the target), ``beyond``
    (the bytes bound is under the target) or ``open``."""

    def ratio(num: str, den: str) -> float | None:
        if not all(num in r and den in r for r in rows):
            return None
        return median_of(rows, num) / median_of(rows, den)

    s = {
        "x": ratio("dense", "product"),
        "chain": ratio("dense_chain", "product_chain"),
        "bound": ratio("dense_chain", "bytes_chain"),
        "view": ratio("dense", "view24"),
    }
    s["share"] = s["chain"] / s["bound"] if s["bound"] else None
    s["state"] = "met" if s["x"] >= target else "beyond" if s["bound"] is not None and s["bound"] < target else "open"
    return s


def render(cells: dict, pattern: str) -> list[str]:
    """A pattern's table and summary lines."""
    target = TARGETS[pattern]
    mine = {c: s for c, s in cells.items() if c[0] == pattern}
    shapes = sorted({(k, r) for _, k, r, _ in mine}, key=lambda s: (s[0] * s[1], s))
    tokens = sorted({t for *_, t in mine})
    vnm = pattern != "2:4"
    out = [
        f"{pattern} (target {target}x): do_bench (chain) [bound] <share of the bound>"
        + (" {2:4 view}" if vnm else ""),
        "",
        "| shape | " + " | ".join(str(t) for t in tokens) + " |",
        "| --- |" + " --- |" * len(tokens),
    ]
    for k, r in shapes:
        row = []
        for t in tokens:
            s = mine.get((pattern, k, r, t))
            if s is None:
                row.append("-")
                continue
            text = f"{s['x']:.2f} ({s['chain']:.2f})" if s["chain"] else f"{s['x']:.2f}"
            if s["bound"]:
                text += f" [{s['bound']:.2f}] <{s['share']:.0%}>"
            if vnm and s["view"]:
                text += f" {{{s['view']:.2f}}}"
            row.append(("**" + text + "**") if s["state"] == "met" else text)
        out.append(f"| {k} -> {r} | " + " | ".join(row) + " |")
    by_state = {st: [s for s in mine.values() if s["state"] == st] for st in ("met", "beyond", "open")}
    out.append("")
    out.append(
        f"{pattern}: {len(by_state['met'])} of {len(mine)} cells at {target}x (bold); "
        f"{len(by_state['beyond'])} where the bound is under it"
    )
    shares = [s["share"] for s in by_state["open"] if s["share"] is not None]
    if shares:
        out[-1] += f"; the other {len(by_state['open'])} reach {min(shares):.0%}-{max(shares):.0%} of their bound"
    slower = [s for s in mine.values() if s["x"] < 1.0]
    if slower:
        out[-1] += f"; {len(slower)} slower than cuBLAS ({min(s['x'] for s in slower):.2f}x at worst)"
    return out + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="sweep_split_k.py --json files")
    args = parser.parse_args(argv)
    cells = {c: cell_status(rows, TARGETS[c[0]]) for c, rows in load(args.runs).items() if c[0] in TARGETS}
    if not cells:
        raise SystemExit(f"no rows of {', '.join(TARGETS)} in {', '.join(args.runs)}")
    for pattern in TARGETS:
        if any(c[0] == pattern for c in cells):
            print("\n".join(render(cells, pattern)))


if __name__ == "__main__":
    main()
