"""CPU: ``benchmarks/fit_xt_width.py`` scores values of the X^T work model's fixed cost against plans timed on trees
with different values. The plans are hand-computed (as in tests/ops/test_tile_choice.py), the times made up."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fit_xt_width import plan_inputs, plans_for

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fit_xt_width.py"
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

# 64:2:8, 4096 -> 11008 at 512 tokens (86 row blocks, 32 k-tiles): at (tile tokens + 192) per k-tile 256-token tiles
# (2 rounds x 448 x 32 = 28672 against 3 x 320 x 32 = 30720), at + 16 128-token ones (2 x 272 x 32 = 17408 against
# 3 x 144 x 32 = 13824); 64:2:8, 4096 -> 4096 at 256 tokens (32 row blocks, 32 k-tiles): 128 tokens in 2 splits at
# both (+ 192: 320 x 25 = 8000 against 448 x 23 = 10304 at 256; + 16: 144 x 25 = 3600 against 272 x 23 = 6256)
WIDE = ("64:2:8", 4096, 11008, 512)
SAME = ("64:2:8", 4096, 4096, 256)


def row(cell, chain, cold, dense=100.0):
    pattern, k, r, tokens = cell
    return {
        "pattern": pattern,
        "k": k,
        "r": r,
        "tokens": tokens,
        "product": cold,
        "product_chain": chain,
        "dense": dense,
    }


def test_plan_inputs_pad_rows_to_v_and_count_two_steps_a_k_tile():
    assert plan_inputs(WIDE) == (11008, 512, 32)
    assert plan_inputs(("128:2:16", 1040, 4160, 300)) == (4224, 300, 5)  # 65 groups: 9 steps, 5 k-tiles


@needs_cxx
def test_plans_follow_the_value_of_the_constant(tmp_path):
    plans = {v: plans_for(v, [WIDE, SAME], tmp_path) for v in (192, 16)}
    assert plans[192] == {WIDE: (256, 1), SAME: (128, 2)}
    assert plans[16] == {WIDE: (128, 1), SAME: (128, 2)}


@needs_cxx
def test_scores_and_table(tmp_path):
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    # the 256-token plan 90 µs in a chain (100 cold), the 128-token one 72 (90): 1.25x (1.11x); SAME is one plan on both
    # trees, so not scored
    old.write_text("\n".join(json.dumps(r) for r in (row(WIDE, 90.0, 100.0), row(SAME, 50.0, 55.0))) + "\n")
    new.write_text("\n".join(json.dumps(r) for r in (row(WIDE, 72.0, 90.0), row(SAME, 51.0, 56.0))) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--runs",
            f"{old}=192",
            f"{new}=16",
            "--values",
            "192",
            "16",
            "--table",
            "192",
            "16",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert " 192: 1 cells, x1.250 the fastest plan's chain time" in out
    assert "  16: 1 cells, x1.000 the fastest plan's chain time" in out
    assert "| 64:2:8 | 4096 -> 11008 | 512 | 256/1 -> 128/1 | 100.0 -> 90.0 | 1.11 | 1.25 | 1.00x -> 1.11x |" in out
    assert "4096 -> 4096" not in out
    assert "1 cells: cold x1.111 (1.11-1.11), chain x1.250 (1.25-1.25)" in out


def test_a_run_without_its_value_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", str(tmp_path / "a.jsonl"), "--values", "16"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "--runs takes FILE=VALUE" in result.stderr
