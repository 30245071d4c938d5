"""CPU: ``benchmarks/item2_status.py``, issue 17 item 2 cell by cell. Expected ratios are worked out by hand from the
rows below."""

from __future__ import annotations

import json

import pytest
from item2_status import TARGETS, cell_status, main


def row(pattern, tokens, **times):
    return {"pattern": pattern, "k": 4096, "r": 11008, "tokens": tokens, **times}


# 2:4 at 1.3x: 13.0 / 10.0 µs. Chain 26 / 20 = 1.3; bound 26 / 13 = 2.0, so the chain reaches 65% of it.
MET = row("2:4", 16, dense=13.0, product=10.0, dense_chain=26.0, product_chain=20.0, bytes_chain=13.0)
# 64:2:8 at 1.2x whose bound is 30 / 20 = 1.5x, under the 1.8x target: beyond reach.
BEYOND = row("64:2:8", 256, dense=12.0, product=10.0, dense_chain=30.0, product_chain=25.0, bytes_chain=20.0)
# 64:2:8 at 1.4x, chain 1.5x, bound 3.0x (50%); its 2:4 view 28 / 17.5 = 1.6x.
OPEN = row("64:2:8", 64, dense=28.0, product=20.0, dense_chain=30.0, product_chain=20.0, bytes_chain=10.0, view24=17.5)


def test_targets_are_the_issues():
    assert TARGETS == {"2:4": 1.3, "64:2:8": 1.8, "64:2:16": 2.5}


def test_a_cell_at_its_target_is_met():
    s = cell_status([MET], 1.3)
    assert (s["x"], s["chain"], s["bound"]) == pytest.approx((1.3, 1.3, 2.0))
    assert s["share"] == pytest.approx(0.65)
    assert s["state"] == "met"


def test_a_cell_whose_bound_is_under_the_target_is_beyond_reach():
    s = cell_status([BEYOND], 1.8)
    assert s["bound"] == pytest.approx(1.5)
    assert s["state"] == "beyond"


def test_an_open_cell_and_its_view():
    s = cell_status([OPEN], 1.8)
    assert s["state"] == "open"
    assert s["share"] == pytest.approx(0.5)
    assert s["view"] == pytest.approx(1.6)


def test_medians_over_repeated_rows():
    twice = [MET, {**MET, "product": 13.0}, {**MET, "product": 11.0}]  # median product 11.0
    assert cell_status(twice, 1.3)["x"] == pytest.approx(13.0 / 11.0)


def test_report_tables_and_summaries(tmp_path, capsys):
    path = tmp_path / "sweep.jsonl"
    other = row("128:2:8", 64, dense=1.0, product=1.0)  # no target in item 2: left out
    slow = row("64:2:8", 128, dense=9.0, product=10.0, dense_chain=9.0, product_chain=10.0, bytes_chain=3.0)
    path.write_text("".join(json.dumps(r) + "\n" for r in (MET, BEYOND, OPEN, slow, other)))
    main([str(path)])
    out = capsys.readouterr().out
    assert "| 4096 -> 11008 | **1.30 (1.30) [2.00] <65%>** |" in out
    assert "1.40 (1.50) [3.00] <50%> {1.60}" in out
    assert "2:4: 1 of 1 cells at 1.3x (bold); 0 where the bound is under it\n" in out
    assert (
        "64:2:8: 0 of 3 cells at 1.8x (bold); 1 where the bound is under it; the other 2 reach 30%-50% of their "
        "bound; 1 slower than cuBLAS (0.90x at worst)"
    ) in out
    assert "128:2:8" not in out


def test_no_rows_of_a_target_pattern_says_so(tmp_path):
    path = tmp_path / "sweep.jsonl"
    path.write_text(json.dumps(row("128:2:8", 64, dense=1.0, product=1.0)) + "\n")
    with pytest.raises(SystemExit, match="no rows of 2:4"):
        main([str(path)])
