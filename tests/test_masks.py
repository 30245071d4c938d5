import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparse.masks import apply_mask, compute_mask, nm_mask, transposable_2to4_mask, unstructured_mask, vnm_mask
from hf_sparse.patterns import NM, VNM, Unstructured

T, F = True, False


def test_nm_keeps_largest_per_group_readable():
    score = torch.tensor([[0.0, 3.0, 1.0, 2.0, 9.0, 8.0, 7.0, 6.0]])
    assert nm_mask(score, 2, 4).tolist() == [[F, T, F, T, T, T, F, F]]
    assert nm_mask(score, 1, 4).tolist() == [[F, T, F, F, T, F, F, F]]
    assert nm_mask(score, 2, 8).tolist() == [[F, F, F, F, T, T, F, F]]


def test_ties_go_to_the_lower_index():
    assert nm_mask(torch.ones(1, 8), 2, 4).tolist() == [[T, T, F, F, T, T, F, F]]
    assert unstructured_mask(torch.ones(2, 3), 0.5).tolist() == [[T, T, T], [F, F, F]]


def test_vnm_readable():
    # v=2 rows, m=8: column sums are 1, 10, 2, 9, 3, 8, 4, 7 -> block keeps columns 1, 3, 5, 7
    score = torch.tensor([[0.0, 9.0, 1.0, 1.0, 2.0, 7.0, 3.0, 2.0], [1.0, 1.0, 1.0, 8.0, 1.0, 1.0, 1.0, 5.0]])
    mask = vnm_mask(score, v=2, n=2, m=8)
    # row 0 keeps its 2 largest of columns {1,3,5,7}: 9 (col 1) and 7 (col 5); row 1: 8 (col 3), 5 (col 7)
    assert mask.tolist() == [[F, T, F, F, F, T, F, F], [F, F, F, T, F, F, F, T]]
    # n > 4: whole columns, shared by the block's rows
    wide = vnm_mask(score, v=2, n=6, m=8, keep_cols=6)
    assert wide.tolist() == [[F, T, F, T, T, T, T, T]] * 2


def _all_doubly_2of4_masks() -> torch.Tensor:
    """Independent enumeration: every 0/1 4x4 matrix, filtered to two ones per row and per column."""
    every = torch.tensor(list(itertools.product((0, 1), repeat=16)), dtype=torch.float64).reshape(-1, 4, 4)
    valid = every[((every.sum(1) == 2).all(1)) & ((every.sum(2) == 2).all(1))]
    assert len(valid) == 90
    return valid


def _brute_force_transposable(block: torch.Tensor) -> float:
    return float((_all_doubly_2of4_masks() * block).sum(dim=(1, 2)).max())


