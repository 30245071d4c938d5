"""GPU: every CUDA kernel against the pure-torch reference on fresh random inputs, with poisoned outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_sparse.ops import dense_from_packed, force_kernel, pack, scatter_dense, sddmm, spmm
from hf_sparse.ops._layout import logical_from_dense, packed_from_logical

from ._helpers import (
    PATTERNS,
    assert_linear_matches,
    lab_knobs,
    mask_with_distinct_slab_columns,
    poison_allocator,
    random_masked,
    rel_err,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DTYPES = [torch.bfloat16, torch.float16]
SPMM_KERNELS = ["mma_sp", "wgmma"]


def _wgmma_runs_here() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from hf_sparse.ops._build import load_extension

    return bool(load_extension().spmm_wgmma_available())


@pytest.fixture(params=SPMM_KERNELS)
def spmm_kernel_env(request):
    """Run the test once per SpMM kernel (``force_kernel(spmm=...)``); ``wgmma`` only where it can run (sm_90a)."""
    if request.param == "wgmma" and not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    with force_kernel(spmm=request.param):
        yield request.param


def _pack_cuda(rows, cols, v, m, dtype, seed):
    w, mask = random_masked(rows, cols, v, m, device="cuda", seed=seed)
    return w, mask, pack(w, mask, v, m, dtype)


def _assert_spmm_matches_reference(x, w, p, bias=None):
    """``spmm(x, p, bias)`` on NaN-poisoned memory: every output written, error against an fp64 reference within 2x
    of PyTorch's own ``F.linear`` error in the same dtype."""
    poison_allocator()
    assert_linear_matches(spmm(x, p, bias), x, w, bias)


@pytest.mark.parametrize(("v", "m"), PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_kernel_matches_reference(v, m, dtype):
    for rows, cols in [(128, 256), (256, 8 * m * 3)]:
        w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=rows)
        values, columns, selectors, valid = logical_from_dense(w.cpu(), mask.cpu(), v, m)
        ref = packed_from_logical(values, columns, selectors, 64 if m == 4 else v, m, dtype, valid)
        for name in ("values", "meta", "columns", "valid"):
            assert torch.equal(getattr(p, name).cpu(), getattr(ref, name)), name


@pytest.mark.parametrize(("v", "m"), PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "rows", "cols"), [(1, 128, 256), (7, 192, 512), (8191, 256, 1024), (300, 768, 3072)]
)
def test_spmm_kernel(v, m, dtype, tokens, rows, cols, spmm_kernel_env):
    if rows % v and m != 4:
        pytest.skip("rows not a multiple of v")
    w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=tokens)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    bias = torch.randn(rows, device="cuda").to(dtype)
    _assert_spmm_matches_reference(x, w, p, bias)


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8), (128, 16), (64, 32)])
def test_spmm_odd_shapes_and_batch_dims(v, m, spmm_kernel_env):
    # tokens spread over leading dims, K with a partial last k-step, rows not a multiple of 256 (R padded).
    rows = 64 * 3 if m == 4 else v * 3
    cols = 8 * m * 2 + 4 * m if (8 * m * 2 + 4 * m) % 8 == 0 else 8 * m * 3
    w, mask, p = _pack_cuda(rows, cols, v, m, torch.bfloat16, seed=11)
    x = torch.randn(3, 5, cols, device="cuda").bfloat16()
    y = spmm(x, p)
    ref = F.linear(x.double(), w.bfloat16().double())
    assert y.shape == (3, 5, rows)
    assert rel_err(y, ref) <= 2 * rel_err(F.linear(x, w.bfloat16()), ref) + 1e-6


def test_spmm_2to4_rows_not_multiple_of_64_and_odd_rows(spmm_kernel_env):
    for rows in (100, 33):
        w, mask, p = _pack_cuda(rows, 64, 64, 4, torch.bfloat16, seed=rows)
        x = torch.randn(17, 64, device="cuda").bfloat16()
        ref = F.linear(x.double(), w.bfloat16().double())
        assert rel_err(spmm(x, p), ref) <= 2 * rel_err(F.linear(x, w.bfloat16()), ref) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("tokens", "rows", "cols"),
    # K = 40: one k-step of 32 plus a partial one (zero-filled past K); 96: an odd step count (3); 8 and 1000: tiny
    # and ragged K. Tokens straddle the wgmma kernel's token tiles (64, 128, 256); rows 64 * odd leave the second
    # warpgroup of the last row block idle.
    [(1, 64, 40), (7, 192, 96), (64, 320, 8), (65, 128, 1000), (129, 64, 136), (257, 448, 264), (8191, 192, 96)],
)
def test_spmm_2to4_ragged_k_and_token_tiles(dtype, bias, tokens, rows, cols, spmm_kernel_env):
    w, mask, p = _pack_cuda(rows, cols, 64, 4, dtype, seed=tokens + cols)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype) if bias else None
    _assert_spmm_matches_reference(x, w, p, b)


def test_spmm_auto_picks_wgmma_on_sm90a():
    from hf_sparse.ops.spmm import AUTO_WGMMA_M, spmm_kernel

    device = torch.device("cuda")
    for m in (4, 8, 16, 32, 64, 128):
        assert spmm_kernel(m, device) == ("wgmma" if _wgmma_runs_here() and m in AUTO_WGMMA_M else "mma_sp")


