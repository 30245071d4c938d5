import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparse.formats.bitpack import pack_bits, unpack_bits
from hf_sparse.formats.compressed import (
    CompressedFormatError,
    compress,
    decompress,
    mask_from_compressed,
    validate,
)
from hf_sparse.masks import apply_mask, compute_mask
from hf_sparse.patterns import VNM, parse_pattern


def test_pack_bits_readable():
    # 2-bit values 1, 2, 3, 0 -> bits (LSB first) 10 01 11 00 -> 0b00111001
    assert pack_bits(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[0b00111001]]
    # 3-bit values 5, 7, 1 -> stream 101 111 100 (LSB first per value) -> byte0 = bits0..7, byte1 = bit8
    assert pack_bits(torch.tensor([[5, 7, 1]]), 3).tolist() == [[0b01111101, 0b00000000]]
    assert unpack_bits(torch.tensor([[0b01111101, 0]], dtype=torch.uint8), 3, 3).tolist() == [[5, 7, 1]]


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 4), count=st.integers(1, 19), bits=st.integers(1, 8), seed=st.integers(0, 999))
def test_bitpack_round_trip(rows, count, bits, seed):
    values = torch.randint(0, 2**bits, (rows, count), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpack_bits(pack_bits(values, bits), bits, count), values)


def _masked(pattern, shape, seed=0, dtype=torch.float32):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    mask = compute_mask(weight.abs().float(), pattern)
    apply_mask(weight, mask)
    return weight, mask


def test_readable_2to4_layout():
    weight = torch.tensor([[0.0, 5.0, 0.0, 6.0, 7.0, 0.0, 8.0, 0.0]])
    mask = weight != 0
    tensors = compress(weight, mask, parse_pattern("2:4"))
    assert tensors["weight"].tolist() == [[5.0, 6.0, 7.0, 8.0]]
    # offsets 1, 3, 0, 2 at 2 bits each, LSB first: 01 11 00 10 -> 0b10001101
    assert tensors["weight_indices"].tolist() == [[0b10001101]]


def test_readable_vnm_layout():
    pattern = VNM(2, 2, 8)
    weight = torch.zeros(2, 8)
    weight[0, 1], weight[0, 5] = 1.0, 2.0
    weight[1, 3], weight[1, 7] = 3.0, 4.0
    tensors = compress(weight, weight != 0, pattern)
    assert tensors["weight_columns"].tolist() == [[[1, 3, 5, 7]]]
    assert tensors["weight"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    # row 0 selects positions 0, 2 of the block's columns; row 1 positions 1, 3 (2 bits each, LSB first)
    assert tensors["weight_selectors"].tolist() == [[0b00001000], [0b00001101]]


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(
        ["2:4", "1:4", "2:8", "3:8", "4:16", "8:4:8", "8:2:8", "4:2:16", "8:6:8", "unstructured:0.7"]
    ),
    row_blocks=st.integers(1, 3),
    groups=st.integers(1, 3),
    seed=st.integers(0, 9999),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_round_trip_bit_exact(spec, row_blocks, groups, seed, dtype):
    pattern = parse_pattern(spec)
    v = getattr(pattern, "v", 1)
    m = getattr(pattern, "m", 5)
    shape = (row_blocks * v, groups * m)
    weight, mask = _masked(pattern, shape, seed, dtype)
    tensors = compress(weight, mask, pattern)
    validate(tensors, pattern, shape, "layer")
    assert torch.equal(decompress(tensors, pattern, shape), weight)
    assert torch.equal(mask_from_compressed(tensors, pattern, shape), mask)


def test_kept_zero_survives():
    weight, mask = _masked(parse_pattern("2:4"), (4, 8))
    weight[0, mask[0].nonzero()[0]] = 0.0  # a kept weight that is exactly zero
    tensors = compress(weight, mask, parse_pattern("2:4"))
    assert torch.equal(mask_from_compressed(tensors, parse_pattern("2:4"), (4, 8)), mask)


@pytest.mark.parametrize("spec, limit", [("2:4", 0.57), ("64:2:8", 0.30)])
def test_size_targets_bf16(spec, limit):
    pattern = parse_pattern(spec)
    weight, mask = _masked(pattern, (768, 3072), dtype=torch.bfloat16)
    size = sum(t.numel() * t.element_size() for t in compress(weight, mask, pattern).values())
    assert size / (weight.numel() * 2) <= limit


def test_mask_not_following_pattern_is_rejected():
    weight = torch.ones(1, 4)
    with pytest.raises(CompressedFormatError, match="exactly 2"):
        compress(weight, torch.tensor([[True, True, True, False]]), parse_pattern("2:4"))


def test_validate_names_tensor_and_problem():
    pattern = parse_pattern("64:2:8")
    weight, mask = _masked(pattern, (64, 16))
    good = compress(weight, mask, pattern)
    bad = dict(good, weight_columns=good["weight_columns"].clone())
    bad["weight_columns"][0, 0, 3] = 9
    with pytest.raises(CompressedFormatError, match=r"enc\.weight_columns: index 9 out of range \[0, 8\)"):
        validate(bad, pattern, (64, 16), "enc")
    unsorted = dict(good, weight_columns=good["weight_columns"].flip(-1).contiguous())
    with pytest.raises(CompressedFormatError, match="strictly increasing"):
        validate(unsorted, pattern, (64, 16), "enc")
    with pytest.raises(CompressedFormatError, match=r"enc\.weight: shape \(64, 3\)"):
        validate(dict(good, weight=good["weight"][:, :3]), pattern, (64, 16), "enc")
    with pytest.raises(CompressedFormatError, match=r"enc\.weight_selectors: missing"):
        validate({k: v for k, v in good.items() if k != "weight_selectors"}, pattern, (64, 16), "enc")
    with pytest.raises(CompressedFormatError, match="dtype"):
        validate(dict(good, weight_columns=good["weight_columns"].to(torch.int32)), pattern, (64, 16), "enc")


@pytest.mark.parametrize("spec", ["2:4", "2:8", "64:2:8", "64:6:8", "unstructured:0.7"])
def test_compressed_nbytes_matches_the_tensors(spec):
    from hf_sparse.formats.compressed import compressed_nbytes

    pattern = parse_pattern(spec)
    weight, mask = _masked(pattern, (128, 64), dtype=torch.bfloat16)
    tensors = compress(weight, mask, pattern)
    nnz = int(mask.sum()) if spec.startswith("unstructured") else None
    assert compressed_nbytes(pattern, 128, 64, 2, nnz) == sum(t.numel() * t.element_size() for t in tensors.values())
