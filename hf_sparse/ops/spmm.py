"""``hf_sparse::spmm``: ``Y = X W^T (+ bias)`` with W packed V:2:M; X and Y exactly as nn.Linear sees them.

CUDA: the ``mma.sp`` kernel (``csrc/spmm.cu``). CPU (and CUDA shapes the kernel cannot take, e.g. ``K % 8 != 0``):
the reference, which decompresses W and multiplies in fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ._layout import PackedWeight, dense_from_packed

__all__ = ["spmm", "spmm_reference"]


def spmm_reference(x: Tensor, p: PackedWeight, bias: Tensor | None = None) -> Tensor:
    """fp32-accumulated ``x @ W^T + bias`` from the packed form, in ``x.dtype`` (the spec the kernel is held to)."""
    w = dense_from_packed(p, torch.float32)
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _kernel_ok(x: Tensor, cols: int) -> bool:
    return cols % 8 == 0 and x.data_ptr() % 16 == 0


@torch.library.custom_op("hf_sparse::spmm", mutates_args=())
def _spmm_op(
    x: Tensor,
    values: Tensor,
    meta: Tensor,
    columns: Tensor,
    valid: Tensor,
    bias: Tensor | None,
    rows: int,
    cols: int,
    v: int,
    m: int,
) -> Tensor:
    p = PackedWeight(values, meta, columns, valid, rows, cols, v, m)
    if x.is_cuda:
        if _kernel_ok(x, cols):
            from ._build import load_extension

            return load_extension().spmm(x, values, meta, columns, bias, rows, cols, m)
        warnings.warn(
            f"hf_sparse.spmm: in_features={cols} is not a multiple of 8 (or x is misaligned); using the slow "
            "reference path. Pad the layer to a multiple of 8 for the kernel.",
            stacklevel=2,
        )
    return spmm_reference(x, p, bias)


@_spmm_op.register_fake
def _(x, values, meta, columns, valid, bias, rows, cols, v, m):
    return x.new_empty((x.shape[0], rows))


def spmm(x: Tensor, packed: PackedWeight, bias: Tensor | None = None) -> Tensor:
    """``x`` (..., K) bf16/fp16 in the packed dtype -> (..., R). No copy of ``x`` when it is contiguous."""
    if x.shape[-1] != packed.cols:
        raise ValueError(f"hf_sparse.spmm: x has {x.shape[-1]} features, the weight expects {packed.cols}")
    if x.dtype != packed.dtype:
        raise ValueError(
            f"hf_sparse.spmm: x is {x.dtype} but the weight was packed as {packed.dtype}; pack with dtype={x.dtype}"
        )
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.cols)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = _spmm_op(
        x2,
        packed.values,
        packed.meta,
        packed.columns,
        packed.valid,
        bias,
        packed.rows,
        packed.cols,
        packed.v,
        packed.m,
    )
    return y.reshape(*lead, packed.rows)
