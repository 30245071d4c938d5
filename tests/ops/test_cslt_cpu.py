"""CPU: the cuSPARSELt path's shape rules, how its installation is found, and that nothing is built at import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hf_sparse.ops import cslt
from hf_sparse.ops._build import KernelUnavailableError, find_cusparselt, load_cslt_extension


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_without_gpu_cslt_is_unavailable_and_says_why():
    with pytest.raises(KernelUnavailableError, match="CUDA GPU"):
        load_cslt_extension.__wrapped__()
    assert cslt.available() is False


def test_import_builds_nothing():
    code = (
        "import torch, hf_sparse, hf_sparse.ops.dispatch, hf_sparse.ops.cslt\n"
        "assert not torch.cuda.is_initialized()\n"
        "import hf_sparse.ops._build as b\n"
        "assert b.load_cslt_extension.cache_info().currsize == 0\n"
        "assert hf_sparse.ops.cslt.available.cache_info().currsize == 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