@pytest.mark.parametrize(("v", "m"), [p for p in PATTERNS if p[1] >= 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("tokens", "groups"),
    # K = groups * M: 25 groups end inside the second k-tile of 16 (4 k-steps), 17 give an odd step count (3: the
    # last k-tile has one k-step and 15 padded groups). Tokens straddle the V:2:M kernel's token tiles (16 / 32 / 64 /
    # 128; 40 = a full 32-token tile and one of 8).
    [(1, 25), (7, 17), (40, 25), (65, 25), (257, 17), (8191, 25)],
)
@pytest.mark.parametrize("pipe", [0, 1, 2, 3, 4])
def test_spmm_vnm_ragged_k_and_token_tiles(v, m, dtype, bias, tokens, groups, pipe, spmm_kernel_env):
    # pipe: the V:2:M wgmma kernel's register pipeline (0, the product's), and the lab build's staged (cp.async ring),
    # register + L1 prefetch and warp-specialised (64 tokens and more; 4 at M = 8: one gather for both slabs where
    # they keep the same columns, i.e. V = 128) pipelines
    if spmm_kernel_env == "mma_sp" and pipe != 0:
        pytest.skip("the pipeline only selects between wgmma kernels")
    if pipe == 4 and m != 8:
        pytest.skip("pipeline 4 exists at M = 8 only")
    rows = 3 * v  # V = 64: 192 rows, the last 128-row block has one idle slab; V = 128: two blocks of one V-block
    cols = groups * m
    w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=tokens + groups + m)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype) if bias else None
    with lab_knobs(**({"vnm_pipe": pipe} if pipe else {})):
        _assert_spmm_matches_reference(x, w, p, b)


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 8), (64, 16), (128, 16), (128, 32), (128, 64), (64, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "groups", "blocks"),
    # (sm90_vnm_xt_plan on 132 SMs) 65 tokens, the fewest the path takes (on more than 1024 rows), and 100: one
    # 128-token tile, mostly or partly empty (not multiples of 8: X^T's padding); 128: one full tile; 256: two; 1024:
    # eight; 1061: a last tile of 37 tokens, not a multiple of 8 (X^T's padding); 2309: 256-token tiles; 17 groups: an
    # odd step count (the last k-tile one k-step, 15 padded groups); 40 groups: 2.5 k-tiles; 520: 33 k-tiles; 1000
    # groups at 300 tokens: 27 tiles of 128 tokens leave most SMs idle, so K is split in four (16, 16, 16, 15 k-tiles)
    [
        (65, 17, 18),
        (100, 40, 17),
        (128, 17, 18),
        (256, 17, 16),
        (1024, 17, 16),
        (1061, 40, 17),
        (2309, 25, 18),
        (1061, 520, 17),
        (300, 1000, 17),
    ],
)
def test_spmm_vnm_large_token_path(v, m, dtype, tokens, groups, blocks):
    """The V:2:M sparse-wgmma SpMM's X^T path (``sm90_vnm_xt`` in ``csrc/tile_config.h``: X transposed, the
    kept rows of X^T copied whole; K split where the tiles leave SMs idle): against the reference on poisoned memory,
    with bias, the same result on a second call. ``blocks`` x 64 rows: 17 x 64
    (V = 64) ends in a 128-row block with one slab; V = 64 slabs keep their own columns (two steps per k-tile), V = 128
    share one B tile (V = 128 takes ``blocks`` rounded up to even)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    rows = (blocks + (blocks % 2 if v == 128 else 0)) * 64
    cols = groups * m
    w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=tokens + groups + m + v)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        assert torch.equal(spmm(x, p, b), spmm(x, p, b))  # split partial sums are added in split order
    if v == 64:  # every slab pair keeps different columns: the two-step k-tiles, each slab from its own
        mask = mask_with_distinct_slab_columns(rows, cols, v, m, seed=m).cuda()
        w = torch.randn(rows, cols, device="cuda") * mask
        p = pack(w, mask, v, m, dtype)
        with force_kernel(spmm="wgmma"):
            _assert_spmm_matches_reference(x, w, p)


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 16)])
def test_spmm_vnm_xt_path_splits_256_token_tiles(v, m):
    """The X^T path's plan where 256-token tiles split beat 128-token ones (13824 -> 5120 at M = 8 and 129-256 tokens):
    5120 rows (40 row blocks) x 256 tokens and 1704 groups (107 k-tiles, the last one k-step) take 40 tiles of 256
    tokens in three splits (36 + 36 + 35 k-tiles); poisoned memory, bias, the same result on a second call."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    rows, cols = 5120, 1704 * m
    w, mask, p = _pack_cuda(rows, cols, v, m, torch.bfloat16, seed=m)
    x = torch.randn(256, cols, device="cuda").to(torch.bfloat16)
    b = torch.randn(rows, device="cuda").to(torch.bfloat16)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        assert torch.equal(spmm(x, p, b), spmm(x, p, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "rows", "groups", "tokens"),
    # (sm90_vnm_xt_plan on 132 SMs) M = 16, 11008 rows x 256 groups (16 k-tiles) at 200 tokens: 86 tiles of 256
    # tokens, unsplit, the last 56 tokens X^T's padding; M = 16 and M = 8, 5120 rows x 1704 groups (107 k-tiles, the
    # last one k-step) at 256 tokens: 40 tiles of 256 in three splits; M = 8, 1088 rows (the last 128-row block one
    # slab) x 520 groups at 100 tokens: 9 tiles of 128 tokens in three splits, 28 tokens of padding; M = 32, 4096 rows
    # x 400 groups at 128 tokens: 32 tiles of 128 in three splits
    [(16, 11008, 256, 200), (16, 5120, 1704, 256), (8, 5120, 1704, 256), (8, 1088, 520, 100), (32, 4096, 400, 128)],
)
def test_spmm_vnm_xt_path_deep_ring_at_v64(dtype, m, rows, groups, tokens):
    """V = 64 at M = 8, 16, 32 and 65-256 tokens takes the deeper ring (``sm90_vnm_xt_deep_ring``: 256-token tiles in
    five stages, 128-token tiles in eight, 64-token epilogue chunks): against the reference on poisoned memory, with
    bias, the same result on a second call; then with every slab pair keeping different columns (two stages per
    k-tile, the case the ring is deeper for)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    v = 64
    cols = groups * m
    w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=rows + tokens + m)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        assert torch.equal(spmm(x, p, b), spmm(x, p, b))  # split partial sums are added in split order
    mask = mask_with_distinct_slab_columns(rows, cols, v, m, seed=tokens).cuda()
    w = torch.randn(rows, cols, device="cuda") * mask
    p = pack(w, mask, v, m, dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p)


@pytest.mark.parametrize(("v", "m", "groups"), [(64, 8, 25), (128, 16, 25), (128, 8, 40)])
def test_spmm_vnm_xt_path_runs_rounds_of_tiles_call_after_call(v, m, groups):
    """The X^T path where the persistent CTAs walk several rounds of tiles: 1152 rows (9 row blocks) x 8200 tokens is
    33 token tiles of 256 (the last one 8 tokens), 297 tiles on 132 SMs; 25 groups: an odd step count. Three calls in a
    row on the same weight with a new X each, the last with 300 tokens (27 tiles of 128 tokens, one round; unsplit:
    2-3 k-tiles), each against the reference on poisoned memory: nothing a call leaves behind (X^T scratch) may reach
    the next."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    rows, cols = 1152, groups * m
    w, mask, p = _pack_cuda(rows, cols, v, m, torch.bfloat16, seed=groups + m)
    b = torch.randn(rows, device="cuda").to(torch.bfloat16)
    with force_kernel(spmm="wgmma"):
        for tokens in (8200, 8200, 300):
            x = torch.randn(tokens, cols, device="cuda").to(torch.bfloat16)
            _assert_spmm_matches_reference(x, w, p, b)


