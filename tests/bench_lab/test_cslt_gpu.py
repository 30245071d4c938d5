"""GPU: the lab's cached-plan cuSPARSELt path (benchmarks/lab/cusparselt.cpp, lab.cslt) against an fp64 reference.

Fresh random 2:4 weights and inputs (never zeros), NaN-poisoned allocator before every call, error within 2x of
PyTorch's own ``F.linear`` error in the same dtype. Skipped without a GPU, outside the lab build
(``HF_SPARSE_BUILD_LAB=1``) or where the extension cannot be built (no cuSPARSELt).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops._helpers import assert_linear_matches, poison_allocator, random_masked, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", autouse=True)
def _needs_cslt():
    from lab import cslt

    if not cslt.available():
        pytest.skip("the cached cuSPARSELt path cannot be built here (not the lab build, or no cuSPARSELt)")


def _weight(rows, cols, dtype, seed):
    w, _ = random_masked(rows, cols, 64, 4, device="cuda", seed=seed)
    return w.to(dtype).contiguous()


def _inputs(tokens, cols, rows, dtype, seed, bias):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, cols, device="cuda", generator=gen).to(dtype)
    b = torch.randn(rows, device="cuda", generator=gen).to(dtype) if bias else None
    return x, b


SHAPES = [(16, 16), (48, 784), (256, 128), (1040, 336)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [8, 24, 8184])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_cached_matmul_matches_reference(bias, tokens, rows, cols):
    _check_cached_matmul(torch.bfloat16, bias, tokens, rows, cols)


def _check_cached_matmul(dtype, bias, tokens, rows, cols):
    from lab import cslt

    wq = _weight(rows, cols, dtype, seed=rows + cols)
    cw = cslt.compress(wq)
    x, b = _inputs(tokens, cols, rows, dtype, seed=tokens, bias=bias)
    poison_allocator()
    assert_linear_matches(cw.matmul(x, b), x, wq, b)


def test_plan_cache_hit_and_token_buckets():
    from lab import cslt

    wq = _weight(256, 512, torch.bfloat16, seed=1)
    cw = cslt.compress(wq)
    x, b = _inputs(24, 512, 256, torch.bfloat16, seed=2, bias=True)
    y1 = cw.matmul(x, b)
    assert (cw.plan_inits(), cw.searches(), cw.plan_count()) == (1, 1, 1)
    poison_allocator()
    y2 = cw.matmul(x, b)
    assert torch.equal(y1, y2)
    assert (cw.plan_inits(), cw.searches(), cw.plan_count()) == (1, 1, 1), "second call made a new plan"
    # 32 tokens: same power-of-two bucket as 24 -> a new plan with the searched algorithm, no new search
    x32, _ = _inputs(32, 512, 256, torch.bfloat16, seed=3, bias=False)
    assert_linear_matches(cw.matmul(x32, b), x32, wq, b)
    assert (cw.plan_inits(), cw.searches()) == (2, 1)
    # no bias: its own plan (the bias pointer is part of a plan); 40 tokens: a new bucket, searched
    assert_linear_matches(cw.matmul(x32, None), x32, wq, None)
    x40, _ = _inputs(40, 512, 256, torch.bfloat16, seed=4, bias=False)
    assert_linear_matches(cw.matmul(x40, b), x40, wq, b)
    assert (cw.plan_inits(), cw.searches(), cw.plan_count()) == (4, 2, 4)
    assert set(cw.algorithms()) == {32, 64}
    # search=False on a new bucket (what a CUDA-graph capture does): default algorithm, still correct
    x8, _ = _inputs(8, 512, 256, torch.bfloat16, seed=5, bias=False)
    assert_linear_matches(cw.matmul(x8, b, False), x8, wq, b)
    assert cw.searches() == 2


def test_recompress_gives_new_result_and_keeps_plans():
    from lab import cslt

    w1 = _weight(128, 256, torch.bfloat16, seed=5)
    w2 = _weight(128, 256, torch.bfloat16, seed=6)  # another mask as well as other values
    cw = cslt.compress(w1)
    x, b = _inputs(64, 256, 128, torch.bfloat16, seed=7, bias=True)
    assert_linear_matches(cw.matmul(x, b), x, w1, b)
    inits = cw.plan_inits()
    cw.compress(w2)
    poison_allocator()
    y = cw.matmul(x, b)
    assert_linear_matches(y, x, w2, b)
    assert rel_err(y, F.linear(x.double(), w1.double(), b.double())) > 0.1
    assert cw.plan_inits() == inits and cw.compressions() == 2


def test_refuses_what_cusparselt_cannot_run():
    from lab import cslt

    # checked in Python before the extension is called (an error raised inside it crashed the process on the H200)
    cw = cslt.compress(_weight(64, 128, torch.bfloat16, seed=8))
    with pytest.raises(ValueError, match="multiple of 8"):
        cw.matmul(torch.randn(7, 128, device="cuda").bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        cw.matmul(torch.randn(8, 128, device="cuda").half())
    with pytest.raises(ValueError, match="tokens, 128"):
        cw.matmul(torch.randn(8, 96, device="cuda").bfloat16())
    with pytest.raises(ValueError, match="bias"):
        cw.matmul(torch.randn(8, 128, device="cuda").bfloat16(), torch.randn(63, device="cuda").bfloat16())
    with pytest.raises(ValueError, match="multiples of 16"):
        cslt.compress(_weight(24, 128, torch.bfloat16, seed=9))
    with pytest.raises(ValueError, match="bfloat16 only"):
        cslt.compress(torch.randn(64, 128, device="cuda"))
    with pytest.raises(ValueError, match="bfloat16 only"):  # fp16 crashed inside cuSPARSELt on the H200
        cslt.compress(_weight(64, 128, torch.float16, seed=8))
    with pytest.raises(ValueError, match="compress"):
        cw.compress(_weight(64, 256, torch.bfloat16, seed=10))
    assert cw.compressions() == 1  # nothing reached the extension
    assert not cslt.supports(64, 128, 7, torch.bfloat16) and cslt.supports(64, 128, 8, torch.bfloat16)


def test_cuda_graph_replays_the_cached_plan():
    from lab import cslt

    wq = _weight(256, 256, torch.bfloat16, seed=11)
    cw = cslt.compress(wq)
    x, b = _inputs(64, 256, 256, torch.bfloat16, seed=12, bias=True)
    cw.matmul(x, b)  # plan made (and searched) outside the capture
    inits = cw.plan_inits()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cw.matmul(x, b, False)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_linear_matches(y, x, wq, b)
    assert cw.plan_inits() == inits


def test_objects_are_freed():
    from lab import cslt

    wq = _weight(512, 512, torch.bfloat16, seed=13)
    x, _ = _inputs(64, 512, 512, torch.bfloat16, seed=14, bias=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(20):
        cw = cslt.compress(wq)
        cw.matmul(x, None, False)
        del cw
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 16), (64, 32)])
@pytest.mark.parametrize("tokens", [8, 8184])
def test_vnm_weight_runs_on_cusparselt_as_2to4(v, m, tokens):
    """A V:2:M weight keeps <= 2 of every 4 columns of a row: cuSPARSELt runs it as 2:4, through the cached plan,
    and gets the right product."""
    from lab import cslt

    w, _ = random_masked(256, 32 * m, v, m, device="cuda", seed=m)
    wq = w.bfloat16().contiguous()
    bias = torch.randn(256, device="cuda").bfloat16()
    x = torch.randn(tokens, 32 * m, device="cuda").bfloat16()
    cw = cslt.compress(wq)
    poison_allocator()
    assert_linear_matches(cw.matmul(x, bias), x, wq, bias)
