"""``hf_sparse::sddmm``: the weight gradient ``dY^T X`` computed only at the kept positions of a packed weight.

Returns fp32 values in logical order ``(R, 2G)`` (slot ``2g + j`` of row ``r`` is the j-th kept column of group
``g``); :func:`scatter_dense` turns them into a dense (R, K) gradient for the master weight, zero elsewhere.

CUDA: the ``mma.sync`` kernel (``csrc/sddmm.cu``, sm_80+), or on a cc 9.0 GPU with an sm_90a build the dense-``wgmma``
kernel over each slab's condensed columns (``csrc/sddmm_sm90.cu``). Which one runs:
:func:`hf_sparse.ops._select.choose_kernel` (wgmma where it can run, at the group sizes of :data:`AUTO_WGMMA_M`);
:func:`hf_sparse.ops.force_kernel` forces either. A compact layer measures it against a dense GEMM then a gather for
its weight gradient (:mod:`hf_sparse.nn.compact`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._layout import PackedWeight, kept_columns
from ._select import SDDMM_WGMMA_M, device_kernel, kernel_function

__all__ = ["AUTO_WGMMA_M", "scatter_dense", "sddmm", "sddmm_function", "sddmm_kernel", "sddmm_reference"]

#: group sizes M at which the wgmma kernel runs where it can (measured faster than mma.sync: see _select)
AUTO_WGMMA_M = SDDMM_WGMMA_M


def sddmm_reference(dy: Tensor, x: Tensor, p: PackedWeight) -> Tensor:
    """fp32 ``(dy^T x)`` gathered at the kept columns: the spec the kernel is held to."""
    full = dy.reshape(-1, p.rows).to(torch.float32).t() @ x.reshape(-1, p.cols).to(torch.float32)
    return torch.gather(full, 1, kept_columns(p))


def sddmm_kernel(m: int, device: torch.device | None = None) -> str:
    """The CUDA kernel a pattern with group size ``m`` runs on, on ``device``: ``"wgmma"`` or ``"mma"`` (what
    :func:`hf_sparse.ops.force_kernel` forces now, else the automatic choice; that one builds the extension on first
    call to ask whether the sm_90a kernels are in it)."""
    return device_kernel("sddmm", m, device)


def sddmm_function(m: int, device: torch.device):
    """The extension function :func:`sddmm_kernel` picks for group size ``m`` on ``device``, called as
    ``fn(dy2, x2, meta, columns, rows, cols, m)`` with ``dy2`` / ``x2`` 2-D, contiguous, 16-byte aligned, one dtype
    (bf16/fp16), ``rows % 8 == cols % 8 == 0``; returns the fp32 ``(R, 2G)`` values."""
    return kernel_function("sddmm", m, device)


@torch.library.custom_op("hf_sparse::sddmm", mutates_args=())
def _sddmm_op(
    dy: Tensor,
    x: Tensor,
    values: Tensor,
    meta: Tensor,
    columns: Tensor,
    valid: Tensor,
    rows: int,
    cols: int,
    v: int,
    m: int,
) -> Tensor:
    p = PackedWeight(values, meta, columns, valid, rows, cols, v, m)
    if x.is_cuda and cols % 8 == 0 and rows % 8 == 0 and x.data_ptr() % 16 == 0 and dy.data_ptr() % 16 == 0:
        return sddmm_function(m, x.device)(dy, x, meta, columns, rows, cols, m)
    return sddmm_reference(dy, x, p)


@_sddmm_op.register_fake
def _(dy, x, values, meta, columns, valid, rows, cols, v, m):
    return dy.new_empty((rows, 2 * (cols // m)), dtype=torch.float32)


def sddmm(dy: Tensor, x: Tensor, packed: PackedWeight) -> Tensor:
    """``dy`` (..., R) and ``x`` (..., K), same dtype (bf16/fp16) -> fp32 (R, 2G) at the kept slots."""
    if dy.shape[-1] != packed.rows or x.shape[-1] != packed.cols:
        raise ValueError(
            f"hf_sparse.sddmm: dy (..., {dy.shape[-1]}) and x (..., {x.shape[-1]}) do not match the weight "
            f"({packed.rows}, {packed.cols})"
        )
    if dy.dtype != x.dtype:
        raise ValueError(f"hf_sparse.sddmm: dy is {dy.dtype} but x is {x.dtype}; cast one of them")
    dy2 = dy.reshape(-1, packed.rows).contiguous()
    x2 = x.reshape(-1, packed.cols).contiguous()
    if dy2.shape[0] != x2.shape[0]:
        raise ValueError(f"hf_sparse.sddmm: dy has {dy2.shape[0]} tokens but x has {x2.shape[0]}")
    return _sddmm_op(
        dy2, x2, packed.values, packed.meta, packed.columns, packed.valid, packed.rows, packed.cols, packed.v, packed.m
    )


def scatter_dense(grad_values: Tensor, packed: PackedWeight, dtype: torch.dtype | None = None) -> Tensor:
    """Dense (R, K) tensor with ``grad_values`` at the kept positions and +0.0 everywhere else (padding dropped)."""
    out = torch.zeros(packed.rows, packed.cols, dtype=dtype or grad_values.dtype, device=grad_values.device)
    vals = torch.where(packed.valid, grad_values, torch.zeros((), dtype=grad_values.dtype, device=grad_values.device))
    return out.scatter_(1, kept_columns(packed), vals.to(out.dtype))