@pytest.mark.parametrize(("v", "m"), [(128, 8), (64, 8), (64, 16), (128, 32)])
def test_spmm_vnm_xt_path_at_33_to_64_tokens_on_a_large_weight(v, m):
    """From 33 tokens a weight of 2^27 elements and more takes the X^T path at M >= 16 and at M = 8 where V = 128
    (``sm90_vnm_xt``, ``csrc/tile_config.h``: 16384 rows x K 8192 is exactly 2^27), each call in one 64-token tile per
    row block; 64:2:8 takes the register pipeline's 64-token tile there. Against the reference on poisoned memory,
    with bias, at 33 (the first count), 47 and 64 tokens."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    rows, cols = 16384, 8192
    w, mask, p = _pack_cuda(rows, cols, v, m, torch.bfloat16, seed=m)
    b = torch.randn(rows, device="cuda").to(torch.bfloat16)
    with force_kernel(spmm="wgmma"):
        for tokens in (33, 47, 64):
            x = torch.randn(tokens, cols, device="cuda").to(torch.bfloat16)
            _assert_spmm_matches_reference(x, w, p, b)


@pytest.mark.parametrize(("v", "m"), [(64, 16), (128, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [33, 64])
def test_spmm_vnm_xt_path_64_token_tiles_split_along_k(v, m, dtype, tokens):
    """At 33-64 tokens and M >= 16 from 4097 rows the X^T path runs 64-token tiles (33 tokens: 31 of them X^T's
    padding): 4160 rows at V = 64 (33 row blocks, the last one half padding), 4224 at V = 128, x 648 groups (40.5
    k-tiles, the last one k-step) split along K in 3;
    against the reference on poisoned memory with bias, the same result on a second call (partial sums added in split
    order), and V = 64 slabs that keep different columns."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    rows, cols = (4160 if v == 64 else 4224), 648 * m
    w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=tokens + m + v)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        assert torch.equal(spmm(x, p, b), spmm(x, p, b))
        if v == 64:
            mask = mask_with_distinct_slab_columns(rows, cols, v, m, seed=m).cuda()
            w = torch.randn(rows, cols, device="cuda") * mask
            _assert_spmm_matches_reference(x, w, pack(w, mask, v, m, dtype))


@pytest.mark.parametrize(("v", "m"), [(128, 8), (64, 16)])
def test_spmm_vnm_xt_path_under_cuda_graph_capture(v, m):
    """The X^T path (its transpose, then its GEMM: 1024 rows x 1000 tokens, 64 tiles of 128 tokens, 4 k-tiles, not
    split) captured in CUDA graphs, on a stream used eagerly before and on a new stream, its X^T scratch from each
    graph's pool. Replayed twice on NaN-filled outputs, both give the product."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(1024, 64 * m, v, m, torch.bfloat16, seed=m)
    x = torch.randn(1000, w.shape[1], device="cuda").bfloat16()
    side = torch.cuda.Stream()
    with force_kernel(spmm="wgmma"):
        with torch.cuda.stream(side):
            eager = spmm(x, p)
        side.synchronize()
        graphs, outs = [], []
        for stream in (side, torch.cuda.Stream()):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs.append(spmm(x, p))
            graphs.append(graph)
        for graph, out in zip(graphs, outs, strict=True):
            out.fill_(float("nan"))
            graph.replay()
            graph.replay()
    torch.cuda.synchronize()
    assert_linear_matches(eager, x, w)
    for out in outs:
        assert_linear_matches(out, x, w)


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8), (128, 8), (64, 16), (128, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 33, 64, 65, 200, 256])
def test_spmm_wgmma_split_k_at_few_tokens(v, m, dtype, tokens):
    """Few rows and a long K: the sparse-wgmma SpMMs split each tile's 40.5 k-tiles (16 groups each, the last one
    k-step) over ~10 CTAs (``sm90_split_k``, ``csrc/tile_config.h``; 2 for the 2:4 64-token tile, whose splits are at
    least 16 k-tiles long), the last split shorter; poisoned memory, bias,
    tokens across the few-token tile widths (2:4: 16, 64; V:2:M: 16, 32, 64 or 128) and past them (2:4 above 64 tokens:
    the persistent configurations, split by ``sm90_large_split_k``; V:2:M: two 128-token tiles at 200 and 256)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    rows = 192 if m == 4 else 3 * v
    w, mask, p = _pack_cuda(rows, (16 * 40 + 8) * m, v, m, dtype, seed=tokens + m)
    x = torch.randn(tokens, w.shape[1], device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)


