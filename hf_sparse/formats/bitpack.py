"""Packing small unsigned integers into ``uint8`` bytes, LSB first, row by row.

``pack_bits(values, bits)`` stores each integer of the last dimension in ``bits`` bits: value ``i`` of a row
occupies bits ``[i*bits, (i+1)*bits)`` of that row's little-endian bit stream, and every row is padded to whole
bytes. ``docs/format.md`` specifies the same layout; these functions are its reference implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_bits", "packed_row_bytes", "unpack_bits"]


def packed_row_bytes(count: int, bits: int) -> int:
    """Bytes one row of ``count`` ``bits``-bit values takes."""
    return (count * bits + 7) // 8


def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """Pack non-negative integers ``< 2**bits`` along the last dim: ``(..., n)`` -> ``(..., ceil(n*bits/8))`` uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"pack_bits: bits={bits} must be in [1, 8]")
    *lead, count = values.shape
    v = values.to(torch.int32)
    shifts = torch.arange(bits, device=values.device, dtype=torch.int32)
    stream = ((v.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(*lead, count * bits)
    pad = packed_row_bytes(count, bits) * 8 - count * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    stream = stream.reshape(*lead, -1, 8)
    return (stream * _bit_weights(values.device)).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``(..., nbytes)`` uint8 -> ``(..., count)`` int64."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits: expected uint8, got {packed.dtype}")
    *lead, nbytes = packed.shape
    if nbytes != packed_row_bytes(count, bits):
        raise ValueError(
            f"unpack_bits: {nbytes} bytes per row cannot hold exactly {count} values of {bits} bits "
            f"(expected {packed_row_bytes(count, bits)})"
        )
    stream = (packed.unsqueeze(-1) & _bit_weights(packed.device)).ne(0).reshape(*lead, nbytes * 8)
    stream = stream[..., : count * bits].reshape(*lead, count, bits).to(torch.int64)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (stream << shifts).sum(dim=-1)
