"""CPU: ``benchmarks/roofline_sm90.cu`` (the ceilings behind the SpMMs' bounds) still compiles against the kernel
headers it shares with ``csrc/``, for sm_90a, and ptxas keeps its wgmmas asynchronous: a serialized wgmma (warnings
C7510-C7520) would make the ceilings it measures wrong. Needs ``nvcc`` (CUDA 12.3 or newer); skipped without it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def find_nvcc() -> str | None:
    candidates = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", "/usr/local/cuda-13.0"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    return next((c for c in candidates if c and Path(c).is_file()), None)


@pytest.mark.slow  # ~30 s on 2 CPU cores
def test_roofline_benchmark_compiles_with_asynchronous_wgmmas(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    cmd = [
        nvcc,
        "-std=c++17",
        "-O3",
        "-gencode=arch=compute_90a,code=sm_90a",
        f"-I{ROOT / 'csrc'}",
        "-c",
        str(ROOT / "benchmarks" / "roofline_sm90.cu"),
        "-o",
        str(tmp_path / "roofline.o"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "C751" not in log and "C752" not in log, log