@pytest.mark.parametrize(
    ("v", "m", "rows", "groups"),
    [(v, m, 3 * v, 8 * 37 + 3) for v, m in PATTERNS if m >= 8]
    + [(64, 8, 4224, 299), (64, 8, 4352, 299), (128, 16, 4352, 299), (64, 8, 192, 513), (64, 16, 192, 769)],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_spmm_vnm_few_tokens_on_the_cuda_cores(v, m, rows, groups, dtype, tokens):
    """1-4 tokens: the V:2:M SpMM's CUDA-core form (``csrc/spmv_vnm.cu``, ``sm90_vnm_gemv``) where its grid fits one
    wave (3V rows; 4224 rows, 264 m-tiles, on a 132-SM H100/H200), the 16-token tile past it (4352 rows) and past the
    features its X in shared memory takes from two tokens (4104 at M = 8; 12304 at M = 16, whose 4 tokens pass 49152).
    3V rows: V = 64 leaves a 128-row block with one slab, V = 128 spans 128-row blocks; a last k-step holding 3 of its 8
    groups (299 groups); with and without a bias; poisoned memory."""
    if not _wgmma_runs_here():
        pytest.skip("the V:2:M plan runs on sm_90a")
    w, mask, p = _pack_cuda(rows, groups * m, v, m, dtype, seed=rows + 7 * m + v + tokens)
    x = torch.randn(tokens, w.shape[1], device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        _assert_spmm_matches_reference(x, w, p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [129, 200, 257, 300])
def test_spmm_wgmma_split_k_in_the_persistent_configurations(dtype, tokens):
    """2:4 above 128 tokens on two row blocks and a long K: the persistent TMA configurations' tiles leave most SMs
    idle, so ``sm90_large_plan`` splits each tile's k-tiles in two work units, each a persistent CTA's turn; poisoned
    memory, bias, a ragged token tile; the same result on a second call (partial sums added in split order)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(192, (16 * 40 + 8) * 4, 64, 4, dtype, seed=tokens)
    x = torch.randn(tokens, w.shape[1], device="cuda").to(dtype)
    b = torch.randn(192, device="cuda").to(dtype)
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        assert torch.equal(spmm(x, p, b), spmm(x, p, b))


@pytest.mark.parametrize(
    ("rows", "cols", "tokens", "dtype", "gelu"),
    [
        (4096, 4096, 128, torch.bfloat16, False),  # configuration 23, 32 full tiles x 4 splits: 2 warps' rows each
        (4032, 4096, 128, torch.float16, True),  # the same; the last row block half padding sums the last-split way
        (4096, 4096, 200, torch.bfloat16, True),  # 64 tiles x 2 splits: full token tiles shared, the partial ones not
        (5120, 13824, 128, torch.bfloat16, False),  # 40 tiles x 3 splits: 3 / 3 / 2 warps' rows
        (1024, 16384, 128, torch.bfloat16, True),  # 8 tiles x 16 splits: every other split owns no rows
    ],
)
def test_spmm_wgmma_shared_split_k_sum(rows, cols, tokens, dtype, gelu):
    """The 128-token persistent configuration's split plans fill one round of CTAs: in a full tile each split adds up
    and stores the rows of the warps it owns from every split's partial sums (sm90_common.cuh SplitK::meet), in a
    partial one the last split sums (SplitK::last), in the same launch. Poisoned memory, bias, GELU; the same result
    on every call (each owner adds in a fixed order), the arrival counters left zero for the next call."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(rows, cols, 64, 4, dtype, seed=rows + tokens)
    x = (2 * torch.randn(tokens, cols, device="cuda")).to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype)
    act = {"activation": "gelu"} if gelu else {}
    poison_allocator()
    with force_kernel(spmm="wgmma"):
        y = spmm(x, p, b, **act)
        again = [spmm(x, p, b, **act) for _ in range(3)]
    if gelu:
        _assert_gelu_linear_matches(y, x, w, b)
    else:
        assert_linear_matches(y, x, w, b)
    for z in again:
        assert torch.equal(z, y)


@pytest.mark.parametrize(
    ("rows", "tokens", "cols"),
    [
        (4096, 300, 1032),  # configuration 23 (128-token tiles): 32 x 3 tiles
        (776, 8190, 1040),  # 27 (192-token tiles) by the fill rule; rows % 8 != 0: its fallback 19, unsplit
        (200, 130, 2600),  # 20 (256-token tiles), rows % 8 == 0
        (196, 131, 2600),  # 20's fallback 15 (no tensor map of Y), split as 20
    ],
)
@pytest.mark.parametrize("splits", [3, 16])
def test_spmm_wgmma_forced_split_k_in_each_large_configuration(rows, tokens, cols, splits):
    """Lab build: every split count forced in each persistent configuration, more work units than SMs (a CTA runs
    several splits, of different tiles, one after another), ragged rows, tokens and K; poisoned memory, bias; the same
    result again."""
    w, mask, p = _pack_cuda(rows, cols, 64, 4, torch.bfloat16, seed=rows + splits)
    x = torch.randn(tokens, cols, device="cuda").bfloat16()
    b = torch.randn(rows, device="cuda").bfloat16()
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    with force_kernel(spmm="wgmma"), lab_knobs(small_tiles=0, split_k=splits):
        _assert_spmm_matches_reference(x, w, p, b)
        assert torch.equal(spmm(x, p, b), spmm(x, p, b))


@pytest.mark.parametrize(
    ("rows", "tokens", "cols"),
    [
        (4096, 208, 2112),  # configuration 23 in 2 splits: 64 tiles, the last token tile 80 tokens wide
        (8192, 1000, 1088),  # 20: 4 token tiles, the last 232 wide; a CTA's second tile follows a full one
        (28672, 144, 1088),  # 27: one token tile of 144, two per CTA (nothing before it in the ring but itself)
        (8192, 330, 1088),  # 20: the last token tile 74 wide
    ],
)
def test_spmm_wgmma_partial_last_token_tile(rows, tokens, cols):
    """The persistent configurations load a partial last token tile in a box of its own tokens (``x_tail_map``): the
    ring stage's rows past them keep an earlier tile's X or never-written shared memory, which must reach no stored
    output; the box must hold every real token. Poisoned memory, bias, ragged K."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(rows, cols, 64, 4, torch.bfloat16, seed=rows + tokens)
    x = torch.randn(tokens, cols, device="cuda").bfloat16()
    b = torch.randn(rows, device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8)])
def test_spmm_wgmma_split_k_is_deterministic_across_calls_shapes_and_streams(v, m):
    """The last CTA of a tile adds the partial sums in split order, so the result does not depend on which CTA
    finishes last; the arrival counters are left zero for the next call, of any shape, on any stream."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(192, 648 * m, v, m, torch.bfloat16, seed=5)
    w2, mask2, p2 = _pack_cuda(448, 1000 * m, v, m, torch.bfloat16, seed=6)
    x = torch.randn(5, w.shape[1], device="cuda").bfloat16()
    x2 = torch.randn(9, w2.shape[1], device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"):
        first = spmm(x, p)
        runs = [spmm(x, p) for _ in range(20)]
        other = spmm(x2, p2)
        again = spmm(x, p)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = spmm(x, p)
            other_side = spmm(x2, p2)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_linear_matches(first, x, w)
    assert_linear_matches(other, x2, w2)
    for y in (*runs, again, on_side):
        assert torch.equal(y, first)
    assert torch.equal(other_side, other)


@pytest.mark.parametrize(
    ("v", "m", "rows", "cols", "tokens"),
    [
        # 8 row blocks (the grouped-query key / value projections' 1024 rows, here ragged): every split launch fits
        # the CTAs the SMs keep resident, so each split sums the chunks of the tile it owns (sm90_split_sum_shared)
        (64, 4, 1000, 8200, 16),  # 2:4 16-token tiles, ~15 splits
        (64, 4, 1000, 8200, 40),  # 2:4 64-token tiles, ~15 splits (sm90_small_plan), a ragged token tile
        (64, 4, 1024, 8192, 64),
        (64, 8, 960, 8200, 96),  # V:2:M register pipeline, 128-token tiles, ~13 splits; the last block one slab
        (64, 8, 1024, 8192, 128),
        (64, 16, 960, 8208, 50),
        (128, 8, 1024, 8192, 20),
        (64, 8, 960, 4096, 40),  # V:2:M 32-token tiles at 40 tokens in 16 splits, 256 CTAs at two per SM
        (64, 8, 1024, 8200, 300),  # M = 8 keeps 1024 rows off the X^T path below 512 tokens: 3 token tiles, 5 splits
        (64, 4, 1000, 4104, 96),  # 2:4 128-token few-token tiles above 64 tokens (sm90_sparse24_plan), ~8 splits
        (64, 4, 1000, 4104, 150),  # ... two token tiles, the second partial
        (64, 4, 768, 3080, 100),  # ... 6 row blocks, ~6 splits
        # 32 row blocks: two or three CTAs per SM, all resident, so still the shared sum
        (64, 4, 4096, 8192, 16),  # 2:4 16-token tiles in 8 splits, 256 CTAs at two per SM
        (64, 4, 4000, 4104, 48),  # 2:4 64-token tiles in 8 splits of 8 k-tiles (sm90_small_plan), 256 CTAs
        (64, 8, 4096, 8192, 16),  # V:2:M 16-token tiles in 11 splits, 352 CTAs at three per SM
        (64, 16, 4032, 11008, 24),  # 16-token tiles in 6 splits, 384 CTAs, two token tiles
        (64, 8, 1024, 8192, 24),  # 8 row blocks, 16-token tiles in 16 splits, 256 CTAs
        # more CTAs than the SMs keep resident (480), so the last split of each tile to arrive sums it
        (64, 4, 12200, 4104, 16),  # 2:4 16-token tiles in 5 splits
        (64, 8, 12224, 8200, 40),  # V:2:M 64-token tiles in 5 splits
    ],
)
def test_spmm_wgmma_split_k_shared_sum_at_few_row_blocks(v, m, rows, cols, tokens):
    """Split-K of the non-persistent sparse-wgmma tiles with the chunked shared sum (every split adds up the chunks
    of its tile that it owns, from every split's partial sums) at one to three CTAs per SM and, past the CTAs the SMs
    keep resident, with the last split's sum:
    against the reference on poisoned memory with a bias, ragged rows (a last row block of one slab), K and tokens;
    the same bits on later calls
    (each chunk's partial sums are added in split order, whichever split owns it)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(rows, cols, v, m, torch.bfloat16, seed=rows + tokens + m)
    x = torch.randn(tokens, cols, device="cuda").bfloat16()
    b = torch.randn(rows, device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)
        first = spmm(x, p, b)
        again = [spmm(x, p, b) for _ in range(3)]
    torch.cuda.synchronize()
    for y in again:
        assert torch.equal(y, first)


_CONCURRENT_SHARED_SUMS = """
import torch
from hf_sparse.masks import nm_mask, vnm_mask
from hf_sparse.ops import force_kernel, pack, spmm
gen = torch.Generator().manual_seed(ROWS + TOKENS + M)
w = torch.randn(ROWS, COLS, generator=gen)
mask = nm_mask(w.abs(), 2, 4) if M == 4 else vnm_mask(w.abs(), V, 2, M)
w, mask = torch.where(mask, w, 0.0).cuda().bfloat16(), mask.cuda()
p = pack(w, mask, V, M)
xs = [torch.randn(TOKENS, COLS, generator=gen).cuda().bfloat16() for _ in range(4)]
streams = [torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)]
with force_kernel(spmm="wgmma"):
    serial = [spmm(x, p) for x in xs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for s in streams:  # hold both queues while the host fills them, so that their calls then run at once
        with torch.cuda.stream(s):
            torch.cuda._sleep(40_000_000)
    for _ in range(50):
        for i, x in enumerate(xs):
            with torch.cuda.stream(streams[i % 2]):
                outs.append((i, spmm(x, p)))
    torch.cuda.synchronize()
print("calls", len(outs), "differ", sum(not torch.equal(y, serial[i]) for i, y in outs))
"""


@pytest.mark.parametrize(
    ("v", "m", "rows", "cols", "tokens"),
    [
        (64, 4, 4096, 8192, 16),  # 2:4 few-token tiles in 8 splits: 256 CTAs of the 264 two per SM keep resident
        (64, 8, 4096, 8192, 16),  # V:2:M 16-token tiles in 11 splits: 352 CTAs of 396 at three per SM
        (64, 4, 1024, 8192, 192),  # 2:4 persistent 128-token tiles in 8 splits: 128 CTAs, one per SM
    ],
)
def test_spmm_wgmma_shared_split_sum_on_concurrent_streams(v, m, rows, cols, tokens):
    """Launches with the shared split-K sum, whose splits wait for one another, issued on two streams of different
    priorities at once, each grid too large for two to be resident together: were the GPU to start part of each, both
    would wait for ever for CTAs that cannot start until the other's leave (tile_config.h sm90_split_sum_shared). Every
    call finishes and gives the bits the same calls gave one at a time. Run in a child process with a time limit, so
    a hang fails this test instead of the test session."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    import os
    import subprocess
    import sys

    code = f"V, M, ROWS, COLS, TOKENS = {v}, {m}, {rows}, {cols}, {tokens}\n" + _CONCURRENT_SHARED_SUMS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("concurrent split-K launches did not finish in 180 s")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "calls 200 differ 0" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8)])
