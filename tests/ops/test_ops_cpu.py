"""CPU: the reference ops against plain torch, opcheck on every custom op, sparse_linear gradients."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_sparse.nn.sparse_matmul import sparse_linear
from hf_sparse.ops import pack, scatter_dense, sddmm, spmm
from hf_sparse.ops.pack import _pack_op
from hf_sparse.ops.sddmm import _sddmm_op
from hf_sparse.ops.spmm import _spmm_op

from ._helpers import random_masked, rel_err


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


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 16), (64, 32), (64, 128)])
def test_vnm_weight_has_an_exact_2to4_view_that_follows_repacks(v, m):
    """A V:2:M weight keeps <= 2 of every 4 columns of a row, so the dispatcher's 2:4 view must hold it exactly, and
    must follow the weight once the V:2:M pack is repacked after an optimizer step."""
    from hf_sparse.ops import dispatch, repack
    from hf_sparse.ops._layout import dense_from_packed

    w, mask = random_masked(128, 8 * m, v, m, seed=m)
    p = pack(w, mask, v, m, torch.bfloat16)
    assert int(mask.view(128, -1, 4).sum(-1).max()) <= 2
    view = dispatch._view24(w, p)
    assert (view.v, view.m, view.rows, view.cols) == (64, 4, 128, 8 * m)
    assert torch.equal(dense_from_packed(view, torch.float32), w.bfloat16().float())
    assert dispatch._view24(w, p) is view  # cached per mask while the values do not change
    w2 = torch.where(mask, torch.randn(w.shape), 0.0)  # an optimizer step: new values, same mask
    p2 = repack(w2, p)
    assert torch.equal(dense_from_packed(dispatch._view24(w2, p2), torch.float32), w2.bfloat16().float())
    dispatch.clear_cache()


def test_opcheck_all_ops():
    w, mask, p, x, dy = _op_args()
    pargs = (p.values, p.meta, p.columns, p.valid, p.rows, p.cols, p.v, p.m)
    torch.library.opcheck(_spmm_op, (x, *pargs[:4], torch.randn(64).bfloat16(), *pargs[4:]))
    torch.library.opcheck(_spmm_op, (x, *pargs[:4], None, *pargs[4:]))
    torch.library.opcheck(_sddmm_op, (dy, x, *pargs))
    torch.library.opcheck(_pack_op, (w, mask, 64, 8, torch.bfloat16, True))


@pytest.mark.parametrize("backend", ["sparse", "dense"])
def test_sparse_linear_grads_match_masked_dense(backend, monkeypatch):
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    w, mask = random_masked(64, 128, 64, 16, seed=4)
    weight = torch.nn.Parameter(w.clone())
    bias = torch.nn.Parameter(torch.randn(64))
    p = pack(weight.detach(), mask, 64, 16, torch.bfloat16)
    x = torch.randn(2, 7, 128, requires_grad=True)
    y = sparse_linear(x, weight, p, bias)
    g = torch.randn_like(y)
    (y * g).sum().backward()

    w2 = torch.nn.Parameter(w.clone())
    b2 = torch.nn.Parameter(bias.detach().clone())
    x2 = x.detach().bfloat16().float().requires_grad_(True)
    y2 = F.linear(x2, w2.bfloat16().float(), b2)
    (y2 * g.float()).sum().backward()
    assert rel_err(y, y2) < 1e-2
    assert rel_err(x.grad, x2.grad) < 1e-2
    assert rel_err(weight.grad, w2.grad * mask) < 1e-2
    assert torch.count_nonzero(weight.grad[~mask]) == 0
    assert rel_err(bias.grad, b2.grad) < 1e-2


def test_sparse_linear_transposable_input_grad():
    from hf_sparse.masks import transposable_2to4_mask

    torch.manual_seed(7)
    w = torch.randn(64, 128)
    mask = transposable_2to4_mask(w.abs())
    w = torch.where(mask, w, 0.0)
    weight = torch.nn.Parameter(w.clone())
    p = pack(w, mask, 64, 4, torch.bfloat16)
    pt = pack(w.t().contiguous(), mask.t().contiguous(), 64, 4, torch.bfloat16)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = sparse_linear(x, weight, p, None, pt)
    g = torch.randn_like(y)
    (y.float() * g.float()).sum().backward()
    x2 = x.detach().bfloat16().float().requires_grad_(True)
    (F.linear(x2, w.bfloat16().float()) * g.float()).sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-2
    with pytest.raises(ValueError, match="packed_t"):
        sparse_linear(x, weight, p, None, p)


def test_training_calls_reach_the_dispatcher_as_non_static(monkeypatch):
    """Autograd runs Function.forward with grad mode off, so whether the weight trains must be decided before it."""
    import hf_sparse.nn.sparse_matmul as sm

    seen = []
    real = sm.linear_forward

    def spy(*args, static_weight=True):
        seen.append(static_weight)
        return real(*args, static_weight=static_weight)

    monkeypatch.setattr(sm, "linear_forward", spy)
    from hf_sparse.masks import transposable_2to4_mask

    w = torch.randn(64, 64)
    mask = transposable_2to4_mask(w.abs())
    w = torch.where(mask, w, 0.0)
    p = pack(w, mask, 64, 4, torch.bfloat16)
    p_t = pack(w.t().contiguous(), mask.t().contiguous(), 64, 4, torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    weight = torch.nn.Parameter(w.clone())
    sparse_linear(x, weight, p, None, p_t)
    with torch.no_grad():
        sparse_linear(x, weight, p, None)
    frozen = torch.nn.Parameter(w.clone(), requires_grad=False)
    sparse_linear(x.requires_grad_(), frozen, p, None, p_t).sum().backward()
    assert seen == [False, True, True, True]  # training fwd; no_grad fwd; frozen weight: fwd and dX see it static


def test_backend_env_is_validated(monkeypatch):
    from hf_sparse.ops.dispatch import linear_forward

    monkeypatch.setenv("HF_SPARSE_BACKEND", "fast")
    w, mask, p, x, dy = _op_args()
    with pytest.raises(ValueError, match="HF_SPARSE_BACKEND"):
        linear_forward(x, w, p, None)


def test_import_touches_no_cuda():
    code = (
        "import torch, hf_sparse.ops, hf_sparse.nn.sparse_matmul\n"
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


def test_a_failed_compile_is_not_retried_in_the_same_process(monkeypatch):
    """SparseTrainer asks for the kernels at train start and again when it switches layers: a compile that failed
    must fail the second time at once, with the same message, not compile again."""
    from torch.utils import cpp_extension

    from hf_sparse.ops import _build

    compiles = []

    def failing_compile(**kwargs):
        compiles.append(kwargs["name"])
        raise RuntimeError("nvcc: error in spmm.cu")

    monkeypatch.setattr(_build, "_check_toolchain", lambda: None)
    monkeypatch.setattr(_build, "arch_flags", lambda: [])
    monkeypatch.setattr(cpp_extension, "load", failing_compile)
    monkeypatch.setattr(_build, "_build_failures", {})
    for _ in range(2):
        with pytest.raises(_build.KernelUnavailableError, match="building the CUDA kernels failed.*nvcc: error"):
            _build.load_extension()
    assert compiles == [_build.EXTENSION_NAME]
    assert _build.loaded_extension() is None


@pytest.mark.parametrize(
    ("op", "env", "fallback", "auto_at_least"),
    [("spmm", "HF_SPARSE_SPMM_KERNEL", "mma_sp", {4, 8}), ("sddmm", "HF_SPARSE_SDDMM_KERNEL", "mma", {4, 8})],
)
def test_kernel_env_is_validated_and_forces_the_kernel(op, env, fallback, auto_at_least, monkeypatch):
    import importlib

    module = importlib.import_module(f"hf_sparse.ops.{op}")
    choose, auto_m = getattr(module, f"{op}_kernel"), module.AUTO_WGMMA_M
    monkeypatch.setenv(env, "fastest")
    with pytest.raises(ValueError, match=env):
        choose(8)
    for m in (4, 8, 16, 32, 64, 128):  # forced choices never need the extension
        monkeypatch.setenv(env, "wgmma")
        assert choose(m) == "wgmma"
        monkeypatch.setenv(env, fallback)
        assert choose(m) == fallback
    monkeypatch.setenv(env, "auto")
    assert auto_at_least <= auto_m
    for m in {4, 8, 16, 32, 64, 128} - auto_m:  # not measured faster: the fallback, without asking the extension
        assert choose(m) == fallback


def test_sm90a_flag_only_with_arch_90():
    from hf_sparse.ops._build import arch_flags

    assert "-DHF_SPARSE_HAS_SM90A" in arch_flags(["8.0", "9.0"])
    assert "-gencode=arch=compute_90a,code=sm_90a" in arch_flags(["9.0"])
    assert "-DHF_SPARSE_HAS_SM90A" not in arch_flags(["8.0", "8.6", "8.9"])


def test_repack_many_matches_one_repack_per_weight_and_checks_its_input():
    from hf_sparse.ops import repack, repack_many

    weights, packs = [], []
    for i, (v, m) in enumerate([(64, 4), (64, 8), (128, 16), (64, 32)]):
        w, mask = random_masked(128, 8 * m, v, m, seed=20 + i)
        packs.append(pack(w, mask, v, m, torch.bfloat16))
        new = torch.where(mask, torch.randn(w.shape, generator=torch.Generator().manual_seed(i)), 0.0)
        weights.append(new.bfloat16() if i % 2 else new)  # fp32 and bf16 masters
    weights[0] = weights[0].t().contiguous().t()  # column-major: read through its strides
    got = repack_many(weights, packs, all_valid=[False, True, False, False])
    for w, p, g in zip(weights, packs, got, strict=True):
        assert torch.equal(g.values, repack(w, p).values) and g.meta is p.meta
    assert repack_many([], []) == []
    with pytest.raises(ValueError, match="2 weights but 1 packed"):
        repack_many(weights[:2], packs[:1])
    with pytest.raises(ValueError, match="weight shape"):
        repack_many([weights[1]], [packs[0]])
    half = packs[1]._replace(values=packs[1].values.half())
    with pytest.raises(ValueError, match="packed dtypes differ"):
        repack_many(weights[:2], [packs[0], half])
    with pytest.raises(ValueError, match="weight is torch.float64"):
        repack_many([weights[1].double()], [packs[1]])


@pytest.mark.parametrize("shape", [(128,), (7, 128), (2, 3, 128)])
def test_sparse_linear_takes_any_leading_dims_and_no_grad(shape):
    """The autograd function works on 2-D tensors inside: a 1-D input, batch dims and the no-autograd path must all
    give F.linear's shapes and values, and the gradients must come back in the input's shape."""
    from hf_sparse.masks import transposable_2to4_mask

    torch.manual_seed(3)
    w = torch.randn(64, 128)
    mask = transposable_2to4_mask(w.abs())
    w = torch.where(mask, w, 0.0)
    weight = torch.nn.Parameter(w.clone())
    bias = torch.nn.Parameter(torch.randn(64))
    p = pack(w, mask, 64, 4, torch.bfloat16)
    pt = pack(w.t().contiguous(), mask.t().contiguous(), 64, 4, torch.bfloat16)
    x = torch.randn(shape, requires_grad=True)
    ref_x = x.detach().bfloat16().float().requires_grad_(True)
    ref = F.linear(ref_x, w.bfloat16().float(), bias.detach())
    y = sparse_linear(x, weight, p, bias, pt)
    assert y.shape == ref.shape and rel_err(y, ref) < 1e-2
    g = torch.randn(ref.shape)
    (y.float() * g).sum().backward()
    (ref * g).sum().backward()
    assert x.grad.shape == x.shape and rel_err(x.grad, ref_x.grad) < 1e-2
    assert rel_err(weight.grad, (g.reshape(-1, 64).t() @ ref_x.detach().reshape(-1, 128)) * mask) < 1e-2
    assert rel_err(bias.grad, g.reshape(-1, 64).sum(0)) < 1e-2
    with torch.no_grad():
        y_eval = sparse_linear(x, weight, p, bias, pt)
    assert y_eval.grad_fn is None and torch.equal(y_eval, y.detach())
