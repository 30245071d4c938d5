"""The logical on-disk format of a pruned weight (specified in ``docs/format.md``, ``format_version`` 1).

A pruned layer ``prefix`` with logical weight ``(R, K)`` (``(out, in)``; GPT-2 ``Conv1D`` included) is stored as:

=====================  ===========================  ===============================================================
tensor                 dtype / shape                meaning
=====================  ===========================  ===============================================================
``prefix.weight``      model dtype                  kept values, row-major, increasing column inside a row
                       ``(R, K/M*N)`` N:M, V:N:M
                       ``(nnz,)`` unstructured
``prefix.weight_indices``  uint8 ``(R, B)``          N:M: each kept value's offset in its group of M,
                                                    ``ceil(log2 M)`` bits each, packed per row (LSB first)
``prefix.weight_columns``  uint8 ``(R/V, K/M, C)``   V:N:M: the C (=4) kept column offsets of each V x M block,
                                                    strictly increasing
``prefix.weight_selectors`` uint8 ``(R, B)``         V:N:M: each kept value's position among its block's C columns,
                                                    ``ceil(log2 C)`` bits each, packed per row (absent if N == C)
``prefix.weight_bitmap``   uint8 ``(R, ceil(K/8))``  unstructured: the mask, one bit per weight, packed per row
=====================  ===========================  ===============================================================

Kept zeros stay in ``weight`` (the mask is stored exactly, not inferred from values). Nothing here depends on a
kernel's tiling: kernels re-lay the tensors out at load time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..patterns import NM, VNM, Pattern, Unstructured
from .bitpack import pack_bits, packed_row_bytes, unpack_bits

__all__ = [
    "FORMAT_VERSION",
    "POSITION_KEYS",
    "QUANT_METHOD",
    "CompressedFormatError",
    "compress",
    "compressed_nbytes",
    "compressed_shapes",
    "decompress",
    "kept_index",
    "mask_from_compressed",
    "validate",
]

FORMAT_VERSION = 1
#: ``quantization_config.quant_method`` of an hf_sparse checkpoint (``config.json``).
QUANT_METHOD = "hf_sparse"
#: The position tensors a compressed weight may have beside its values (each pattern has one or two of them).
POSITION_KEYS = ("weight_indices", "weight_columns", "weight_selectors", "weight_bitmap")


class CompressedFormatError(ValueError):
    """A compressed tensor that does not match its declared pattern and shape; the message names the tensor."""


def _index_bits(m: int) -> int:
    return max(1, math.ceil(math.log2(m)))


def _kept_positions(mask: Tensor, count: int, what: str) -> Tensor:
    """Offsets (increasing) of the ``count`` True entries along the last dim; raises if any group has another count."""
    counts = mask.sum(dim=-1)
    if not bool((counts == count).all()):
        bad = int((counts != count).sum())
        raise CompressedFormatError(f"{what}: {bad} group(s) do not keep exactly {count} entries")
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    return order[..., :count]


def compress(weight: Tensor, mask: Tensor, pattern: Pattern) -> dict[str, Tensor]:
    """Compress a logical ``(R, K)`` weight under ``mask`` (which must follow ``pattern``) into named tensors.

    Keys are suffixes of the parameter name: ``"weight"``, ``"weight_indices"``, ``"weight_columns"``,
    ``"weight_selectors"``, ``"weight_bitmap"``.
    """
    rows, cols = weight.shape
    if mask.shape != weight.shape:
        raise ValueError(f"compress: mask shape {tuple(mask.shape)} != weight shape {tuple(weight.shape)}")
    mask = mask.to(device=weight.device, dtype=torch.bool)
    if isinstance(pattern, Unstructured):
        return {"weight": weight[mask].contiguous(), "weight_bitmap": pack_bits(mask, 1)}
    if isinstance(pattern, NM):
        m, n = pattern.m, pattern.n
        groups = mask.reshape(rows, cols // m, m)
        offsets = _kept_positions(groups, n, f"compress {pattern}")  # (R, G, n)
        values = weight.reshape(rows, cols // m, m).gather(-1, offsets).reshape(rows, -1)
        indices = pack_bits(offsets.reshape(rows, -1), _index_bits(m))
        return {"weight": values.contiguous(), "weight_indices": indices}
    if isinstance(pattern, VNM):
        v, n, m, c = pattern.v, pattern.n, pattern.m, pattern.keep_cols
        blocks = mask.reshape(rows // v, v, cols // m, m)
        used = blocks.any(dim=1)  # (R/v, G, m)
        if bool((used.sum(-1) > c).any()):
            raise CompressedFormatError(f"compress {pattern}: a {v}x{m} block uses more than {c} columns")
        # the block's used columns, topped up with the lowest unused offsets, in increasing order
        columns = torch.argsort((~used).to(torch.int8), dim=-1, stable=True)[..., :c].sort(dim=-1).values
        in_block = blocks.gather(-1, columns.unsqueeze(1).expand(-1, v, -1, -1))  # (R/v, v, G, c)
        selectors = _kept_positions(in_block, n, f"compress {pattern}")  # (R/v, v, G, n)
        offsets = columns.unsqueeze(1).expand(-1, v, -1, -1).gather(-1, selectors)
        values = weight.reshape(rows // v, v, cols // m, m).gather(-1, offsets).reshape(rows, -1)
        out = {"weight": values.contiguous(), "weight_columns": columns.to(torch.uint8).contiguous()}
        if n < c:
            out["weight_selectors"] = pack_bits(selectors.reshape(rows, -1), _index_bits(c))
        return out
    raise TypeError(f"compress: unknown pattern {pattern!r}")


def compressed_shapes(pattern: Pattern, rows: int, cols: int, nnz: int | None = None) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor of a compressed ``(rows, cols)`` weight (``nnz`` for unstructured values)."""
    if isinstance(pattern, Unstructured):
        return {"weight": (nnz if nnz is not None else -1,), "weight_bitmap": (rows, packed_row_bytes(cols, 1))}
    if isinstance(pattern, NM):
        kept = cols // pattern.m * pattern.n
        return {"weight": (rows, kept), "weight_indices": (rows, packed_row_bytes(kept, _index_bits(pattern.m)))}
    if isinstance(pattern, VNM):
        kept = cols // pattern.m * pattern.n
        shapes = {"weight": (rows, kept), "weight_columns": (rows // pattern.v, cols // pattern.m, pattern.keep_cols)}
        if pattern.n < pattern.keep_cols:
            shapes["weight_selectors"] = (rows, packed_row_bytes(kept, _index_bits(pattern.keep_cols)))
        return shapes
    raise TypeError(f"unknown pattern {pattern!r}")


def compressed_nbytes(pattern: Pattern, rows: int, cols: int, value_bytes: int, nnz: int | None = None) -> int:
    """Bytes the compressed tensors of a ``(rows, cols)`` weight take, without building them."""
    shapes = compressed_shapes(pattern, rows, cols, nnz)
    return sum(math.prod(shape) * (value_bytes if key == "weight" else 1) for key, shape in shapes.items())


def _offsets(tensors: dict[str, Tensor], pattern: NM | VNM, rows: int, cols: int) -> Tensor:
    """Absolute in-group column offsets of every stored value: ``(R, G, n)`` int64."""
    groups = cols // pattern.m
    if isinstance(pattern, NM):
        return unpack_bits(tensors["weight_indices"], _index_bits(pattern.m), groups * pattern.n).reshape(
            rows, groups, pattern.n
        )
    v, n, c = pattern.v, pattern.n, pattern.keep_cols
    columns = tensors["weight_columns"].to(torch.int64).unsqueeze(1).expand(-1, v, -1, -1)  # (R/v, v, G, c)
    if n < c:
        selectors = unpack_bits(tensors["weight_selectors"], _index_bits(c), groups * n)
        selectors = selectors.reshape(rows // v, v, groups, n)
    else:
        selectors = torch.arange(c, device=columns.device).expand(rows // v, v, groups, c)
    return columns.gather(-1, selectors).reshape(rows, groups, n)


def mask_from_compressed(tensors: dict[str, Tensor], pattern: Pattern, shape: tuple[int, int]) -> Tensor:
    """The exact ``bool`` mask a compressed weight encodes."""
    rows, cols = shape
    if isinstance(pattern, Unstructured):
        return unpack_bits(tensors["weight_bitmap"], 1, cols).bool()
    offsets = _offsets(tensors, pattern, rows, cols)
    mask = torch.zeros(rows, cols // pattern.m, pattern.m, dtype=torch.bool, device=offsets.device)
    return mask.scatter_(-1, offsets, True).reshape(rows, cols)


def kept_index(tensors: dict[str, Tensor], pattern: Pattern, shape: tuple[int, int]) -> Tensor:
    """Flat index (int64, ``(nnz,)``) into the logical ``R * K`` weight of every stored value, in ``weight``'s order:
    ``dense.view(-1)[kept_index(...)]`` are the values, ``dense.view(-1).index_put_((index,), values)`` the inverse."""
    rows, cols = shape
    if isinstance(pattern, Unstructured):
        return mask_from_compressed(tensors, pattern, shape).reshape(-1).nonzero().squeeze(1)
    offsets = _offsets(tensors, pattern, rows, cols)  # (R, G, n) within the group
    groups = cols // pattern.m
    base = torch.arange(rows, device=offsets.device).view(-1, 1, 1) * cols
    base = base + torch.arange(groups, device=offsets.device).view(1, -1, 1) * pattern.m
    return (base + offsets).reshape(-1)


def decompress(tensors: dict[str, Tensor], pattern: Pattern, shape: tuple[int, int]) -> Tensor:
    """The dense logical ``(R, K)`` weight, ``+0.0`` at pruned positions."""
    rows, cols = shape
    values = tensors["weight"]
    if isinstance(pattern, Unstructured):
        mask = mask_from_compressed(tensors, pattern, shape).to(values.device)
        dense = torch.zeros(rows, cols, dtype=values.dtype, device=values.device)
        dense[mask] = values
        return dense
    offsets = _offsets(tensors, pattern, rows, cols).to(values.device)
    dense = torch.zeros(rows, cols // pattern.m, pattern.m, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, offsets, values.reshape(rows, cols // pattern.m, pattern.n))
    return dense.reshape(rows, cols)


def validate(tensors: dict[str, Tensor], pattern: Pattern, shape: tuple[int, int], prefix: str = "") -> None:
    """Check a compressed weight against its pattern and shape; raise naming the tensor and the problem."""
    rows, cols = shape

    def name(key: str) -> str:
        return f"{prefix}.{key}" if prefix else key

    fit = pattern.fit_error(rows, cols)
    if fit:
        raise CompressedFormatError(f"{name('weight')}: pattern {pattern} cannot tile shape ({rows}, {cols}): {fit}")
    values = tensors.get("weight")
    if values is None:
        raise CompressedFormatError(f"{name('weight')}: missing")
    nnz = values.shape[0] if isinstance(pattern, Unstructured) else None
    expected = compressed_shapes(pattern, rows, cols, nnz)
    for key, want in expected.items():
        got = tensors.get(key)
        if got is None:
            raise CompressedFormatError(f"{name(key)}: missing (pattern {pattern} needs it)")
        if tuple(got.shape) != want:
            raise CompressedFormatError(f"{name(key)}: shape {tuple(got.shape)}, expected {want} for {pattern}")
        if key != "weight" and got.dtype != torch.uint8:
            raise CompressedFormatError(f"{name(key)}: dtype {got.dtype}, expected torch.uint8")
    if not values.is_floating_point():
        raise CompressedFormatError(f"{name('weight')}: dtype {values.dtype} is not a floating-point dtype")
    if isinstance(pattern, Unstructured):
        kept = int(unpack_bits(tensors["weight_bitmap"], 1, cols).sum())
        if kept != values.shape[0]:
            raise CompressedFormatError(f"{name('weight_bitmap')}: marks {kept} weights but weight holds {nnz}")
        return
    groups = cols // pattern.m
    if isinstance(pattern, NM):
        offsets = unpack_bits(tensors["weight_indices"], _index_bits(pattern.m), groups * pattern.n)
        offsets = offsets.reshape(rows, groups, pattern.n)
        _check_increasing(offsets, pattern.m, name("weight_indices"))
        return
    _check_increasing(tensors["weight_columns"].to(torch.int64), pattern.m, name("weight_columns"))
    if pattern.n < pattern.keep_cols:
        selectors = unpack_bits(tensors["weight_selectors"], _index_bits(pattern.keep_cols), groups * pattern.n)
        _check_increasing(selectors.reshape(rows, groups, pattern.n), pattern.keep_cols, name("weight_selectors"))


def _check_increasing(offsets: Tensor, limit: int, what: str) -> None:
    if bool((offsets >= limit).any()) or bool((offsets < 0).any()):
        bad = int(offsets.max())
        raise CompressedFormatError(f"{what}: index {bad} out of range [0, {limit})")
    if offsets.shape[-1] > 1 and not bool((offsets[..., 1:] > offsets[..., :-1]).all()):
        raise CompressedFormatError(f"{what}: indices within a group must be strictly increasing")