def test_spmm_wgmma_split_k_under_cuda_graph_capture(v, m):
    """Inside a CUDA graph capture the split-K scratch comes from the graph's pool, and a capturing stream without
    arrival counters yet gets none (zeros made there would exist only in replays): that call does not split. Replays
    give the product either way, and eager calls afterwards still split and match the earlier ones bit for bit."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(192, 648 * m, v, m, torch.bfloat16, seed=7)
    x = torch.randn(5, w.shape[1], device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"):
        eager = spmm(x, p)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # a new stream: no counters yet
            captured = spmm(x, p)
        captured.fill_(float("nan"))
        graph.replay()
        after = spmm(x, p)
    torch.cuda.synchronize()
    assert_linear_matches(captured, x, w)
    assert_linear_matches(eager, x, w)
    assert torch.equal(after, eager)


@pytest.mark.parametrize("tokens", [3, 40, 100, 200])
def test_spmm_wgmma_chain_reads_each_previous_output(tokens):
    """A chain of 2:4 sparse-wgmma calls, each on the previous one's output, with a V:2:M call in the middle and the
    first output's block freed while the calls after it run (the allocator may hand it to the next output): every call
    reads its input as written and writes only its own output. Few-token tiles (3, 40 tokens) and the persistent
    configurations, split and not (100, 200)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    sizes, patterns = [1024, 4096, 1024, 3072, 2048, 1024], [(64, 4), (64, 4), (64, 8), (64, 4), (64, 4)]
    layers = [
        _pack_cuda(sizes[i + 1], sizes[i], v, m, torch.bfloat16, seed=40 + i)[::2] for i, (v, m) in enumerate(patterns)
    ]
    x = torch.randn(tokens, sizes[0], device="cuda").bfloat16()
    poison_allocator()
    with force_kernel(spmm="wgmma"):
        outs, h = [], x
        for i, (_, p) in enumerate(layers):
            h = spmm(h, p)
            outs.append(h)
            if i == 1:
                del outs[0]  # its block is free for the next outputs while the call after it may still run
                outs.insert(0, None)
        again = spmm(x, layers[0][1])  # the freed first output, recomputed (deterministic) to check the second
    inputs = [x, again, *outs[1:-1]]
    for (w, _), inp, out in zip(layers, inputs, outs, strict=True):
        if out is not None:
            assert_linear_matches(out, inp, w)
    assert_linear_matches(again, x, layers[0][0])


@pytest.mark.parametrize(("m", "groups"), [(8, 2056), (16, 2100)])
@pytest.mark.parametrize("pipe", [1, 0])
def test_spmm_vnm_long_k_falls_back_to_register_pipeline(m, groups, pipe):
    # More than 2048 padded groups: the column offsets of a CTA's two slabs do not fit the staged pipeline's 16 KB, so
    # asking for it (lab build, pipe 1) runs the register pipeline, as the product does; both must agree with the
    # reference.
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(192, groups * m, 64, m, torch.bfloat16, seed=groups)
    x = torch.randn(65, groups * m, device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"), lab_knobs(**({"vnm_pipe": pipe} if pipe else {})):
        _assert_spmm_matches_reference(x, w, p, torch.randn(192, device="cuda").bfloat16())


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 8), (64, 16), (64, 32), (64, 128)])
@pytest.mark.parametrize("pipe", [1, 0, 2, 3, 4])
def test_spmm_vnm_gather_uses_each_slabs_columns(v, m, pipe):
    # A gather that reused one slab's column offsets for the other slab of a CTA, or mixed up groups / offsets, gives
    # a wrong product here: every consecutive pair of 64-row slabs (V = 64) keeps different columns in every group.
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    with force_kernel(spmm="wgmma"), lab_knobs(**({"vnm_pipe": pipe} if pipe else {})):
        _check_gather_uses_each_slabs_columns(v, m)