@pytest.mark.parametrize("seed", range(3))
def test_transposable_is_exact(seed):
    score = torch.rand(8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    mask = transposable_2to4_mask(score)
    assert (mask.reshape(2, 4, 2, 4).sum(dim=1) == 2).all() and (mask.reshape(2, 4, 2, 4).sum(dim=3) == 2).all()
    for i, j in itertools.product(range(2), range(2)):
        block = score[4 * i : 4 * i + 4, 4 * j : 4 * j + 4].double()
        kept = float((block * mask[4 * i : 4 * i + 4, 4 * j : 4 * j + 4]).sum())
        assert kept == pytest.approx(_brute_force_transposable(block), abs=1e-12)


def test_transposable_rows_and_columns_are_2_of_4():
    mask = transposable_2to4_mask(torch.randn(64, 96).abs())
    assert (mask.reshape(64, 24, 4).sum(-1) == 2).all()
    assert (mask.T.reshape(96, 16, 4).sum(-1) == 2).all()


def test_unstructured_exact_count():
    score = torch.randn(37, 41).abs()
    mask = unstructured_mask(score, 0.9)
    assert int(mask.sum()) == round(0.1 * 37 * 41)
    assert score[mask].min() >= score[~mask].max()


def test_apply_mask_writes_positive_zero():
    w = -torch.rand(4, 8) - 0.1
    mask = nm_mask(w.abs(), 2, 4)
    apply_mask(w, mask)
    pruned = w[~mask]
    assert (pruned == 0).all() and not torch.signbit(pruned).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_mask_in_place_keeps_kept_values_on_views(dtype):
    stored = torch.randn(16, 8).to(dtype)  # GPT-2 Conv1D layout: the logical (8, 16) weight is stored transposed
    original = stored.clone()
    mask = torch.rand(8, 16) > 0.5
    out = apply_mask(stored.T, mask)
    assert out.data_ptr() == stored.data_ptr() and out.dtype == dtype
    assert torch.equal(stored.T[mask], original.T[mask])
    assert (stored.T[~mask] == 0).all() and not torch.signbit(stored.T[~mask]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_mask_on_cuda_keeps_kept_values_and_writes_positive_zero(dtype):
    stored = (torch.randn(64, 48, device="cuda") - 2.0).to(dtype)  # mostly negative: -0.0 would show
    original = stored.clone()
    mask = torch.rand(48, 64, device="cuda") > 0.5
    out = apply_mask(stored.T, mask)
    assert out.data_ptr() == stored.data_ptr()
    assert torch.equal(stored.T[mask], original.T[mask])
    assert (stored.T[~mask] == 0).all() and not torch.signbit(stored.T[~mask]).any()


def test_apply_masks_matches_apply_mask_per_pair():
    from hf_sparse.masks import apply_masks

    gen = torch.Generator().manual_seed(3)
    stored = [torch.randn(16, 8, generator=gen) - 1.0, torch.randn(5, 12, generator=gen).bfloat16()]
    masks = [torch.rand(8, 16, generator=gen) > 0.5, torch.rand(5, 12, generator=gen) > 0.5]
    expected = [stored[0].T.clone(), stored[1].clone()]
    for e, m in zip(expected, masks, strict=True):
        apply_mask(e, m)
    apply_masks([(stored[0].T, masks[0]), (stored[1], masks[1])])  # a transposed view (GPT-2 Conv1D) and a plain one
    assert torch.equal(stored[0].T, expected[0]) and torch.equal(stored[1], expected[1])
    assert not torch.signbit(stored[0].T[~masks[0]]).any()


def test_fused_masking_bumps_the_version_counter():
    from hf_sparse.masks import apply_masks

    w, mask = torch.randn(8, 8), torch.rand(8, 8) > 0.5
    version = w._version
    apply_masks([(w, mask)])
    assert w._version > version


def _cuda_extension_or_skip():
    from hf_sparse.ops._build import KernelUnavailableError, load_extension

    try:
        return load_extension()
    except KernelUnavailableError as exc:
        pytest.skip(f"the CUDA extension cannot be built here: {exc}")


def _masking_cases(device: str):
    """70 tensors (two launches of at most 64), three dtypes, sizes around the 16K-element chunk, mostly negative
    values (a -0.0 would show), and a view one element off its allocation (not 16-byte aligned)."""
    gen = torch.Generator(device="cpu").manual_seed(11)
    tensors, masks = [], []
    sizes = [1, 7, 8, 16383, 16384, 16385, 100003, (64, 48)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for i in range(70):
        size = sizes[i % len(sizes)]
        shape = size if isinstance(size, tuple) else (size,)
        t = (torch.randn(shape, generator=gen) - 2.0).to(dtypes[i % 3]).to(device)
        m = (torch.rand(shape, generator=gen) > 0.5).to(device)
        tensors.append(t)
        masks.append(m)
    base = (torch.randn(40001, generator=gen) - 2.0).to(device)
    base_mask = (torch.rand(40001, generator=gen) > 0.5).to(device)
    tensors.append(base[1:])
    masks.append(base_mask[1:])
    return tensors, masks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("through", ["extension", "apply_masks"])
def test_fused_masking_kernel_matches_where(through):
    from hf_sparse.masks import apply_masks

    ext = _cuda_extension_or_skip()
    tensors, masks = _masking_cases("cuda")
    expected = [
        torch.where(m, t, torch.zeros((), dtype=t.dtype, device="cuda")) for t, m in zip(tensors, masks, strict=True)
    ]
    versions = [t._version for t in tensors]
    if through == "extension":
        ext.apply_masks_(tensors, masks)
    else:
        apply_masks(zip(tensors, masks, strict=True))
        # written through raw pointers, yet in-place modified as far as autograd and version-keyed caches know
        assert all(t._version > v for t, v in zip(tensors, versions, strict=True))
    torch.cuda.synchronize()
    for t, m, e in zip(tensors, masks, expected, strict=True):
        assert torch.equal(t, e)  # kept values bit-exact, pruned ones zero
        assert not torch.signbit(t[~m]).any(), "a pruned entry is -0.0"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pairs_the_fused_kernel_cannot_take_are_masked_by_where():
    """Views (GPT-2's transposed weights), float64 and mismatched shapes never reach the extension, whose own argument
    errors are a last line (on the H200 an error raised inside an extension crashed the process: RESULTS.md)."""
    from hf_sparse.masks import _fusable, apply_masks

    _cuda_extension_or_skip()
    gen = torch.Generator(device="cpu").manual_seed(5)
    stored = (torch.randn(48, 64, generator=gen) - 2.0).cuda()  # logical (64, 48), stored transposed
    wide = (torch.randn(64, 48, generator=gen) - 2.0).double().cuda()
    mask = (torch.rand(64, 48, generator=gen) > 0.5).cuda()
    assert not _fusable(stored.T, mask) and not _fusable(wide, mask)
    assert not _fusable(wide.float(), mask.reshape(48, 64))
    expected = [torch.where(mask, t, torch.zeros((), dtype=t.dtype, device="cuda")) for t in (stored.T, wide)]
    apply_masks([(stored.T, mask), (wide, mask)])
    assert torch.equal(stored.T, expected[0]) and torch.equal(wide, expected[1])
    assert not torch.signbit(stored.T[~mask]).any() and not torch.signbit(wide[~mask]).any()


def test_compute_mask_rejects_transposable_for_other_patterns():
    with pytest.raises(ValueError, match="2:4"):
        compute_mask(torch.rand(8, 8), NM(2, 8), transposable=True)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple"):
        nm_mask(torch.rand(4, 6), 2, 4)
    with pytest.raises(ValueError, match="rows % 64"):
        vnm_mask(torch.rand(32, 8), 64, 2, 8)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    groups=st.integers(1, 5),
    nm=st.sampled_from([(1, 4), (2, 4), (3, 4), (2, 8), (5, 8)]),
    seed=st.integers(0, 2**16),
)
def test_nm_property(rows, groups, nm, seed):
    n, m = nm
    score = torch.rand(rows, groups * m, generator=torch.Generator().manual_seed(seed))
    mask = nm_mask(score, n, m).reshape(rows, groups, m)
    grouped = score.reshape(rows, groups, m)
    assert (mask.sum(-1) == n).all()
    kept_min = grouped.masked_fill(~mask, float("inf")).min(-1).values
    pruned_max = grouped.masked_fill(mask, float("-inf")).max(-1).values
    assert (kept_min >= pruned_max).all()


@settings(max_examples=30, deadline=None)
@given(
    blocks=st.integers(1, 3),
    v=st.sampled_from([1, 2, 4]),
    groups=st.integers(1, 3),
    nm=st.sampled_from([(2, 8), (1, 4), (2, 16), (3, 8)]),
    seed=st.integers(0, 2**16),
)
def test_vnm_property(blocks, v, groups, nm, seed):
    n, m = nm
    score = torch.rand(blocks * v, groups * m, generator=torch.Generator().manual_seed(seed))
    mask = vnm_mask(score, v, n, m).reshape(blocks, v, groups, m)
    assert (mask.sum(-1) == n).all()
    assert (mask.any(dim=1).sum(-1) <= 4).all()  # a block uses at most 4 columns
    pattern = VNM(v, n, m)
    assert torch.equal(compute_mask(score, pattern), mask.reshape(blocks * v, groups * m))


def test_compute_mask_unstructured_dispatch():
    score = torch.rand(10, 10)
    assert int(compute_mask(score, Unstructured(0.3)).sum()) == 70


def test_transposable_bit_table_matches_the_patterns_in_order():
    """The 16-bit table the CUDA kernel searches is the pattern list, in the order whose first best wins."""
    from hf_sparse.masks import _transposable_bits, _transposable_patterns

    bits = _transposable_bits(torch.device("cpu")).long() & 0xFFFF
    unpacked = torch.stack([(bits >> k) & 1 for k in range(16)], dim=1).double()
    assert torch.equal(unpacked, _transposable_patterns())
    assert len(set(bits.tolist())) == 90
