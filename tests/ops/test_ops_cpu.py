"""CPU: the reference ops against plain torch, opcheck on every custom op, the extension build's rules."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_sparse.ops import pack, scatter_dense, sddmm, spmm
from hf_sparse.ops.pack import _pack_op
from hf_sparse.ops.sddmm import _sddmm_op
from hf_sparse.ops.spmm import _spmm_op

from ._helpers import fake_compiler, random_masked, rel_err


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8), (128, 32)])
def test_spmm_reference_matches_linear(v, m):
    w, mask = random_masked(128, 256, v, m)
    p = pack(w, mask, v, m, torch.bfloat16)
    x = torch.randn(3, 5, 256).bfloat16()
    b = torch.randn(128).bfloat16()
    y = spmm(x, p, b)
    assert y.shape == (3, 5, 128) and y.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.bfloat16().float(), b.float())
    assert rel_err(y, ref) < 1e-2


def test_sddmm_reference_and_scatter():
    w, mask = random_masked(64, 64, 64, 8)
    p = pack(w, mask, 64, 8, torch.bfloat16)
    x = torch.randn(9, 64).bfloat16()
    dy = torch.randn(9, 64).bfloat16()
    g = scatter_dense(sddmm(dy, x, p), p, torch.float32)
    full = dy.float().t() @ x.float()
    assert torch.allclose(g, torch.where(mask, full, 0.0), atol=1e-4, rtol=1e-4)
    assert not bool(torch.signbit(g[~mask]).any())


def _op_args(seed=0):
    w, mask = random_masked(64, 64, 64, 8, seed=seed)
    p = pack(w, mask, 64, 8, torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    dy = torch.randn(5, 64).bfloat16()
    return w, mask, p, x, dy


def test_opcheck_all_ops():
    w, mask, p, x, dy = _op_args()
    pargs = (p.values, p.meta, p.columns, p.valid, p.rows, p.cols, p.v, p.m)
    torch.library.opcheck(_spmm_op, (x, *pargs[:4], torch.randn(64).bfloat16(), *pargs[4:]))
    torch.library.opcheck(_spmm_op, (x, *pargs[:4], None, *pargs[4:]))
    torch.library.opcheck(_sddmm_op, (dy, x, *pargs))
    torch.library.opcheck(_pack_op, (w, mask, 64, 8, torch.bfloat16, True))


def test_dispatch_is_a_stateless_harness():
    """Compact layers keep their own plans: the dispatcher holds no module-level caches or measured choices."""
    from hf_sparse.ops import dispatch

    assert dispatch.__all__ == ["can_measure", "costs", "fastest", "measure", "spare_bytes"]
    state = [n for n, v in vars(dispatch).items() if isinstance(v, (dict, list, set)) and not n.startswith("__")]
    assert state == [], state


def test_import_touches_no_cuda():
    code = (
        "import torch, hf_sparse.ops, hf_sparse.nn\n"
        "assert not torch.cuda.is_initialized()\n"
        "import hf_sparse.ops._build as b\n"
        "assert b.load_extension.cache_info().currsize == 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_kernel_without_gpu_says_what_to_do():
    from hf_sparse.ops._build import KernelUnavailableError, load_extension

    with pytest.raises(KernelUnavailableError, match="CUDA GPU"):
        load_extension()


def test_a_failed_compile_is_not_retried_in_the_same_process(monkeypatch, tmp_path):
    """SparseTrainer asks for the kernels at train start and again when it switches layers: a compile that failed
    must fail the second time at once, with the same message, not compile again."""
    from hf_sparse.ops import _build

    compiles = []

    def failing_compile(**kwargs):
        compiles.append(kwargs["name"])
        raise RuntimeError("nvcc: error in spmm.cu")

    fake_compiler(monkeypatch, tmp_path, failing_compile)
    for _ in range(2):
        with pytest.raises(_build.KernelUnavailableError, match="building the CUDA kernels failed.*nvcc: error"):
            _build.load_extension()
    assert compiles == [_build.EXTENSION_NAME]
    assert _build.loaded_extension() is None


def test_sm90a_flag_only_with_arch_90():
    from hf_sparse.ops._build import arch_flags

    assert "-DHF_SPARSE_HAS_SM90A" in arch_flags(["8.0", "9.0"])
    assert "-gencode=arch=compute_90a,code=sm_90a" in arch_flags(["9.0"])
    assert "-DHF_SPARSE_HAS_SM90A" not in arch_flags(["8.0", "8.6", "8.9"])
