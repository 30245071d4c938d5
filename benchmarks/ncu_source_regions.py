"""Where one kernel's warps wait, by region of its SASS: the warp stall samples of an ncu source page, summed between
landmark instructions (the tensor-core ops, fences, atomics, barriers, TMA copies, exits), and the instructions that
hold the most samples.

    ncu --clock-control none -k regex:tma_a_kernel --launch-skip 3 --launch-count 1 --page source \\
        --print-source sass --csv --section SourceCounters \\
        python benchmarks/profile_spmm.py --k 4096 --r 4096 --tokens 128 --flush read > src.csv
    python benchmarks/ncu_source_regions.py src.csv [--top 20] [--min-share 0.5]

A region starts at a landmark that follows an instruction of another kind and runs to the next such start, so a
kernel's set-up, its main loop, a split-K arrival and its epilogue come out as separate rows. ncu samples each warp at
a fixed interval: a region's share of the samples is its share of the warps' time (benchmarks/RESULTS.md, "split-K
arrival", run C5).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from dataclasses import dataclass

LANDMARKS = ("HGMMA", "MEMBAR", "ATOM", "RED", "BAR", "SYNCS", "UTMALDG", "UTMASTG", "STSM", "USETMAXREG", "EXIT")
SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class Region:
    first: int  # index of its first instruction
    last: int
    landmark: str  # the opcode that starts it ("start" for the kernel's first instructions)
    source: str  # its first instruction
    samples: float


def read_source_page(text: str) -> list[tuple[str, float]]:
    """(SASS instruction, stall samples) per instruction of the first kernel in an ncu ``--page source --csv`` dump."""
    start = text.find('"Address","Source"')
    if start < 0:
        raise ValueError('no ncu source page in the input (expected a CSV header starting "Address","Source")')
    rows = csv.reader(io.StringIO(text[start:]))
    header = next(rows)
    source, samples = header.index("Source"), header.index(SAMPLES)
    out = []
    for row in rows:
        if len(row) <= max(source, samples) or row[0] == "Address":  # a second kernel's page begins
            break
        out.append((row[source].strip(), float(row[samples] or 0)))
    return out


def opcode(instruction: str) -> str:
    """The opcode without predicate and modifiers: ``@!P0 HGMMA.SP.64x128x32.F32`` -> ``HGMMA``."""
    words = [w for w in instruction.split() if not w.startswith("@")]
    return re.split(r"[.\s]", words[0])[0] if words else ""


def regions(instructions: list[tuple[str, float]]) -> list[Region]:
    """The instructions cut where a landmark follows an instruction of another kind."""
    out: list[Region] = []
    previous = None
    for i, (instruction, samples) in enumerate(instructions):
        op = opcode(instruction)
        mark = op if op in LANDMARKS else None
        if not out or (mark is not None and mark != previous):
            out.append(Region(i, i, mark or "start", instruction, 0.0))
        region = out[-1]
        region.last = i
        region.samples += samples
        previous = mark
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output ('-': standard input)")
    ap.add_argument("--top", type=int, default=15, help="instructions with the most samples to list")
    ap.add_argument("--min-share", type=float, default=0.5, help="hide regions with less than this %% of the samples")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if args.csv == "-" else open(args.csv, encoding="utf-8").read()  # noqa: SIM115
    instructions = read_source_page(text)
    total = sum(s for _, s in instructions)
    if total <= 0:
        raise SystemExit("no warp stall samples in the input: profile with --section SourceCounters")
    print(f"{len(instructions)} instructions, {total:.0f} warp stall samples")
    print("| instructions | starts with | samples | share |")
    print("| --- | --- | ---: | ---: |")
    for r in regions(instructions):
        if 100 * r.samples / total >= args.min_share:
            print(f"| {r.first}-{r.last} | `{r.source[:60]}` | {r.samples:.0f} | {100 * r.samples / total:.1f}% |")
    print(f"\nThe {args.top} instructions with the most samples:")
    ranked = sorted(range(len(instructions)), key=lambda i: -instructions[i][1])[: args.top]
    for i in sorted(ranked):
        instruction, samples = instructions[i]
        print(f"  {i:5d} {samples:6.0f} {100 * samples / total:5.1f}%  {instruction[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
