"""Bit-exact checks of the kernel layout conversions (CPU, pure torch)."""

from __future__ import annotations

import pytest
import torch

from hf_sparse.ops import dense_from_packed, kept_columns, pack, pack_from_logical
from hf_sparse.ops._layout import logical_from_dense

from ._helpers import PATTERNS, mask_with_distinct_slab_columns, random_masked


@pytest.mark.parametrize(("v", "m"), PATTERNS)
@pytest.mark.parametrize(("rows", "cols"), [(128, 128), (256, 384)])
def test_pack_roundtrip_exact(v, m, rows, cols):
    if cols % m:
        pytest.skip("cols not a multiple of m")
    w, mask = random_masked(rows, cols, v, m)
    p = pack(w, mask, v, m, torch.float16)
    assert torch.equal(dense_from_packed(p, torch.float32), w.half().float())


@pytest.mark.parametrize(("v", "m"), [(64, 8), (64, 16), (128, 8), (64, 128)])
def test_distinct_slab_columns_mask_is_v2m_with_its_slabs_apart(v, m):
    # The GPU tests' mask whose consecutive 64-row slabs keep different columns: 2 of M per row and group, at most 4
    # columns per group in each V-row block, and (V = 64) no group where two consecutive slabs keep the same columns;
    # the pack takes it back bit-exactly.
    rows, groups = 3 * v, 40
    mask = mask_with_distinct_slab_columns(rows, groups * m, v, m, seed=7).reshape(rows, groups, m)
    assert (mask.sum(-1) == 2).all()
    kept = mask.reshape(rows // v, v, groups, m).any(1)  # the columns each block keeps, per group
    assert (kept.sum(-1) <= 4).all()
    if v == 64:
        assert not (kept[1:] == kept[:-1]).all(-1).any()
    w = torch.randn(rows, groups * m) * mask.reshape(rows, -1)
    p = pack(w, mask.reshape(rows, -1), v, m, torch.bfloat16)
    assert torch.equal(dense_from_packed(p, torch.float32), w.bfloat16().float())


def test_pack_arange_readable():
    # 2:4 on an arange weight: row r keeps columns 1 and 3 of each group -> easy to read back.
    w = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + 1
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, 1::2] = True
    p = pack(w, mask, 64, 4, torch.float32 if False else torch.bfloat16)
    cols = kept_columns(p)
    assert cols[0].tolist() == [1, 3, 5, 7]
    assert torch.equal(dense_from_packed(p, torch.float32), torch.where(mask, w, 0.0).bfloat16().float())


def test_odd_rows_and_groups_padded():
    w, mask = random_masked(100, 12, 64, 4, seed=3)  # 2:4: rows not a multiple of 64, 3 groups (< 8 per step)
    p = pack(w, mask, 64, 4, torch.bfloat16)
    assert p.values.shape == (8, 1, 32, 8)
    assert torch.equal(dense_from_packed(p, torch.float32), w.bfloat16().float())


def test_padding_slots_are_invalid_and_positive_zero():
    w, mask = random_masked(64, 32, 64, 8, seed=1)
    values, _, _, valid = logical_from_dense(-w.abs() - 1, mask, 64, 8)
    assert not bool(valid[3, :4].any())
    pad = values[~valid]
    assert torch.equal(pad, torch.zeros_like(pad)) and not bool(torch.signbit(pad).any())


def test_pack_from_logical_matches_pack():
    w, mask = random_masked(128, 64, 64, 16, seed=2)
    values, columns, selectors, valid = logical_from_dense(w, mask, 64, 16)
    p1 = pack(w, mask, 64, 16, torch.bfloat16)
    p2 = pack_from_logical(values, columns, selectors, 64, 16, torch.bfloat16)
    for a, b in zip(p1[:3], p2[:3], strict=True):
        assert torch.equal(a, b)


def test_pack_rejects_bad_masks():
    w = torch.randn(64, 16)
    with pytest.raises(ValueError, match="more than 4 columns"):
        pack(w, torch.ones_like(w, dtype=torch.bool), 64, 8)
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, :3] = True
    with pytest.raises(ValueError, match="more than 2"):
        pack(w, mask, 64, 8)
    with pytest.raises(ValueError, match="multiple of v"):
        pack(torch.randn(96, 16), torch.zeros(96, 16, dtype=torch.bool), 64, 8)
    with pytest.raises(ValueError, match="m=5"):
        pack(w, mask, 64, 5)
    with pytest.raises(ValueError, match="selectors"):
        pack_from_logical(
            torch.zeros(64, 4), torch.zeros(1, 2, 4, dtype=torch.uint8), torch.ones(64, 2, 2, dtype=torch.uint8), 64, 8
        )
