"""Kernel layout of a V:2:M weight: conversions between dense, logical and `mma.sp`-ready forms, in plain torch.

The logical form (what checkpoints store) is ``values (R, 2G)``, ``columns (R/V, G, 4)`` and ``selectors
(R, G, 2)`` with ``G = K/M`` groups per row. The CUDA kernels want the same information reordered so that one
warp reads the operands of one ``mma.sp.m16n8k32`` with a single coalesced 16-byte load per thread:

* ``values``  ``(Rp/16, S, 32, 8)``: for row tile ``mt`` (16 rows) and k-step ``s`` (8 groups = 32 condensed
  columns), lane ``4g + t`` holds the A fragment: register 0 = row ``g``, group ``8s+t``; register 1 = row
  ``g+8``, group ``8s+t``; register 2 = row ``g``, group ``8s+4+t``; register 3 = row ``g+8``, group ``8s+4+t``
  (PTX ISA "sparse mma.m16n8k32 for .f16/.bf16": two kept values of one 4-wide chunk per register).
* ``meta``    ``(Rp/16, S, 16)`` int32: entry ``2g + c`` is the metadata register of lanes ``4g + c`` (sparsity
  selector 0): bits 0-15 describe row ``g``, bits 16-31 row ``g+8``, each over groups ``8s+4c .. 8s+4c+3``,
  one nibble per group (low 2 bits: first kept position, high 2 bits: second; increasing, as
  ``mma.sp::ordered_metadata`` requires).
* ``columns`` ``(Rp/64, Gp, 4)`` uint8: the block's 4 column offsets, one row per 64-row slab (a kernel warp
  covers 64 rows, so V=128 blocks are simply repeated).
* ``valid``   ``(R, 2G)`` bool: False where the logical slot is padding (a row that kept fewer than 2 in a
  group); the weight gradient is never scattered there.

``Rp`` pads R to 64 rows, ``S = ceil(G/8)`` and ``Gp = 8S`` pad the groups; padding has value 0 and offsets
0..3, and the kernels zero-fill X beyond K, so padding contributes exactly 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "PackedWeight",
    "dense_from_packed",
    "kept_columns",
    "logical_from_dense",
    "logical_from_packed",
    "packed_from_logical",
    "values_to_kernel",
]

SLAB = 64  # rows per kernel warp tile; V must be a multiple of it (V in {64, 128})
GROUPS_PER_STEP = 8  # one mma.sp.m16n8k32 consumes 8 groups of 4 condensed columns
VALID_V = (64, 128)
VALID_M = (4, 8, 16, 32, 64, 128)


class PackedWeight(NamedTuple):
    """A V:2:M weight in the kernels' layout (see the module docstring); rebuilt from the master after each step."""

    values: Tensor
    meta: Tensor
    columns: Tensor
    valid: Tensor
    rows: int
    cols: int
    v: int
    m: int

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def groups(self) -> int:
        return self.cols // self.m


def check_pattern(op: str, rows: int, cols: int, v: int, m: int) -> None:
    """Raise a ValueError naming ``op`` if (rows, cols) cannot hold a V:2:M pattern."""
    if m not in VALID_M:
        raise ValueError(f"hf_sparse.{op}: m={m} is not supported; use one of {VALID_M}")
    if m != 4 and v not in VALID_V:
        raise ValueError(f"hf_sparse.{op}: v={v} is not supported; use one of {VALID_V} (v is ignored for m=4)")
    if cols % m:
        raise ValueError(f"hf_sparse.{op}: in_features={cols} is not a multiple of m={m}; pad the weight")
    if m != 4 and rows % v:
        raise ValueError(f"hf_sparse.{op}: out_features={rows} is not a multiple of v={v}; pad the weight")


