"""CPU: ``benchmarks/show_plans.py``, the plans of ``csrc/tile_config.h`` per cell and the cells a rule change moves.
Expected plans are worked out by hand from the rules' documented inputs (132 SMs)."""

from __future__ import annotations

import argparse
import shutil

import pytest
from show_plans import ROOT, build_chooser, kernel_pattern, main, plans

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="needs g++")


@needs_cxx
def test_plans_of_the_grouped_query_projection(capsys):
    # 8192 -> 1024: 8 row blocks; 2:4 k-tiles 8192 / 64 = 128, 64:2:8 (8192 / 8 / 8 = 128 steps) 64.
    # 2:4 at 24 tokens: the 64-token tile, splits of at least 8 k-tiles where the shared sum holds: 16 (8 x 16 = 128
    # CTAs). At 96: the persistent 128-token tiles would split 8 ways (16 k-tiles each) into 64 units, half the SMs, so
    # the few-token 128-token tile, in 16 splits. 64:2:8 at 24: the rounds model's 16-token tiles in 16 splits, 256
    # CTAs, within the 3 x 132 the 16-token tile keeps resident: the shared sum.
    main(["--patterns", "2:4", "64:2:8", "--shapes", "8192x1024", "--tokens", "24", "96"])
    lines = [line.split("tokens: ")[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "few-token 64 x 16, 128 CTAs, shared",
        "few-token 128 x 16, 128 CTAs, shared",
        "registers 16 x 16, 256 CTAs, shared",
        "registers 128 x 16, 128 CTAs, shared",
    ]


@needs_cxx
def test_a_launch_past_the_resident_ctas_sums_the_last_split_way(capsys):
    # 4104 -> 12200, 2:4 at 16 tokens: 96 tiles of 65 k-tiles on 2 x 132 slots; 5 splits (13 k-tiles each) take 2
    # rounds of 17, 2 splits 1 of 37, 4 splits 2 of 21: 5, 480 CTAs, more than the 264 resident: the last split sums.
    main(["--patterns", "2:4", "--shapes", "4104x12200", "--tokens", "16"])
    assert capsys.readouterr().out.split("tokens: ")[1].strip() == "few-token 16 x 5, 480 CTAs, last"


@needs_cxx
def test_a_changed_rule_moves_only_its_cells(tmp_path):
    # The few-token tiles only up to 64 tokens (the rule before kSm90FewTokensShared): 8192 -> 1024 at 96 and 128
    # tokens go back to the persistent configuration 23 in 8 splits; 24 and 192 tokens (64 units there: not taken) stay.
    old = tmp_path / "old"
    old.mkdir()
    header = (ROOT / "csrc" / "tile_config.h").read_text()
    assert "kSm90FewTokensShared = 192" in header
    (old / "tile_config.h").write_text(header.replace("kSm90FewTokensShared = 192", "kSm90FewTokensShared = 64"))
    cells = [("2:4", 64, 4, 8192, 1024, t) for t in (24, 96, 128, 192)]
    now = plans(build_chooser(ROOT / "csrc", tmp_path, "now"), cells, 132)
    before = plans(build_chooser(old, tmp_path, "before"), cells, 132)
    assert [a != b for a, b in zip(before, now, strict=True)] == [False, True, True, False]
    assert before[1] == "config 23 (128) x 8"


@pytest.mark.parametrize("text", ["2:8", "64:2:4", "64:1:8", "a:2:8"])
def test_a_pattern_the_kernels_do_not_run_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        kernel_pattern(text)