def _check_gather_uses_each_slabs_columns(v, m):
    rows, cols = 256, 24 * m
    mask = mask_with_distinct_slab_columns(rows, cols, v, m, seed=m + v).cuda()
    w = torch.randn(rows, cols, device="cuda") * mask
    p = pack(w, mask, v, m, torch.bfloat16)
    if v == 64:
        assert not bool((p.columns[0] == p.columns[1]).all(-1)[: cols // m].any())
    x = torch.randn(300, cols, device="cuda").bfloat16()
    _assert_spmm_matches_reference(x, w, p)
    # Each kept column on its own: X = one-hot columns picks W's column back (exact in bf16).
    eye = torch.eye(cols, device="cuda").bfloat16()
    assert torch.equal(spmm(eye, p).float(), w.bfloat16().float().t())


@pytest.fixture(params=["mma", "wgmma"])
def sddmm_kernel_env(request):
    """Run the test once per SDDMM kernel (``force_kernel(sddmm=...)``); ``wgmma`` only where it can run (sm_90a)."""
    if request.param == "wgmma" and not _wgmma_runs_here():
        pytest.skip("the wgmma SDDMM needs a cc 9.0 GPU and an sm_90a build")
    with force_kernel(sddmm=request.param):
        yield request.param


def _sddmm_gather(gather, kernel, m):
    """The lab knobs for ``gather`` (``staged``: the product's; ``regs``: the lab build's register gather, M = 8 on the
    wgmma kernel only, other pairings skipped)."""
    if gather == "regs" and (kernel != "wgmma" or m != 8):
        pytest.skip("the register gather only changes the wgmma kernel at M = 8")
    return lab_knobs(**({"sddmm_gather_regs": 1} if gather == "regs" else {}))


def _assert_sddmm_matches_reference(dy, x, mask, p):
    """``sddmm`` on NaN-poisoned memory, scattered dense: error against fp64 within 2x of torch's own GEMM error in
    the same dtype, exact zeros off the mask, no NaN (every slot written)."""
    poison_allocator()
    vals = sddmm(dy, x, p)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(vals[p.valid]).any()), "unwritten or NaN slot"
    got = scatter_dense(vals, p, torch.float32)
    assert not bool(torch.isnan(got).any())
    full = dy.double().t() @ x.double()
    ref = torch.where(mask, full, 0.0)
    torch_err = rel_err(torch.where(mask, (dy.t() @ x).double(), 0.0), ref)
    assert rel_err(got, ref) <= 2 * torch_err + 1e-6
    assert torch.count_nonzero(got[~mask]) == 0


@pytest.mark.parametrize(("v", "m"), PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "rows", "cols"), [(1, 128, 256), (7, 192, 512), (8191, 256, 1024)])
@pytest.mark.parametrize("gather", ["staged", "regs"])
def test_sddmm_kernel(v, m, dtype, tokens, rows, cols, gather, sddmm_kernel_env):
    if rows % v and m != 4:
        pytest.skip("rows not a multiple of v")
    w, mask, p = _pack_cuda(rows, cols, v, m, dtype, seed=tokens + 1)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    dy = torch.randn(tokens, rows, device="cuda").to(dtype)
    with _sddmm_gather(gather, sddmm_kernel_env, m):
        _assert_sddmm_matches_reference(dy, x, mask, p)


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8), (128, 8), (64, 16), (64, 32), (128, 64), (64, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "rows", "groups"), [(33, 320, 136), (1000, 2048, 520), (4100, 192, 72)])
@pytest.mark.parametrize("gather", ["staged", "regs"])
def test_sddmm_ragged_group_tiles_and_token_splits(v, m, dtype, tokens, rows, groups, gather, sddmm_kernel_env):
    # Several 64-group tiles with a partial last one, an odd slab count (a CTA with one real slab), ragged token
    # stages; (2048, 520 groups) fills the GPU without a token split (plain stores), the others split the tokens
    # over CTAs (atomics into a zeroed output).
    if rows % v and m != 4:
        pytest.skip("rows not a multiple of v")
    w, mask, p = _pack_cuda(rows, groups * m, v, m, dtype, seed=tokens + m)
    x = torch.randn(tokens, groups * m, device="cuda").to(dtype)
    dy = torch.randn(tokens, rows, device="cuda").to(dtype)
    with _sddmm_gather(gather, sddmm_kernel_env, m):
        _assert_sddmm_matches_reference(dy, x, mask, p)


@pytest.mark.parametrize(("v", "m"), [(64, 8), (128, 8), (64, 16), (64, 32), (64, 128)])
@pytest.mark.parametrize("gather", ["staged", "regs"])
def test_sddmm_gather_uses_each_slabs_columns(v, m, gather, sddmm_kernel_env):
    # Consecutive 64-row slabs (one CTA) keep different columns in every group where V = 64: a gather that reused one
    # slab's offsets for the other, or mixed up groups, gives a wrong gradient here.
    with _sddmm_gather(gather, sddmm_kernel_env, m):
        _check_sddmm_gather_uses_each_slabs_columns(v, m)


