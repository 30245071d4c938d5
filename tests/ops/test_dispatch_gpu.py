"""GPU: the dispatcher's measurement and its 2:4 view of V:2:M weights (our 2:4 kernel on a 2:4 pack of them).

Fresh random weights and inputs (never zeros), NaN-poisoned allocator, error within 2x of PyTorch's own ``F.linear``
error in the same dtype against fp64. cuSPARSELt on V:2:M weights is tested in ``test_cslt_gpu.py`` (run apart).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from hf_sparse.ops import dispatch, pack, repack, spmm

from ._helpers import assert_linear_matches, poison_allocator, random_masked, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _fresh_dispatcher(monkeypatch):
    monkeypatch.setenv("HF_SPARSE_BACKEND", "auto")
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 8), (64, 16), (64, 32), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300, 8191])
def test_vnm_weight_on_the_2to4_kernel_matches_reference(v, m, dtype, tokens):
    w, mask = random_masked(256, 16 * m + 8 * m, v, m, device="cuda", seed=m + tokens)
    p = pack(w, mask, v, m, dtype)
    x = torch.randn(tokens, w.shape[1], device="cuda").to(dtype)
    b = torch.randn(256, device="cuda").to(dtype)
    poison_allocator()
    assert_linear_matches(spmm(x, dispatch._view24(w, p), b), x, w, b)


def test_2to4_view_follows_the_weight_after_a_repack():
    w, mask = random_masked(192, 512, 64, 8, device="cuda", seed=3)
    p = pack(w, mask, 64, 8, torch.bfloat16)
    x = torch.randn(64, 512, device="cuda").bfloat16()
    assert_linear_matches(spmm(x, dispatch._view24(w, p)), x, w)
    w2 = torch.where(mask, torch.randn_like(w), 0.0)  # optimizer step: same mask, new values
    p2 = repack(w2, p)
    poison_allocator()
    assert_linear_matches(spmm(x, dispatch._view24(w2, p2)), x, w2)


@pytest.mark.parametrize("static", [True, False])
def test_dispatcher_measures_the_2to4_view_of_a_vnm_weight(static):
    w, mask = random_masked(1024, 1024, 64, 8, device="cuda", seed=4)
    p = pack(w, mask, 64, 8, torch.bfloat16)
    x = torch.randn(4096, 1024, device="cuda").bfloat16()
    y = dispatch.linear_forward(x, w.bfloat16(), p, None, static_weight=static)
    kind = "fwd" if static else "fwd_train"
    choice = dispatch.choice(kind, 4096, p, x.device)
    assert choice in ("sparse", "sparse24", "dense", "cslt")
    # the view is kept only while some measured choice for this shape uses it
    assert (dispatch._views24.get(p.meta) is not None) == (choice == "sparse24")
    assert_linear_matches(y, x, w)
    poison_allocator()
    assert_linear_matches(dispatch.linear_forward(x, w.bfloat16(), p, None, static_weight=static), x, w)


def test_measurement_picks_by_gpu_time_and_drops_candidates_that_raise():
    a = torch.randn(2048, 2048, device="cuda")

    def python_heavy():  # 0.5 ms of host work (less than the spin ahead of it), almost no GPU work
        time.sleep(0.0005)
        return a[:1] + 1

    def one_gemm():
        return a @ a

    def two_gemms():
        return (a @ a) @ a

    def refuses():
        raise RuntimeError("not for this shape")

    assert dispatch._fastest({"two": two_gemms, "one": one_gemm, "refuses": refuses}) == "one"
    assert dispatch._fastest({"one": one_gemm, "python": python_heavy}) == "python"
    # inference's rule, GPU time plus the host time above the lightest candidate's: 0.5 ms of host work loses to a
    # ~0.3 ms GEMM, and two candidates with the same host work are ranked by GPU time
    assert dispatch._fastest({"one": one_gemm, "python": python_heavy}, host_too=True) == "one"
    assert dispatch._fastest({"two": two_gemms, "one": one_gemm}, host_too=True) == "one"


@pytest.mark.parametrize("choice", ["sparse", "sparse24", "dense"])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_resolved_forward_runs_the_measured_choice(choice, tokens, bias_dtype):
    w, mask = random_masked(256, 512, 64, 8, device="cuda", seed=tokens)
    p = pack(w, mask, 64, 8, torch.bfloat16)
    wb, b = w.bfloat16(), torch.randn(256, device="cuda").to(bias_dtype)
    assert dispatch.resolved_forward(p, wb, b, tokens, torch.device("cuda")) is None  # nothing measured yet
    dispatch._choices[dispatch._key("fwd", tokens, p, torch.device("cuda"))] = choice  # as if measured
    run = dispatch.resolved_forward(p, wb, b, tokens, torch.device("cuda"))
    assert run is not None
    for x in (
        torch.randn(tokens, 512, device="cuda").bfloat16(),
        torch.randn(1, tokens, 512, device="cuda").bfloat16(),  # leading batch dims
        torch.randn(tokens, 1024, device="cuda").bfloat16()[:, ::2],  # strided: the general path takes it
    ):
        poison_allocator()
        y = run(x)
        assert torch.equal(y, dispatch.run_forward(choice, x, wb, p, b))
        assert_linear_matches(y, x, w, b.bfloat16())


@pytest.mark.parametrize(("choice", "m"), [("sparse", 4), ("sparse", 8), ("sparse24", 8), ("dense", 4)])
@pytest.mark.parametrize("tokens", [7, 300])
def test_resolved_forward_with_gelu(choice, m, tokens):
    """With an activation: fused into the 2:4 kernel (a 2:4 weight, or a V:2:M weight's 2:4 view), after the V:2:M
    kernel and after dense cuBLAS; every way gives gelu(F.linear) within PyTorch's own unfused error."""
    w, mask = random_masked(256, 512, 64, m, device="cuda", seed=tokens + m)
    p = pack(w, mask, 64, m, torch.bfloat16)
    wb, b = w.bfloat16(), torch.randn(256, device="cuda").bfloat16()
    device = torch.device("cuda")
    assert dispatch.resolved_forward(p, wb, b, tokens, device, "gelu") is None
    dispatch._choices[dispatch._key("fwd+gelu", tokens, p, device)] = choice  # as if measured
    run = dispatch.resolved_forward(p, wb, b, tokens, device, "gelu")
    x = torch.randn(1, tokens, 512, device="cuda").bfloat16()
    poison_allocator()
    y = run(x)
    assert torch.equal(y, dispatch.run_forward(choice, x, wb, p, b, "gelu"))
    ref = F.gelu(F.linear(x.double(), wb.double(), b.double()))
    assert rel_err(y, ref) <= 2 * rel_err(F.gelu(F.linear(x, wb, b)), ref) + 1e-6
    # measured for real: the activation is its own kind, and the result is the same function
    dispatch.clear_cache()
    y2 = dispatch.linear_forward(x, wb, p, b, activation="gelu")
    assert (
        dispatch.choice("fwd+gelu", tokens, p, x.device) is not None
        and dispatch.choice("fwd", tokens, p, x.device) is None
    )
    assert rel_err(y2, ref) <= 2 * rel_err(F.gelu(F.linear(x, wb, b)), ref) + 1e-6
