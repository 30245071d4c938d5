"""CPU: ``benchmarks/roofline_sm90.cu`` (the ceilings behind the SpMMs' bounds) still compiles against the kernel
headers it shares with ``csrc/``, for sm_90a, and ptxas keeps its wgmmas asynchronous: a serialized wgmma (warnings
C7510-C7520) would make the ceilings it measures wrong; ``benchmarks/transpose_bench.cu`` still compiles against the
product's transpose (``csrc/transpose_tokens.cuh``). Needs ``nvcc`` (CUDA 12.3 or newer); skipped without it."""

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


def compile_benchmark(source: str, out: Path, *, link: bool) -> str:
    """nvcc's log of compiling ``benchmarks/<source>`` for sm_90a against ``csrc/`` (an object, or linked where
    ``link``); fails the test if it does not compile, skips it without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    cmd = [nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT / 'csrc'}"]
    cmd += [*([] if link else ["-c"]), str(ROOT / "benchmarks" / source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    return log


@pytest.mark.slow  # ~30 s on 2 CPU cores
def test_roofline_benchmark_compiles_with_asynchronous_wgmmas(tmp_path):
    log = compile_benchmark("roofline_sm90.cu", tmp_path / "roofline.o", link=False)
    assert "C751" not in log and "C752" not in log, log


@pytest.mark.slow  # ~5 s
def test_transpose_benchmark_compiles_against_the_product_kernel(tmp_path):
    compile_benchmark("transpose_bench.cu", tmp_path / "transpose_bench", link=True)
