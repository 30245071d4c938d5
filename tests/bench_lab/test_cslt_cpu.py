"""CPU: the lab's cuSPARSELt path (lab.cslt): its shape rules, how its installation is found, that it is built in the
lab build only, and that nothing is built at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from lab import cslt
from lab.cslt import find_cusparselt, load_cslt_extension

from hf_sparse.ops import _build
from hf_sparse.ops._build import KernelUnavailableError

from .conftest import BENCHMARKS


@pytest.mark.parametrize(
    ("rows", "cols", "tokens", "dtype", "ok"),
    [
        (3072, 768, 8192, torch.bfloat16, True),
        (16, 16, 8, torch.float16, True),
        (3072, 768, 8191, torch.bfloat16, False),  # tokens: multiple of 8 (dense 16-bit operand)
        (3072, 760, 8192, torch.bfloat16, False),  # K: multiple of 16 (structured operand)
        (3064, 768, 8192, torch.bfloat16, False),  # R: multiple of 16
        (3072, 768, 8192, torch.float32, False),  # 16-bit only here
        (3072, 768, 0, torch.bfloat16, False),
    ],
)
def test_supports_follows_cusparselt_rules(rows, cols, tokens, dtype, ok):
    assert cslt.supports(rows, cols, tokens, dtype) is ok


def test_find_cusparselt_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPARSE_CUSPARSELT_DIR", str(tmp_path))
    assert find_cusparselt() is None  # empty folder
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cusparseLt.h").write_text("// header\n")
    assert find_cusparselt() is None  # header without library
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libcusparseLt.so.0").write_bytes(b"\x7fELF")
    assert find_cusparselt() == (tmp_path / "include", tmp_path / "lib" / "libcusparseLt.so.0")


def test_find_cusparselt_in_pip_layout(tmp_path, monkeypatch):
    # the cu13 wheel's layout: <site>/nvidia/cu13/{include/cusparseLt.h, lib/libcusparseLt.so.0}
    pkg = tmp_path / "nvidia"
    (pkg / "cu13" / "include").mkdir(parents=True)
    (pkg / "cu13" / "lib").mkdir()
    (pkg / "cu13" / "include" / "cusparseLt.h").write_text("// header\n")
    (pkg / "cu13" / "lib" / "libcusparseLt.so.0").write_bytes(b"\x7fELF")
    fake = type(sys)("nvidia")
    fake.__path__ = [str(pkg)]
    monkeypatch.delenv("HF_SPARSE_CUSPARSELT_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "nvidia", fake)
    assert find_cusparselt() == (pkg / "cu13" / "include", pkg / "cu13" / "lib" / "libcusparseLt.so.0")


def test_outside_the_lab_build_cslt_is_unavailable_and_says_why(monkeypatch):
    monkeypatch.setattr(_build, "lab_build", lambda: False)
    monkeypatch.setattr(cslt, "lab_build", lambda: False)
    with pytest.raises(KernelUnavailableError, match="HF_SPARSE_BUILD_LAB=1"):
        load_cslt_extension.__wrapped__()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_without_gpu_cslt_is_unavailable_and_says_why(monkeypatch):
    monkeypatch.setattr(cslt, "lab_build", lambda: True)
    with pytest.raises(KernelUnavailableError, match="CUDA GPU"):
        load_cslt_extension.__wrapped__()
    assert cslt.available.__wrapped__() is False


def test_import_builds_nothing():
    code = (
        "import torch, hf_sparse, hf_sparse.ops.dispatch, lab.cslt, lab.tuning\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert lab.cslt.load_cslt_extension.cache_info().currsize == 0\n"
        "assert lab.cslt.available.cache_info().currsize == 0\n"
        "import hf_sparse.ops._build as b\n"
        "assert b.load_extension.cache_info().currsize == 0\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BENCHMARKS, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
