"""``sparse_linear``: the autograd function behind ``SparseLinear`` (forward SpMM, weight gradient SDDMM).

* forward  ``Y = X W^T + b`` by SpMM on ``packed`` (the compressed shadow of the master ``weight``);
* input gradient ``dX = dY W`` by a dense GEMM on the master weight (cast to dY's dtype);
* weight gradient by SDDMM at the kept positions only, scattered into a dense (R, K) gradient that is zero at
  pruned positions, in the master weight's dtype, so the optimizer, DDP/FSDP and checkpoints see a plain
  Parameter gradient;
* bias gradient ``sum(dY)``.

On CUDA, forward and weight gradient go through :mod:`hf_sparse.ops.dispatch`, which measures once per shape
whether our kernel, dense cuBLAS on the masked master (or cuSPARSELt for 2:4) is fastest and uses that one.

``x`` is cast to the packed dtype (what autocast would do to a linear's input); ``dX`` is returned in x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import PackedWeight
from ..ops.dispatch import linear_forward, weight_grad

__all__ = ["sparse_linear"]


class _SparseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, packed: PackedWeight, bias: Tensor | None) -> Tensor:
        xc = x.to(packed.dtype)
        y = linear_forward(xc, weight, packed, bias)
        ctx.packed = packed
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(xc, weight)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        xc, weight = ctx.saved_tensors
        packed: PackedWeight = ctx.packed
        dx = dw = db = None
        dy = dy.to(packed.dtype)
        if ctx.needs_input_grad[0]:
            dx = (dy @ weight.to(dy.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy, xc, packed, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, None, db


def sparse_linear(x: Tensor, weight: Tensor, packed: PackedWeight, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight * mask, bias)`` computed on Sparse Tensor Cores.

    ``weight``: the dense masked master Parameter (R, K) the optimizer owns; ``packed``: ``hf_sparse.ops.pack``
    of it (rebuild after every optimizer step); ``x``: (..., K). Returns (..., R) in ``packed.dtype``.
    """
    if weight.shape != (packed.rows, packed.cols):
        raise ValueError(
            f"hf_sparse.sparse_linear: weight shape {tuple(weight.shape)} != packed shape {(packed.rows, packed.cols)}"
        )
    return _SparseLinearFn.apply(x, weight, packed, bias)
