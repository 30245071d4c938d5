"""The plan each sparse-wgmma SpMM makes per (pattern, shape, token count), from ``csrc/tile_config.h`` alone (host
C++, no GPU), and, with ``--against REV``, only the cells whose plan another commit's rules make differently: the
cells an A/B of a rule change has to time.

    python benchmarks/show_plans.py [--patterns 2:4 64:2:8] [--shapes 8192x1024 ...] [--tokens 1 16 64] [--sms 132]
    python benchmarks/show_plans.py --against main --tokens $(seq 1 256)   # what this checkout changes

A shape is ``KxR`` (K input features -> R output rows), as in the sweep scripts; the default shapes are
``bench_kernels.LLAMA_SHAPES``. The plan's inputs are those the binding passes: rows padded to whole 64-row slabs and
``ceil(K / M / 8)`` steps of 32 kept columns, two per k-tile (``hf_sparse/ops/pack.py``). Each line reads, for 2:4,
``few-token BN x S`` (the cp.async tiles) or ``config C (BN) x S`` (a persistent configuration), as
``sm90_sparse24_plan`` chooses; for V:2:M, ``CUDA cores`` (``sm90_vnm_gemv``), ``X^T BN x S``
(``sm90_vnm_xt_plan``) or ``registers BN x S`` (``sm90_vnm_plan``); then the CTAs of a non-persistent split launch and
how its splits sum (``shared`` where ``sm90_split_sum_shared`` holds, else ``last``). ``--against`` compiles the same
program against REV's header, so REV must have these functions.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_kernels import LLAMA_SHAPES, parse_shape

from hf_sparse.patterns import NM, VNM, PatternError, parse_pattern

ROOT = Path(__file__).resolve().parents[1]

# One cell per input line: "m v k rows tokens sms"; one plan per output line.
PROGRAM = r"""
#include <cstdio>
#include "tile_config.h"
using namespace hf_sparse;

// A non-persistent split launch of `ctas_per_sm` CTAs per SM: its CTAs and how its splits sum.
static void split(const Sm90SplitPlan& p, int sms, int ctas_per_sm) {
  if (p.splits > 1)
    std::printf(", %lld CTAs, %s", p.tiles * p.splits,
                sm90_split_sum_shared(p.tiles, p.splits, (long long)sms * ctas_per_sm) ? "shared" : "last");
}

int main() {
  long long m, v, k, rows, tokens, sms;
  while (std::scanf("%lld %lld %lld %lld %lld %lld", &m, &v, &k, &rows, &tokens, &sms) == 6) {
    const long long rows_padded = (rows + 63) / 64 * 64, steps = (k / m + 7) / 8, k_tiles = (steps + 1) / 2;
    if (m == 4) {
      const Sm90Sparse24Plan p = sm90_sparse24_plan(rows_padded, tokens, k_tiles, (int)sms);
      if (p.few_token) {
        std::printf("few-token %d x %d", p.split.bn, p.split.splits);
        split(p.split, (int)sms, kSm90SmallCtasPerSm);
      } else {
        std::printf("config %d (%d) x %d", p.config, p.split.bn, p.split.splits);
      }
    } else if (sm90_vnm_gemv((int)m, tokens, k, rows_padded, (int)sms)) {
      std::printf("CUDA cores");
    } else if (sm90_vnm_xt((int)m, tokens, (int)rows, k, (int)v)) {
      const Sm90SplitPlan p = sm90_vnm_xt_plan(rows_padded, tokens, k_tiles, (int)sms);
      std::printf("X^T %d x %d", p.bn, p.splits);
    } else {
      const Sm90SplitPlan p = sm90_vnm_plan((int)m, rows_padded, tokens, k_tiles, (int)sms);
      std::printf("registers %d x %d", p.bn, p.splits);
      split(p, (int)sms, sm90_vnm_ctas_per_sm((int)m, p.bn));
    }
    std::printf("\n");
  }
  return 0;
}
"""


def kernel_pattern(text: str) -> tuple[int, int]:
    """A pattern the sparse-wgmma SpMMs run, as (V, M): ``"2:4"`` -> (64, 4) (the 2:4 kernel's V); ``"V:2:M"`` with
    M >= 8 -> (V, M). Parsed by ``hf_sparse.parse_pattern``."""
    try:
        p = parse_pattern(text)
    except PatternError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if isinstance(p, NM) and p.sptc_runnable:
        return 64, 4
    if isinstance(p, VNM) and p.n == 2 and p.m >= 8:
        return p.v, p.m
    raise argparse.ArgumentTypeError(f"pattern {text!r}: the sparse-wgmma SpMMs run 2:4 and V:2:M with M >= 8")


def build_chooser(header_dir: Path, folder: Path, name: str) -> Path:
    """Compiles PROGRAM against the ``tile_config.h`` in ``header_dir`` into ``folder/name``."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        sys.exit("show_plans.py needs a host C++ compiler (g++ or c++) on PATH")
    (folder / "plans.cpp").write_text(PROGRAM)
    exe = folder / name
    done = subprocess.run(
        [cxx, "-std=c++17", f"-I{header_dir}", str(folder / "plans.cpp"), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"could not compile the plan program against {header_dir / 'tile_config.h'}:\n{done.stderr}")
    return exe


def plans(exe: Path, cells: list[tuple[str, int, int, int, int, int]], sms: int) -> list[str]:
    """The plan of each (pattern, v, m, k, rows, tokens) cell, one string each."""
    stdin = "".join(f"{m} {v} {k} {r} {t} {sms}\n" for _, v, m, k, r, t in cells)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def header_at(rev: str, folder: Path) -> Path:
    """``csrc/tile_config.h`` as commit ``rev`` has it, written into ``folder``."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:csrc/tile_config.h"], capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"--against {rev}: git could not show csrc/tile_config.h there: {done.stderr.strip()}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tile_config.h").write_text(done.stdout)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--patterns", nargs="+", default=["2:4", "64:2:8", "64:2:16"])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=None, help="KxR (default: the Llama shapes)")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 32, 64, 96, 128, 192, 256])
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H200 and H100 SXM: 132)")
    ap.add_argument("--against", metavar="REV", help="show only the cells whose plan differs at this commit")
    args = ap.parse_args(argv)
    try:
        patterns = [(p, *kernel_pattern(p)) for p in args.patterns]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    shapes = args.shapes or [parse_shape(s) for s in LLAMA_SHAPES]
    if any(t <= 0 for t in args.tokens) or args.sms <= 0:
        ap.error("--tokens and --sms must be positive")
    cells = [(name, v, m, k, r, t) for name, v, m in patterns for k, r in shapes for t in args.tokens]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        now = plans(build_chooser(ROOT / "csrc", folder, "now"), cells, args.sms)
        before = None
        if args.against:
            old = header_at(args.against, folder / "old")
            before = plans(build_chooser(old, folder, "before"), cells, args.sms)
    shown = 0
    for i, (name, _, _, k, r, t) in enumerate(cells):
        if before is not None and before[i] == now[i]:
            continue
        plan = now[i] if before is None else f"{before[i]}  =>  {now[i]}"
        print(f"{name:8s} {k:6d} -> {r:6d} {t:5d} tokens: {plan}")
        shown += 1
    if before is not None:
        print(f"{shown} of {len(cells)} cells planned differently at {args.against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
