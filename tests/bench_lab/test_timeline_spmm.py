"""CPU: ``benchmarks/timeline_spmm.py`` turns the timeline build's per-CTA stamps into phases; the expected figures
are worked out by hand from the rows below (ns stamps, columns in ``TimelineMark`` order)."""

from __future__ import annotations

import pytest
from timeline_spmm import cta_phases, describe, summarize

# entry, set-up, first issued, first ready, loop done, arrived, summed, end, SM, last
SPLIT_NOT_LAST = [10_000, 10_500, 10_700, 12_000, 20_000, 21_000, 0, 21_200, 3, 0]
SPLIT_LAST = [11_000, 11_400, 11_600, 13_000, 22_000, 23_500, 25_500, 27_000, 5, 1]
UNSPLIT = [10_500, 0, 0, 12_500, 19_500, 0, 0, 20_500, 5, 0]
STALE_ROW = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # a CTA the call did not run (cleared since the last read)


def test_a_non_last_split_ends_after_its_arrival():
    assert cta_phases(SPLIT_NOT_LAST, t0=10_000) == {
        "launch": 0.0,
        "fill": 2.0,
        "main loop": 8.0,
        "set-up": 0.5,
        "arrival": 1.0,
        "epilogue": 0.2,
    }


def test_the_last_split_sums_then_stores():
    assert cta_phases(SPLIT_LAST, t0=10_000) == {
        "launch": 1.0,
        "fill": 2.0,
        "main loop": 9.0,
        "set-up": 0.4,
        "arrival": 1.5,
        "sum": 2.0,
        "epilogue": 1.5,
    }


def test_an_unsplit_cta_without_set_up_stamp_goes_from_loop_to_exit():
    assert cta_phases(UNSPLIT, t0=10_000) == {"launch": 0.5, "fill": 2.0, "main loop": 7.0, "epilogue": 1.0}


def test_summary_over_the_call_ctas_only():
    s = summarize([SPLIT_NOT_LAST, STALE_ROW, SPLIT_LAST, UNSPLIT])
    assert s["ctas"] == 3 and s["sms"] == 2 and s["max_ctas_per_sm"] == 2
    assert s["span_us"] == pytest.approx(17.0)  # 27_000 - 10_000
    assert s["phases"]["main loop"] == (8.0, 9.0)
    assert s["phases"]["launch"] == (0.5, 1.0)
    assert s["phases"]["sum"] == (2.0, 2.0)
    assert s["phases"]["epilogue"] == (1.0, 1.5)
    assert s["critical"]["sum"] == 2.0  # the last split exits last
    line = describe(s)
    assert "3 CTAs on 2 SMs" in line and "span 17.0" in line and "main loop 8.0/9.0" in line


def test_no_stamped_cta_is_an_error_that_says_why():
    with pytest.raises(ValueError, match="timeline build"):
        summarize([STALE_ROW])
