"""``hf_sparse::pack``: dense weight + mask -> kernel layout, fused with the cast to bf16/fp16.

On CUDA it is one kernel that reads the weight and the mask once; the CPU implementation is the pure-torch
reference in :mod:`._layout`. :func:`pack_from_logical` builds the same layout from the on-disk logical form
(kept values, block columns, selectors).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._layout import (
    PackedWeight,
    check_pattern,
    logical_from_dense,
    packed_from_logical,
)

__all__ = ["pack", "pack_from_logical"]

_DTYPES = (torch.bfloat16, torch.float16)


@torch.library.custom_op("hf_sparse::pack", mutates_args=())
def _pack_op(
    weight: Tensor, mask: Tensor, v: int, m: int, dtype: torch.dtype, validate: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if weight.is_cuda:
        from ._build import load_extension

        out = load_extension().pack(weight.contiguous(), mask.contiguous(), v, m, dtype == torch.bfloat16)
        if validate and int(out[4].item()) != 0:
            raise ValueError(
                f"hf_sparse.pack: the mask is not {v}:2:{m} (a block uses more than 4 columns or a row "
                "keeps more than 2 per group); recompute it with hf_sparse.masks"
            )
        return out[0], out[1], out[2], out[3]
    values, columns, selectors, valid = logical_from_dense(weight, mask, v, m)
    p = packed_from_logical(values, columns, selectors, v, m, dtype, valid)
    return p.values, p.meta, p.columns, p.valid


@_pack_op.register_fake
def _(weight, mask, v, m, dtype, validate):
    rows, cols = weight.shape
    steps = -(-(cols // m) // 8)
    rp = -(-rows // 64) * 64
    return (
        weight.new_empty((rp // 16, steps, 32, 8), dtype=dtype),
        weight.new_empty((rp // 16, steps, 16), dtype=torch.int32),
        weight.new_empty((rp // 64, steps * 8, 4), dtype=torch.uint8),
        weight.new_empty((rows, 2 * (cols // m)), dtype=torch.bool),
    )


def pack(
    weight: Tensor, mask: Tensor, v: int, m: int, dtype: torch.dtype = torch.bfloat16, *, validate: bool = True
) -> PackedWeight:
    """Pack ``weight`` (R, K; fp32/bf16/fp16, already masked or not: pruned entries are dropped) under ``mask``.

    ``v``/``m``: the V:2:M pattern (``m=4`` is plain 2:4; ``v`` is then ignored). ``dtype``: the compute dtype
    of the kernels. ``validate=False`` skips the host sync that checks the mask on CUDA (use it in hot loops
    once the mask is known to be valid). Rows with fewer than 2 kept per group and blocks using fewer than 4
    columns are padded with unused offsets and value 0.
    """
    if weight.dim() != 2:
        raise ValueError(f"hf_sparse.pack: weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}")
    if dtype not in _DTYPES:
        raise ValueError(f"hf_sparse.pack: dtype={dtype} unsupported; use torch.bfloat16 or torch.float16")
    check_pattern("pack", weight.shape[0], weight.shape[1], v, m)
    v = 64 if m == 4 else v
    values, meta, columns, valid = _pack_op(weight.detach(), mask.to(torch.bool), v, m, dtype, validate)
    return PackedWeight(values, meta, columns, valid, weight.shape[0], weight.shape[1], v, m)


def pack_from_logical(
    values: Tensor, columns: Tensor, selectors: Tensor, v: int, m: int, dtype: torch.dtype | None = None
) -> PackedWeight:
    """Kernel layout from the on-disk logical form (values (R, 2G), columns (R/V, G, 4), selectors (R, G, 2)).

    For ``m=4`` ``columns`` is ignored (may be None). Every slot counts as kept; zeros in ``values`` stay zeros.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"hf_sparse.pack_from_logical: dtype={dtype} unsupported; use bfloat16 or float16")
    v = 64 if m == 4 else v
    return packed_from_logical(values, columns, selectors, v, m, dtype)
