"""CPU: ``benchmarks/timeline_xt.py`` turns the timeline build's per-CTA cycle counters of the V:2:M X^T path into
per-role shares; the expected figures are worked out by hand from the rows below (columns in ``XtCounter`` order)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from timeline_xt import describe, summarize

# units, producer, set-up, empty wait, consumer, full wait, drain, split-K, epilogue, stage flight, steps
CTA_A = [4, 40_000, 4_000, 20_000, 40_000, 10_000, 2_000, 0, 8_000, 100_000, 40]
CTA_B = [2, 30_000, 6_000, 6_000, 30_000, 15_000, 3_000, 0, 3_000, 30_000, 20]
CTA_C = [4, 48_000, 4_800, 24_000, 48_000, 9_600, 2_400, 0, 4_800, 120_000, 40]
IDLE = [0] * 11  # a CTA the call did not run


def test_medians_over_the_ctas_that_ran_units():
    s = summarize([CTA_A, IDLE, CTA_B, CTA_C])
    assert s["ctas"] == 3
    assert s["units"] == 4
    # cycles per unit: 10_000, 15_000, 12_000 for both roles
    assert s["consumer_cycles_per_unit"] == 12_000
    assert s["producer_cycles_per_unit"] == 12_000
    # per step: consumer 1_000, 1_500, 1_200; stage flight 2_500, 1_500, 3_000
    assert s["consumer_cycles_per_step"] == 1_200
    assert s["stage_flight_cycles"] == 2_500
    # full wait 0.25, 0.5, 0.2; drain 0.05, 0.1, 0.05; epilogue 0.2, 0.1, 0.1; other 0.5, 0.3, 0.65
    assert s["consumer"] == pytest.approx(
        {"full wait": 0.25, "drain": 0.05, "split-K": 0.0, "epilogue": 0.1, "other": 0.5}
    )
    # set-up 0.1, 0.2, 0.1; empty wait 0.5, 0.2, 0.5; other 0.4, 0.6, 0.4
    assert s["producer"] == pytest.approx({"set-up": 0.1, "empty wait": 0.5, "other": 0.4})


def test_describe_names_each_share():
    line = describe(summarize([CTA_A]))
    assert "4 units each" in line and "full wait 25%" in line and "empty wait 50%" in line and "set-up 10%" in line
    assert "a step 1000 cycles, a stage in flight 2500" in line


def test_no_counted_unit_is_an_error_that_says_why():
    with pytest.raises(ValueError, match="timeline build"):
        summarize([IDLE, IDLE])


def test_a_negative_split_count_is_refused_before_any_gpu_work():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "timeline_xt.py"
    done = subprocess.run(
        [sys.executable, str(script), "--splits", "0", "-2"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--splits: counts are 0 (the product's) or more" in done.stderr