def _first_k_true(flags: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Indices (increasing) of the first ``k`` True entries along the last dim, padded with the first False ones.

    Returns ``(index, count)`` where ``count`` is the number of True entries (callers check it against ``k``).
    """
    size = flags.shape[-1]
    key = (~flags).to(torch.int32) * size + torch.arange(size, device=flags.device, dtype=torch.int32)
    index = torch.sort(torch.topk(key, k, dim=-1, largest=False).indices, dim=-1).values
    return index, flags.sum(-1)


def logical_from_dense(weight: Tensor, mask: Tensor, v: int, m: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logical (values, columns, selectors, valid) of a dense masked weight; raises if the mask breaks V:2:M."""
    rows, cols = weight.shape
    check_pattern("pack", rows, cols, v, m)
    if mask.shape != weight.shape:
        raise ValueError(f"hf_sparse.pack: mask shape {tuple(mask.shape)} != weight shape {tuple(weight.shape)}")
    mask = mask.to(torch.bool)
    g = cols // m
    vb = rows if m == 4 else v  # plain 2:4: every block keeps all 4 columns, V is irrelevant
    blocks = rows // vb
    m4 = mask.reshape(blocks, vb, g, m)
    if m == 4:
        columns = torch.arange(4, device=weight.device, dtype=torch.int64).expand(blocks, g, 4)
    else:
        used = m4.any(dim=1)  # (blocks, g, m)
        columns, ncols = _first_k_true(used, 4)
        if bool((ncols > 4).any()):
            raise ValueError(f"hf_sparse.pack: a {v}x{m} block of the mask uses more than 4 columns; not {v}:2:{m}")
    idx = columns.unsqueeze(1).expand(blocks, vb, g, 4)
    kept4 = torch.gather(m4, 3, idx)  # (blocks, vb, g, 4)
    selectors, nkept = _first_k_true(kept4, 2)
    if bool((nkept > 2).any()):
        raise ValueError(f"hf_sparse.pack: a row keeps more than 2 of a group of {m}; the mask is not V:2:{m}")
    real = torch.gather(idx, 3, selectors)  # (blocks, vb, g, 2) offsets within the group
    valid = torch.gather(kept4, 3, selectors).reshape(rows, 2 * g)
    w = torch.gather(weight.reshape(blocks, vb, g, m), 3, real).reshape(rows, 2 * g)
    values = torch.where(valid, w, torch.zeros((), dtype=w.dtype, device=w.device))  # +0.0 in padding
    out_columns = columns.to(torch.uint8)
    if m == 4:
        out_columns = out_columns[:1]
    return values, out_columns, selectors.reshape(rows, g, 2).to(torch.uint8), valid


def values_to_kernel(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Logical kept values ``(R, 2G)`` -> the fragment-ordered ``(Rp/16, S, 32, 8)`` tensor, zero-padded."""
    rows, two_g = values.shape
    g = two_g // 2
    steps = -(-g // GROUPS_PER_STEP)
    rp = -(-rows // SLAB) * SLAB
    vals = torch.zeros(rp, steps * GROUPS_PER_STEP, 2, dtype=dtype, device=values.device)
    vals[:rows, :g] = values.reshape(rows, g, 2).to(dtype)
    # (mt, rh, g8, s, ch, t, 2) -> (mt, s, g8, t, ch, rh, 2)
    vk = vals.reshape(rp // 16, 2, 8, steps, 2, 4, 2).permute(0, 3, 2, 5, 4, 1, 6)
    return vk.reshape(rp // 16, steps, 32, 8).contiguous()


def packed_from_logical(
    values: Tensor,
    columns: Tensor,
    selectors: Tensor,
    v: int,
    m: int,
    dtype: torch.dtype | None = None,
    valid: Tensor | None = None,
) -> PackedWeight:
    """Reorder the logical form into the kernel layout (pure torch, any device)."""
    rows, two_g = values.shape
    g = two_g // 2
    cols = g * m
    check_pattern("pack_from_logical", rows, cols, v, m)
    dtype = dtype or values.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hf_sparse.pack_from_logical: dtype={dtype} unsupported; use bfloat16 or float16")
    dev = values.device
    if tuple(selectors.shape) != (rows, g, 2):
        raise ValueError(f"hf_sparse.pack_from_logical: selectors shape {tuple(selectors.shape)} != {(rows, g, 2)}")
    sel = selectors.to(torch.int64)
    if bool((sel[..., 0] >= sel[..., 1]).any()) or bool((sel > 3).any()):
        raise ValueError("hf_sparse.pack_from_logical: selectors must be two increasing positions in 0..3")
    if valid is None:
        valid = torch.ones(rows, 2 * g, dtype=torch.bool, device=dev)
    steps = -(-g // GROUPS_PER_STEP)
    gp = steps * GROUPS_PER_STEP
    rp = -(-rows // SLAB) * SLAB
    values_k = values_to_kernel(values, dtype)
    selp = torch.tensor([0, 1], dtype=torch.int64, device=dev).repeat(rp, gp, 1)
    selp[:rows, :g] = sel
    nib = selp[..., 0] | (selp[..., 1] << 2)  # (rp, gp)
    nib = nib.reshape(rp // 16, 2, 8, steps, 2, 4)  # (mt, rh, g8, s, c, j)
    shifts = torch.arange(4, device=dev, dtype=torch.int64) * 4
    half = (nib << shifts).sum(-1)  # (mt, rh, g8, s, c) 16-bit
    reg = half[:, 0] | (half[:, 1] << 16)  # (mt, g8, s, c)
    reg = torch.where(reg >= 2**31, reg - 2**32, reg)
    meta_k = reg.permute(0, 2, 1, 3).reshape(rp // 16, steps, 16).to(torch.int32).contiguous()
    if m == 4:
        cols_k = torch.arange(4, dtype=torch.uint8, device=dev).repeat(rp // SLAB, gp, 1)
    else:
        if tuple(columns.shape) != (rows // v, g, 4):
            raise ValueError(
                f"hf_sparse.pack_from_logical: columns shape {tuple(columns.shape)} != {(rows // v, g, 4)}"
            )
        c = columns.to(torch.int64)
        if bool((c[..., 1:] <= c[..., :-1]).any()) or bool((c >= m).any()):
            raise ValueError(f"hf_sparse.pack_from_logical: columns must be 4 increasing offsets in 0..{m - 1}")
        per_slab = c.repeat_interleave(v // SLAB, dim=0)  # (rows/64, g, 4)
        cols_k = torch.arange(4, dtype=torch.int64, device=dev).repeat(rp // SLAB, gp, 1)
        cols_k[: per_slab.shape[0], :g] = per_slab
        cols_k = cols_k.to(torch.uint8).contiguous()
    return PackedWeight(values_k, meta_k, cols_k, valid.to(torch.bool).contiguous(), rows, cols, v, m)


def _decode(p: PackedWeight) -> tuple[Tensor, Tensor]:
    """(values (R, G, 2), selectors (R, G, 2) int64: the kept positions within the block's 4 columns) of ``p``."""
    rp16, steps = p.values.shape[:2]
    rp, gp = rp16 * 16, steps * GROUPS_PER_STEP
    vals = p.values.reshape(rp16, steps, 8, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 3, 6).reshape(rp, gp, 2)
    reg = p.meta.to(torch.int64) & 0xFFFFFFFF
    reg = reg.reshape(rp16, steps, 8, 2).permute(0, 2, 1, 3)  # (mt, g8, s, c)
    half = torch.stack([reg & 0xFFFF, reg >> 16], dim=1)  # (mt, rh, g8, s, c)
    shifts = torch.arange(4, device=reg.device, dtype=torch.int64) * 4
    nib = (half.unsqueeze(-1) >> shifts) & 0xF  # (mt, rh, g8, s, c, j)
    nib = nib.reshape(rp, gp)
    sel = torch.stack([nib & 3, nib >> 2], dim=-1)  # (rp, gp, 2)
    g = p.groups
    return vals[: p.rows, :g], sel[: p.rows, :g]


def _logical_positions(p: PackedWeight) -> tuple[Tensor, Tensor]:
    """(values (R, G, 2), real column offsets within the group (R, G, 2)) recovered from the kernel layout."""
    vals, sel = _decode(p)
    cols = p.columns.to(torch.int64).repeat_interleave(SLAB, dim=0)[: p.rows, : p.groups]  # (R, G, 4)
    return vals, torch.gather(cols, 2, sel)


def logical_from_packed(p: PackedWeight) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`packed_from_logical`: ``(values (R, 2G), columns (ceil(R/64), G, 4) uint8, one row per
    64-row slab, selectors (R, G, 2) uint8)``. ``values`` is a new tensor in the pack's dtype."""
    vals, sel = _decode(p)
    columns = p.columns[: -(-p.rows // SLAB), : p.groups]
    return vals.reshape(p.rows, -1).contiguous(), columns.contiguous(), sel.to(torch.uint8)


def kept_columns(p: PackedWeight) -> Tensor:
    """Real column index (int64, ``(R, 2G)``) of every logical value slot of ``p``."""
    _, off = _logical_positions(p)
    base = torch.arange(p.groups, device=off.device, dtype=torch.int64).view(1, -1, 1) * p.m
    return (off + base).reshape(p.rows, -1)


def dense_from_packed(p: PackedWeight, dtype: torch.dtype | None = None) -> Tensor:
    """The dense (R, K) weight that ``p`` encodes (zeros at pruned positions); the reference for every kernel."""
    vals, _ = _logical_positions(p)
    out = torch.zeros(p.rows, p.cols, dtype=dtype or p.dtype, device=p.values.device)
    vals = torch.where(p.valid, vals.reshape(p.rows, -1), torch.zeros((), dtype=vals.dtype, device=vals.device))
    out.scatter_(1, kept_columns(p), vals.to(out.dtype))
    return out