def _check_sddmm_gather_uses_each_slabs_columns(v, m):
    rows, cols = 256, 72 * m
    mask = mask_with_distinct_slab_columns(rows, cols, v, m, seed=3 * m + v).cuda()
    w = torch.randn(rows, cols, device="cuda") * mask
    p = pack(w, mask, v, m, torch.bfloat16)
    if v == 64:
        assert not bool((p.columns[0] == p.columns[1]).all(-1)[: cols // m].any())
    x = torch.randn(300, cols, device="cuda").bfloat16()
    dy = torch.randn(300, rows, device="cuda").bfloat16()
    _assert_sddmm_matches_reference(dy, x, mask, p)
    # One-hot tokens: dy = e_r, x = e_c for a token gives exactly 1.0 at (r, c) if (r, c) is kept, else nothing.
    n = 64
    rr = torch.randint(0, rows, (n,), device="cuda")
    cc = torch.randint(0, cols, (n,), device="cuda")
    dy1 = torch.zeros(n, rows, device="cuda").bfloat16()
    x1 = torch.zeros(n, cols, device="cuda").bfloat16()
    dy1[torch.arange(n), rr] = 1
    x1[torch.arange(n), cc] = 1
    got = scatter_dense(sddmm(dy1, x1, p), p, torch.float32)
    ref = torch.zeros(rows, cols, device="cuda")
    ref.index_put_((rr, cc), torch.ones(n, device="cuda"), accumulate=True)
    assert torch.equal(got, torch.where(mask, ref, 0.0))


def test_sddmm_zero_tokens_and_auto_choice():
    if not _wgmma_runs_here():
        pytest.skip("the wgmma SDDMM needs a cc 9.0 GPU and an sm_90a build")
    from hf_sparse.ops.sddmm import AUTO_WGMMA_M, sddmm_kernel

    assert sddmm_kernel(8) == ("wgmma" if 8 in AUTO_WGMMA_M else "mma")
    _, _, p = _pack_cuda(128, 256, 64, 8, torch.bfloat16, seed=5)
    poison_allocator()
    with force_kernel(sddmm="wgmma"):
        out = sddmm(torch.empty(0, 128, device="cuda").bfloat16(), torch.empty(0, 256, device="cuda").bfloat16(), p)
    assert out.shape == (128, 64) and torch.count_nonzero(out) == 0


def test_dense_from_packed_on_gpu_matches_master():
    w, mask, p = _pack_cuda(128, 256, 128, 16, torch.bfloat16, seed=9)
    assert torch.equal(dense_from_packed(p, torch.float32), w.bfloat16().float())


def _check_wgmma_config(config, dtype, bias, tokens, rows, cols, seed):
    """2:4 on the sparse-wgmma kernel forced to tile configuration ``config`` (the lab build's numbering) against the
    reference."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(rows, cols, 64, 4, dtype, seed=seed)
    x = torch.randn(tokens, cols, device="cuda").to(dtype)
    b = torch.randn(rows, device="cuda").to(dtype) if bias else None
    with force_kernel(spmm="wgmma"), lab_knobs(sm90_config=config):
        _assert_spmm_matches_reference(x, w, p, b)


@pytest.mark.parametrize("config", list(range(36)))
@pytest.mark.parametrize(("tokens", "rows", "cols"), [(300, 448, 136), (8191, 192, 1000)])
def test_spmm_wgmma_tile_configs(config, tokens, rows, cols):
    # Every large-token tile configuration of the sm_90a kernel (lab build): 448 rows leave some m64
    # tiles of the 256-row configurations idle, and 136 / 1000 columns end in a partial k-tile.
    _check_wgmma_config(config, torch.bfloat16, True, tokens, rows, cols, config + tokens)


@pytest.mark.parametrize("config", list(range(6, 36)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("tokens", "rows", "cols"),
    # Set explicitly, the TMA configurations run at every token count: 1 / 7 / 65 / 200 tokens leave most of the
    # 256-token box past the end of X (zero fill), K = 40 / 8 is smaller than the 64-wide box, 1000 / 136 / 264 end
    # in a partial k-tile, 96 has an odd step count, and 448 / 320 rows leave a consumer warpgroup idle.
    # 2600 tokens = 11 token tiles: the grouped orders (8 / 4 tiles per group) end in a partial group.
    [(1, 64, 40), (7, 192, 96), (65, 320, 8), (200, 128, 1000), (257, 448, 264), (2600, 320, 72), (8191, 192, 136)],
)
def test_spmm_wgmma_tma_configs(config, dtype, bias, tokens, rows, cols):
    # Configs 6-9: warp-specialized TMA producer + mbarrier ring (csrc/spmm_sm90.cu), one vs zero k-tiles in flight,
    # without (6, 7) and with (8, 9) a 2-CTA cluster multicasting X; 10, 11: 6 with grouped CTA order (8, 4 token tiles);
    # 12: 6 launched in 2-CTA clusters with the cluster barriers but no sharing (diagnostic); 13-16: A fragments and
    # metadata by TMA too, 15/16 persistent (one CTA per SM walking the tiles), 17/18 persistent with the two consumer
    # warpgroups two k-tiles apart, 19 = 15 with 128-token tiles, 20-27: staged epilogue (stmatrix + TMA store),
    # 28-30: 20 / 27 / 23 in 2-CTA clusters multicasting X (320 / 192 rows: an odd number of 128-row blocks, so one
    # CTA of the last cluster has no rows at all and still takes part in the multicast), 31: 28 without the sharing
    # (each CTA loads its whole X tile; diagnostic), 32 / 33: 20 / 27 with trimmed launch edges (maps prefetched first,
    # exit after the last TMA store's reads: the poisoned outputs check that every write still lands), 34 / 35: 20 with
    # 3 x 64- / 7 x 32-token staging buffers that rotate across tiles (tiles of several per CTA below and in the
    # many-tiles and staged-epilogue tests; 448 / 320 rows: a warpgroup idle in some tiles and not in others).
    _check_wgmma_config(config, dtype, bias, tokens, rows, cols, config + tokens + cols)


@pytest.mark.parametrize("config", list(range(13, 36)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("tokens", "rows", "cols"),
    # More output tiles than an H200 has SMs (132), so the persistent configs 15/16 walk several tiles per CTA and
    # carry the ring's phase across tiles: 9 x 32 = 288 tiles (the last row block half empty: an idle warpgroup in
    # some tiles only, K = 200: odd step count), 33 x 12 = 396 tiles (3 per CTA, K = 264: partial k-tile). Full tiles
    # take the check-free epilogue (store_tile_full), the last row block / token tile the general one; 1031 rows (odd:
    # no 32-bit row-pair stores) send every tile of that case to the general epilogue.
    [(8191, 1088, 200), (3000, 4160, 264), (2048, 1031, 136)],
)
def test_spmm_wgmma_tma_a_configs_many_tiles(config, dtype, bias, tokens, rows, cols):
    _check_wgmma_config(config, dtype, bias, tokens, rows, cols, config + rows + cols)


STAGED_EPILOGUE_CONFIGS = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35]


@pytest.mark.parametrize("config", STAGED_EPILOGUE_CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("tokens", "rows", "cols"),
    # The staged epilogue (csrc/spmm_sm90.cu, store_tile_staged): chunks of the tile go out by TMA store, which
    # clips at the tensor's edges. Ragged token counts end inside a chunk (1, 7, 65, 257: most chunks of the last
    # tile lie wholly past the end and are skipped; 8191: one token short); 1000 / 72 / 200 rows are multiples of 8
    # but not of the 64-row box (the last box is clipped, 72: one warpgroup idle); 1031 rows (odd, no 16-byte row
    # stride for a tensor map) falls back to config 15 (19 from configs 23 and 27). 8191 x 1000: 32 x 8 = 256 tiles,
    # more than the 132 SMs (the staging buffers reused across tiles of a persistent CTA); 3000 x 4160: 12 x 33 = 396
    # tiles; the others fewer.
    [
        (1, 1000, 64),
        (7, 72, 200),
        (65, 1000, 136),
        (257, 72, 1024),
        (8191, 1000, 264),
        (3000, 4160, 96),
        (513, 200, 40),
        (700, 1031, 136),
    ],
)
def test_spmm_wgmma_staged_epilogue_configs(config, dtype, bias, tokens, rows, cols):
    _check_wgmma_config(config, dtype, bias, tokens, rows, cols, 7 * config + tokens + rows)


@pytest.mark.parametrize(
    ("tokens", "rows"),
    [(300, 4096), (4100, 4096), (8190, 4096), (4100, 4090), (300, 4090), (8190, 4090), (8190, 768), (8190, 762)],
)
def test_spmm_wgmma_default_config_matches_reference(tokens, rows):
    # The product's large-token tile (sm90_large_config) on a 4096 x 6144 weight (25 MB packed): 300 tokens
    # = 64 256-token tiles, too few for the SMs, so config 23 (128-token tiles, 96 of them, a partial one); 4100 tokens
    # = 544 256-token tiles fill 82% of 5 rounds, 1056 128-token ones all of 8: config 23 (several per CTA, the last
    # tile 4 tokens wide); 8190: 1024 tiles, config 20. 4090 rows (not a multiple of 8: no tensor map of Y) take the
    # direct-store fallbacks of 20 / 23 (configs 15 / 19). 768 rows
    # at 8190 tokens: 192 256-token tiles fill 73% of the SMs' two rounds, 258 192-token tiles 98%: config 27 (762
    # rows: its fallback, config 19).
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(rows, 6144, 64, 4, torch.bfloat16, seed=61 + rows)
    x = torch.randn(tokens, 6144, device="cuda").bfloat16()
    b = torch.randn(rows, device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"):
        _assert_spmm_matches_reference(x, w, p, b)


def _assert_gelu_linear_matches(y, x, w, b):
    """``y`` is ``gelu(F.linear(x, w, b))`` (exact GELU): no NaN, error against fp64 within 2x of PyTorch's own
    unfused bf16/fp16 error (F.linear, then F.gelu, in x's dtype)."""
    torch.cuda.synchronize()
    wq = w.to(x.dtype)
    assert y.shape == (*x.shape[:-1], w.shape[0]) and y.dtype == x.dtype
    assert not bool(torch.isnan(y).any()), "unwritten or NaN output"
    ref = F.gelu(F.linear(x.double(), wq.double(), None if b is None else b.double()))
    assert rel_err(y, ref) <= 2 * rel_err(F.gelu(F.linear(x, wq, b)), ref) + 1e-6


@pytest.mark.parametrize("config", [None, 15, 19, 20, 23, 27, 6, 13, 0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("tokens", "rows", "cols"), [(1, 64, 40), (7, 192, 96), (300, 448, 136), (8191, 256, 1000)])
def test_spmm_fused_gelu_matches_reference(config, dtype, bias, tokens, rows, cols):
    """The 2:4 sparse-wgmma kernel's epilogue GELU, in every epilogue (staged 20/23/27, full-tile 15/19, direct 13,
    the TMA-B kernel 6, the register kernel 0: forced in the lab build; and the product's choice, None)."""
    if not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(rows, cols, 64, 4, dtype, seed=tokens + rows)
    x = (2 * torch.randn(tokens, cols, device="cuda")).to(dtype)  # spread over GELU's curved part and both tails
    b = torch.randn(rows, device="cuda").to(dtype) if bias else None
    poison_allocator()
    with force_kernel(spmm="wgmma"), lab_knobs(**({} if config is None else {"sm90_config": config})):
        _assert_gelu_linear_matches(spmm(x, p, b, activation="gelu"), x, w, b)


@pytest.mark.parametrize(("v", "m"), [(64, 4), (64, 8), (128, 16)])
@pytest.mark.parametrize("kernel", ["mma_sp", "wgmma"])
def test_spmm_gelu_on_kernels_without_the_fusion(v, m, kernel):
    """mma.sp and the V:2:M kernel have no epilogue activation: spmm applies GELU after them, with the same result."""
    if kernel == "wgmma" and not _wgmma_runs_here():
        pytest.skip("sparse wgmma needs a cc 9.0 GPU and an sm_90a build")
    w, mask, p = _pack_cuda(256, 16 * m, v, m, torch.bfloat16, seed=m)
    x = torch.randn(3, 50, 16 * m, device="cuda").bfloat16()
    b = torch.randn(256, device="cuda").bfloat16()
    poison_allocator()
    with force_kernel(spmm=kernel):
        _assert_gelu_linear_matches(spmm(x, p, b, activation="gelu"), x, w, b)
        with pytest.raises(ValueError, match="activation"):
            spmm(x, p, b, activation="relu")


_BAD_ARGUMENT = """
import torch
from hf_sparse.ops import pack
from hf_sparse.ops._build import load_extension
ext = load_extension()
w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
mask = torch.zeros(128, 64, 4, dtype=torch.bool, device="cuda")
mask[..., :2] = True
p = pack(w, mask.view(128, 256), 64, 4)
mask8 = torch.zeros(128, 32, 8, dtype=torch.bool, device="cuda")
mask8[..., :2] = True
p8 = pack(w, mask8.view(128, 256), 64, 8)
x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
calls = {
    "cpu input": ("spmm", lambda: ext.spmm(x.cpu(), p.values, p.meta, p.columns, None, 128, 256, 64, 4, 0)),
    "wrong dtype": ("spmm", lambda: ext.spmm(x.float(), p.values, p.meta, p.columns, None, 128, 256, 64, 4, 0)),
    "wrong features": ("spmm", lambda: ext.spmm(x[:, :128].contiguous(), p.values, p.meta, p.columns, None, 128, 256,
                                                64, 4, 0)),
    "wrong pack shape": ("spmm", lambda: ext.spmm(x, p.values[:1].contiguous(), p.meta, p.columns, None, 128, 256, 64,
                                                  4, 0)),
    "wrong group size": ("spmm", lambda: ext.spmm(x, p.values, p.meta, p.columns, None, 128, 256, 64, 3, 0)),
    "wrong block height": ("spmm", lambda: ext.spmm(x, p8.values, p8.meta, p8.columns, None, 128, 256, 96, 8, 0)),
    "wrong table": ("refresh_packs", lambda: ext.refresh_packs(torch.zeros(2, 5, dtype=torch.int64, device="cuda"),
                                                               1)),
    "wrong positions": ("gather_kept", lambda: ext.gather_kept(w, torch.zeros(128, 3, dtype=torch.uint8,
                                                                              device="cuda"), None, 128, 256, 1, 4,
                                                               torch.float32)),
}
op, call = calls[BAD]
try:
    call()
except RuntimeError as err:
    assert "hf_sparse." + op in str(err), err
    y = ext.spmm(x, p.values, p.meta, p.columns, None, 128, 256, 64, 4, 0)
    assert torch.isfinite(y).all()  # the extension still works after the error
    print("raised")
"""


BAD_ARGUMENTS = [
    "cpu input",
    "wrong dtype",
    "wrong features",
    "wrong pack shape",
    "wrong group size",
    "wrong block height",
    "wrong table",
    "wrong positions",
]


@pytest.mark.parametrize("bad", BAD_ARGUMENTS)
def test_a_bad_argument_to_the_binding_raises_runtime_error(bad):
    """A check failing inside the extension reaches Python as a ``RuntimeError`` naming the op, and the process
    goes on (the binding is called directly, with none of the Python checks in front of it); messages holding
    numbers and shapes included (csrc/check.h). Run in a child process, so a crash fails this test instead of
    ending the test session."""
    import os
    import subprocess
    import sys

    code = f"BAD = {bad!r}\n" + _BAD_ARGUMENT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0 and "raised" in result.stdout, (result.returncode, result.stderr[-2000:])
