"""CPU: ``benchmarks/ncu_source_regions.py`` cuts an ncu source page into regions at landmark instructions and sums
their warp stall samples; the expected rows are counted by hand from the page below."""

from __future__ import annotations

import pytest
from ncu_source_regions import main, opcode, read_source_page, regions

PAGE = """==PROF== Connected to process 1
"Kernel Name","void kernel(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples"
"0x10","      LDC R1, c[0x0][0x28]","8","8","8"
"0x20","      ULDC UR4, c[0x0][0x51c]","16","10","16"
"0x30","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8","10","9","10"
"0x40","@!P0  BRA 0x340","13","12","13"
"0x50","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R21+URZ+0x33c00], R16","4","4","4"
"0x60","@!P0  BRA 0xcae0","184","180","184"
"0x70","      HGMMA.SP.64x128x32.F32.BF16 R24, R88, gdesc[UR4], R24, R104, 0x0","11","2","11"
"0x80","      HGMMA.SP.64x128x32.F32.BF16 R24, R92, gdesc[UR4], R24, R105, 0x0, gsb0","3","1","3"
"0x90","      STG.E.STRONG.GPU desc[UR30][R12.64], R24","7","7","7"
"0xa0","      MEMBAR.SC.GPU","11","11","11"
"0xb0","      ERRBAR","118","118","118"
"0xc0","      EXIT","","",""
"""


def test_opcode_drops_predicate_and_modifiers():
    assert opcode("@!P0  HGMMA.SP.64x128x32.F32.BF16 R24, R88") == "HGMMA"
    assert opcode("      ERRBAR") == "ERRBAR"
    assert opcode("") == ""


def test_regions_start_at_landmarks_and_sum_their_samples():
    instructions = read_source_page(PAGE)
    assert len(instructions) == 12 and instructions[5] == ("@!P0  BRA 0xcae0", 184.0) and instructions[11][1] == 0.0
    got = [(r.first, r.last, r.landmark, r.samples) for r in regions(instructions)]
    # LDC, ULDC: the start; USETMAXREG and the spin branch; the first stage's wait and its branch; both HGMMAs and the
    # partial store (STG is no landmark); MEMBAR and ERRBAR; EXIT
    assert got == [
        (0, 1, "start", 24.0),
        (2, 3, "USETMAXREG", 23.0),
        (4, 5, "SYNCS", 188.0),
        (6, 8, "HGMMA", 21.0),
        (9, 10, "MEMBAR", 129.0),
        (11, 11, "EXIT", 0.0),
    ]


def test_main_prints_the_regions_and_the_top_instructions(tmp_path, capsys):
    path = tmp_path / "src.csv"
    path.write_text(PAGE)
    assert main([str(path), "--top", "2", "--min-share", "6"]) == 0
    out = capsys.readouterr().out
    assert "12 instructions, 385 warp stall samples" in out
    assert "| 4-5 | `SYNCS.PHASECHK" in out and "| 188 | 48.8% |" in out
    assert "| 0-1 | `LDC R1" in out and "| 9-10 | `MEMBAR.SC.GPU` | 129 | 33.5% |" in out
    # under 6% of 385: USETMAXREG's 23 (6.0%, 5.97), the HGMMAs' 21 (5.5%), EXIT's 0
    assert "| 2-3 |" not in out and "| 6-8 |" not in out and "| 11-11 |" not in out
    assert "184  47.8%  @!P0  BRA 0xcae0" in out and "118  30.6%  ERRBAR" in out


def test_a_page_without_samples_or_header_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no ncu source page"):
        read_source_page("==PROF== nothing here\n")
    path = tmp_path / "src.csv"
    path.write_text(PAGE.replace('"8","8","8"', '"0","0","0"').replace('"16"', '"0"'))
    assert main([str(path)]) == 0  # samples remain elsewhere
