"""CPU: ``benchmarks/xt_bytes_bound.py``, the bytes bound of the V:2:M X^T path at 65 tokens and more. The expected
byte counts and bounds are worked out by hand below from the byte model's parts (per 128-row tile and k-tile: the B
tile of 64 condensed rows x the tile's tokens x 2 bytes, twice at V = 64, and 9216 bytes of A and metadata; Y; split-K's
fp32 partial sums written and read; the transpose reading X and writing X^T)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fit_xt_width import choices_for
from xt_bytes_bound import bound_us

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "xt_bytes_bound.py"
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

# 64:2:8, 4096 -> 11008 at 256 tokens in one 256-token tile per row block: 86 tiles x 32 k-tiles x (2 x 32768 +
# 9216) + Y 11008 x 256 x 2 = 211353600 bytes through L2 -> SM; DRAM 86 x 32 x 9216 + X 4096 x 256 x 2 = 27459584;
# transpose 2 x 4096 x 256 x 2 = 4194304. At 9.0 / 4.6 TB/s: 23.4837 + 0.4660 µs.
WIDE = ("64:2:8", 4096, 11008, 256)
# 128:2:8, 11008 -> 4096 at 128 tokens, 128-token tiles in 4 splits: 172 steps, 86 k-tiles, 32 tiles: 32 x 86 x
# (16384 + 9216) + 4096 x 128 x 2 = 71499776, + partial sums 2 x 32 x 4 x 128 x 128 x 4 = 16777216; transpose
# 2 x 11008 x 128 x 2 = 5636096. At 9.0 TB/s: 9.8086 + 0.6262 µs (DRAM: 28180480 bytes, 6.13 µs, not the larger).
SPLIT = ("128:2:8", 11008, 4096, 128)


def test_bound_of_one_tile_per_row_block():
    bound, feed, dram = bound_us(WIDE, 256, 1, 9.0, 4.6)
    assert (feed, dram) == (211353600, 27459584)
    assert bound == pytest.approx(23.9497, abs=1e-3)


def test_bound_counts_split_k_partial_sums():
    bound, feed, dram = bound_us(SPLIT, 128, 4, 9.0, 4.6)
    assert (feed, dram) == (88276992, 28180480)
    assert bound == pytest.approx(10.4348, abs=1e-3)


def test_dram_sets_the_bound_where_it_is_the_slower():
    bound, feed, dram = bound_us(WIDE, 256, 1, 9.0, 1.0)  # 27459584 bytes at 1 TB/s: 27.4596 µs
    assert bound == pytest.approx(27.4596 + 0.4660, abs=1e-3)


@needs_cxx
def test_path_and_plans_of_the_header_as_it_is(tmp_path):
    at_64 = ("64:2:8", 4096, 11008, 64)  # 33-64 tokens at M = 8 and V = 64: the register pipeline
    at_64_v128 = ("128:2:8", 4096, 11008, 64)  # V = 128 and 45M >= 2^25 weights: the X^T path's 64-token tile
    few_rows = ("128:2:8", 3072, 768, 2048)  # 768 rows: the register pipeline
    m4 = ("64:2:4", 4096, 11008, 256)  # M = 4
    choices = choices_for(None, [WIDE, SPLIT, at_64, at_64_v128, few_rows, m4], tmp_path)
    assert choices[WIDE] == (True, (256, 1))
    assert choices[SPLIT] == (True, (128, 4))
    assert choices[at_64_v128][0] and choices[at_64_v128][1][0] == 64
    assert not choices[at_64][0] and not choices[few_rows][0] and not choices[m4][0]


@needs_cxx
def test_table_rows(tmp_path):
    runs = tmp_path / "runs.jsonl"
    rows = [
        {"pattern": p, "k": k, "r": r, "tokens": n, "dense_chain": dense, "product_chain": ours}
        for (p, k, r, n), dense, ours in (
            (WIDE, 33.7, 42.9),
            (SPLIT, 31.7, 24.5),
            (("64:2:8", 4096, 11008, 64), 30, 20),
        )
    ]
    runs.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(runs)], capture_output=True, text=True, check=True).stdout
    # 33.7 / 42.9 = 0.79x; 33.7 / 23.95 = 1.41x; 23.95 / 42.9 = 56%
    assert "| 64:2:8 | 4096 -> 11008 | 256 | 256 / 1 | 33.7 | 42.9 (0.79x) | 211 / 27 | 23.9 (1.41x) | 56% |" in out
    # 31.7 / 24.5 = 1.29x; 31.7 / 10.43 = 3.04x; 10.43 / 24.5 = 43%
    assert "| 128:2:8 | 11008 -> 4096 | 128 | 128 / 4 | 31.7 | 24.5 (1.29x) | 88 / 28 | 10.4 (3.04x) | 43% |" in out
    assert "| 64 |" not in out
