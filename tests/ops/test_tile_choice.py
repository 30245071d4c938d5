"""CPU: the 2:4 sparse-wgmma SpMM's tile choice above 128 tokens (``sm90_large_config`` in ``csrc/tile_config.h``),
compiled on its own with the host compiler, against hand-computed choices."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"

# (rows_padded, tokens, SMs) -> config: 20 = 128 x 256 tiles, 27 = 128 x 192, 23 = 128 x 128. Fill = tiles / (rounds *
# SMs) for each token tile; 20 unless 256 fills < 85% and 192 or 128 fills > 10 points better; then 27 unless 128
# fills > 2 points better than 192.
CASES = [
    # 6 row blocks x 32 token tiles = 192 tiles: 73% of 2 rounds; 192: 258 tiles 98%; 128: 384 tiles 97% -> 27
    ((768, 8192, 132), 27),
    # 32 x 2 = 64 tiles: 48%; 192: 64 tiles 48%; 128: 96 tiles 73% -> 23
    ((4096, 300, 132), 23),
    # 32 x 32 = 1024 tiles: 97% of 8 rounds -> 20
    ((4096, 8190, 132), 20),
    # 32 x 17 = 544 tiles: 82% of 5 rounds; 192: 704 tiles 89%; 128: 1056 tiles 100% -> 23
    ((4096, 4100, 132), 23),
    # 1 x 1 tile: 0.8%; 192 and 128: 2 tiles 1.5%, less than 10 points better -> 20
    ((128, 256, 132), 20),
    # 114 SMs: 192 tiles 84% of 2 rounds; 192: 258 tiles 75% of 3; 128: 384 tiles 84% of 4: none 10 points better -> 20
    ((768, 8192, 114), 20),
]

PROGRAM = r"""
#include <cstdio>
#include "tile_config.h"
int main(int argc, char** argv) {
  long long rows, tokens; int sms;
  while (std::scanf("%lld %lld %d", &rows, &tokens, &sms) == 3)
    std::printf("%d\n", hf_sparse::sm90_large_config(rows, tokens, sms));
  return 0;
}
"""


@pytest.fixture(scope="module")
def chooser(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler")
    folder = tmp_path_factory.mktemp("tile_choice")
    (folder / "main.cpp").write_text(PROGRAM)
    exe = folder / "choose"
    subprocess.run([cxx, "-std=c++17", f"-I{CSRC}", str(folder / "main.cpp"), "-o", str(exe)], check=True)
    return exe


def test_sm90_large_config_matches_hand_computed_choices(chooser):
    stdin = "".join(f"{r} {t} {s}\n" for (r, t, s), _ in CASES)
    out = subprocess.run([str(chooser)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    assert [int(c) for c in out] == [expected for _, expected in CASES]
