"""``hf_sparse::pack``: dense masked master weight + mask -> kernel layout, fused with the cast to bf16/fp16.

Runs after every optimizer step (the packed weight is a shadow of the master), so on CUDA it is one kernel that
reads the weight and the mask once. The CPU implementation is the pure-torch reference in :mod:`._layout`.

``hf_sparse::pack_values`` (:func:`repack`) is the per-step form once the mask is fixed: it rebuilds only the values
from the master, reusing the metadata, block columns and slot validity of an earlier :func:`pack`. It reads the two
weights each kept slot needs and nothing else (no mask, no column search), which is what keeps the repack after
every optimizer step cheap. :func:`repack_many` does the repacks of many layers at once (one kernel launch per weight
dtype and 40 weights on CUDA), for the kernel path, which repacks every layer after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._layout import (
    PackedWeight,
    check_pattern,
    kept_columns,
    logical_from_dense,
    packed_from_logical,
    values_to_kernel,
)

__all__ = ["pack", "pack_from_logical", "repack", "repack_many"]

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


@torch.library.custom_op("hf_sparse::pack_values", mutates_args=())
def _pack_values_op(
    weight: Tensor,
    meta: Tensor,
    columns: Tensor,
    valid: Tensor,
    all_valid: bool,
    rows: int,
    cols: int,
    v: int,
    m: int,
    dtype: torch.dtype,
) -> Tensor:
    if weight.is_cuda:
        from ._build import load_extension

        return load_extension().pack_values(
            weight, meta, columns, None if all_valid else valid, rows, cols, m, dtype == torch.bfloat16
        )
    shell = meta.new_empty((meta.shape[0], meta.shape[1], 32, 8), dtype=dtype)  # positions come from meta
    p = PackedWeight(shell, meta, columns, valid, rows, cols, v, m)
    kept = torch.gather(weight, 1, kept_columns(p))
    kept = torch.where(valid, kept, torch.zeros((), dtype=kept.dtype, device=kept.device)) + 0.0
    return values_to_kernel(kept, dtype)


@_pack_values_op.register_fake
def _(weight, meta, columns, valid, all_valid, rows, cols, v, m, dtype):
    return weight.new_empty((meta.shape[0], meta.shape[1], 32, 8), dtype=dtype)


def repack(weight: Tensor, packed: PackedWeight, *, all_valid: bool = False) -> PackedWeight:
    """``packed`` with its values rebuilt from ``weight`` (R, K): the cheap repack after an optimizer step.

    The mask must be the one ``packed`` was built from (its metadata, columns and ``valid`` are reused as they
    are). ``weight`` may have any strides (``w.t()`` of a transposable 2:4 layer is read in place) and any of
    fp32/bf16/fp16; the values come out in ``packed.dtype``. ``all_valid=True`` (every slot kept, as for masks
    from :mod:`hf_sparse.masks`) skips reading ``packed.valid`` on CUDA.
    """
    if tuple(weight.shape) != (packed.rows, packed.cols):
        raise ValueError(
            f"hf_sparse.repack: weight shape {tuple(weight.shape)} != packed shape {(packed.rows, packed.cols)}"
        )
    weight = weight.detach()
    if weight.is_cuda and not torch.compiler.is_compiling():
        # hot path (every optimizer step, every layer): straight to the kernel, without the custom op's Python
        # dispatch; the op below is the same call, kept for torch.compile and opcheck
        from ._build import load_extension

        values = load_extension().pack_values(
            weight,
            packed.meta,
            packed.columns,
            None if all_valid else packed.valid,
            packed.rows,
            packed.cols,
            packed.m,
            packed.dtype == torch.bfloat16,
        )
        return packed._replace(values=values)
    values = _pack_values_op(
        weight,
        packed.meta,
        packed.columns,
        packed.valid,
        all_valid,
        packed.rows,
        packed.cols,
        packed.v,
        packed.m,
        packed.dtype,
    )
    return packed._replace(values=values)


def repack_many(
    weights: Sequence[Tensor], packed: Sequence[PackedWeight], *, all_valid: Sequence[bool] | None = None
) -> list[PackedWeight]:
    """``[repack(w, p) for w, p in zip(weights, packed, strict=True)]``, in one kernel launch per weight dtype on CUDA.

    Each repack costs one launch and ~15-30 us of host time (argument checks, allocation, the launch itself; measured on
    the H200 machine's host): the kernel path repacks two weights per transposable layer after every optimizer step,
    288 per BERT-large step, so doing them together is what keeps the host from becoming the limit. Same rules as
    :func:`repack` per pair (any strides, fp32/bf16/fp16 masters). The packed weights must share one compute dtype and,
    on CUDA, one device.
    """
    if len(weights) != len(packed):
        raise ValueError(f"hf_sparse.repack_many: {len(weights)} weights but {len(packed)} packed weights")
    flags = [False] * len(packed) if all_valid is None else list(all_valid)
    if len(flags) != len(packed):
        raise ValueError(f"hf_sparse.repack_many: all_valid has {len(flags)} entries, expected {len(packed)}")
    if not packed:
        return []
    dtype = packed[0].dtype
    for w, p in zip(weights, packed, strict=True):
        if tuple(w.shape) != (p.rows, p.cols):
            raise ValueError(
                f"hf_sparse.repack_many: weight shape {tuple(w.shape)} != packed shape {(p.rows, p.cols)}"
            )
        if p.dtype != dtype:
            raise ValueError(f"hf_sparse.repack_many: packed dtypes differ ({dtype} and {p.dtype}); group them")
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"hf_sparse.repack_many: weight is {w.dtype}; use float32, bfloat16 or float16")
    on_cuda = [w.is_cuda for w in weights]
    if all(on_cuda) and not torch.compiler.is_compiling():
        device = weights[0].device
        if any(w.device != device or p.values.device != device for w, p in zip(weights, packed, strict=True)):
            raise ValueError("hf_sparse.repack_many: every weight and packed weight must be on one CUDA device")
        from ._build import load_extension

        values = load_extension().pack_values_batch(
            [w.detach() for w in weights],
            [p.meta for p in packed],
            [p.columns for p in packed],
            [None if ok else p.valid for p, ok in zip(packed, flags, strict=True)],
            [p.rows for p in packed],
            [p.cols for p in packed],
            [p.m for p in packed],
            dtype == torch.bfloat16,
        )
        return [p._replace(values=v) for p, v in zip(packed, values, strict=True)]
    return [repack(w, p, all_valid=ok) for w, p, ok in zip(weights, packed, flags, strict=True)]
