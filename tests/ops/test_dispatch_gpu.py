"""GPU: the measurement harness (hf_sparse.ops.dispatch.fastest), and V:2:M weights on the 2:4 kernel (a 2:4 pack of
them, what a compact V:2:M layer's 2:4 view runs).

Fresh random weights and inputs (never zeros), NaN-poisoned allocator, error within 2x of PyTorch's own ``F.linear``
error in the same dtype against fp64.
"""

from __future__ import annotations

import time

import pytest
import torch

from hf_sparse.ops import dispatch, pack, spmm

from ._helpers import assert_linear_matches, poison_allocator, random_masked

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 8), (64, 16), (64, 32), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300, 8191])
def test_vnm_weight_on_the_2to4_kernel_matches_reference(v, m, dtype, tokens):
    w, mask = random_masked(256, 16 * m + 8 * m, v, m, device="cuda", seed=m + tokens)
    view = pack(w, mask, 64, 4, dtype, validate=False)  # <= 2 kept of every 4 columns: a 2:4 weight
    x = torch.randn(tokens, w.shape[1], device="cuda").to(dtype)
    b = torch.randn(256, device="cuda").to(dtype)
    poison_allocator()
    assert_linear_matches(spmm(x, view, b), x, w, b)


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

    assert dispatch.fastest({"two": two_gemms, "one": one_gemm, "refuses": refuses}) == "one"
    assert dispatch.fastest({"one": one_gemm, "python": python_heavy}) == "python"
    # inference's rule, GPU time plus the host time above the lightest candidate's: 0.5 ms of host work loses to a
    # ~0.3 ms GEMM, and two candidates with the same host work are ranked by GPU time
    assert dispatch.fastest({"one": one_gemm, "python": python_heavy}, host_too=True) == "one"
    assert dispatch.fastest({"two": two_gemms, "one": one_gemm}, host_too=True) == "one"
    # the costs behind the choice: ms per candidate that ran, the second GEMM about doubling the first's
    measured = dispatch.costs({"two": two_gemms, "one": one_gemm, "refuses": refuses})
    assert list(measured) == ["two", "one"]
    assert 1.5 < measured["two"] / measured["one"] < 2.5, measured
    # GPU and host time apart: the sleeping candidate's host time is its 0.5 ms, its GPU time a small kernel's
    split = dispatch.measure({"one": one_gemm, "python": python_heavy})
    assert split["python"][1] > 0.45 > split["one"][1], split
    assert split["python"][0] < split["one"][0], split
