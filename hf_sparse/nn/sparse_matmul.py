"""``sparse_linear``: the autograd function behind ``SparseLinear`` (forward SpMM, weight gradient SDDMM).

* forward  ``Y = X W^T + b`` by SpMM on ``packed`` (the compressed shadow of the master ``weight``);
* input gradient ``dX = dY W`` by a dense GEMM on the master weight (cast to dY's dtype), or, when the mask is
  transposable 2:4 and ``packed_t`` (the pack of ``W^T``) is given, through the same dispatcher as the forward
  (SpMM on ``W^T``, cuSPARSELt or dense, whichever is fastest);
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
from ..ops.dispatch import linear_forward, run_forward, weight_grad

__all__ = ["sparse_linear", "sparse_linear_unchecked"]


def _product(
    x: Tensor,
    weight: Tensor,
    packed: PackedWeight,
    bias: Tensor | None,
    weight_lp: Tensor | None,
    bias_lp: Tensor | None,
    static: bool,
    plan: tuple[str | None, str | None, str | None] | None,
) -> tuple[Tensor, Tensor]:
    """``(w, x @ w^T + b)``: ``w`` is what the dense choices read (``weight_lp`` where given), the product runs on the
    plan's measured forward choice where there is one, else through the dispatcher's lookup."""
    w = weight_lp if weight_lp is not None else weight
    b = bias_lp if bias_lp is not None else bias
    return w, _linear(None if plan is None else plan[0], x, w, packed, b, static)


def _linear(choice: str | None, x: Tensor, w: Tensor, packed: PackedWeight, b: Tensor | None, static: bool) -> Tensor:
    """``x @ w^T + b`` on the measured ``choice`` where the caller keeps one, else through the dispatcher's lookup."""
    if choice is not None:
        return run_forward(choice, x, w, packed, b)
    return linear_forward(x, w, packed, b, static_weight=static)


class _SparseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        packed: PackedWeight,
        bias: Tensor | None,
        packed_t: PackedWeight | None,
        weight_lp: Tensor | None,
        bias_lp: Tensor | None,
        static: bool,
        plan: tuple[str | None, str | None, str | None] | None,
    ) -> Tensor:
        xc = x if x.dtype == packed.dtype else x.to(packed.dtype)  # no-op .to calls cost host time too
        # 2-D inside (tokens x features): every op below takes it as it is, so no op reshapes it again
        x2 = xc if xc.dim() == 2 else xc.reshape(-1, packed.cols)
        w, y = _product(x2, weight, packed, bias, weight_lp, bias_lp, static, plan)
        ctx.plan = plan
        ctx.packed = packed
        ctx.packed_t = packed_t
        ctx.static = static
        ctx.x_dtype = x.dtype
        ctx.x_shape = x.shape
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x2, w)
        return y if xc.dim() == 2 else y.reshape(*x.shape[:-1], packed.rows)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, w = ctx.saved_tensors
        packed: PackedWeight = ctx.packed
        dx = dw = db = None
        if dy.dtype != packed.dtype:
            dy = dy.to(packed.dtype)
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, packed.rows)
        plan = ctx.plan
        if ctx.needs_input_grad[0]:
            if ctx.packed_t is not None:
                dx = _linear(None if plan is None else plan[1], dy2, w.t(), ctx.packed_t, None, ctx.static)
            else:
                dx = dy2 @ (w if w.dtype == dy2.dtype else w.to(dy2.dtype))
            if dx.dtype != ctx.x_dtype:
                dx = dx.to(ctx.x_dtype)
            if len(ctx.x_shape) != 2:
                dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy2, x2, packed, ctx.w_dtype, None if plan is None else plan[2])
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy2.sum(0, dtype=torch.float32)
            if db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        return dx, dw, None, db, None, None, None, None, None


def sparse_linear(
    x: Tensor,
    weight: Tensor,
    packed: PackedWeight,
    bias: Tensor | None = None,
    packed_t: PackedWeight | None = None,
    weight_lp: Tensor | None = None,
    bias_lp: Tensor | None = None,
) -> Tensor:
    """``F.linear(x, weight * mask, bias)`` computed on Sparse Tensor Cores.

    ``weight``: the dense masked master Parameter (R, K) the optimizer owns; ``packed``: ``hf_sparse.ops.pack``
    of it (rebuild after every optimizer step); ``x``: (..., K). Returns (..., R) in ``packed.dtype``.
    ``packed_t``: optional ``pack(weight.t(), mask.t(), 64, 4)`` when the mask is transposable 2:4, so the input
    gradient can run sparse too. ``weight_lp``: optional copy of ``weight`` already cast to ``packed.dtype``
    (made once per optimizer step with the pack): the dense choices of the dispatcher and the dense input
    gradient use it instead of casting the master on every call. ``bias_lp``: likewise, ``bias`` already cast to
    ``packed.dtype`` (the gradient still goes to ``bias``).
    """
    if weight.shape != (packed.rows, packed.cols):
        raise ValueError(
            f"hf_sparse.sparse_linear: weight shape {tuple(weight.shape)} != packed shape {(packed.rows, packed.cols)}"
        )
    if packed_t is not None and (packed_t.rows, packed_t.cols, packed_t.m) != (packed.cols, packed.rows, 4):
        raise ValueError(
            f"hf_sparse.sparse_linear: packed_t must pack weight.t() ({packed.cols}, {packed.rows}) as 2:4, got "
            f"({packed_t.rows}, {packed_t.cols}) with m={packed_t.m}"
        )
    if weight_lp is not None and (weight_lp.shape != weight.shape or weight_lp.dtype != packed.dtype):
        raise ValueError(
            f"hf_sparse.sparse_linear: weight_lp must be weight cast to {packed.dtype} with shape "
            f"{tuple(weight.shape)}, got {weight_lp.dtype} {tuple(weight_lp.shape)}"
        )
    if bias_lp is not None and (bias is None or bias_lp.shape != bias.shape or bias_lp.dtype != packed.dtype):
        raise ValueError(f"hf_sparse.sparse_linear: bias_lp must be bias cast to {packed.dtype}")
    return sparse_linear_unchecked(x, weight, packed, bias, packed_t, weight_lp, bias_lp)


def sparse_linear_unchecked(
    x: Tensor,
    weight: Tensor,
    packed: PackedWeight,
    bias: Tensor | None,
    packed_t: PackedWeight | None,
    weight_lp: Tensor | None,
    bias_lp: Tensor | None,
    plan: tuple[str | None, str | None, str | None] | None = None,
) -> Tensor:
    """:func:`sparse_linear` without its argument checks, for a caller that built ``packed``, ``packed_t``,
    ``weight_lp`` and ``bias_lp`` from ``weight`` and ``bias`` itself (the kernel path: the checks cost host time on
    every call). ``plan``: the dispatcher's measured choices for this call shape (forward, input gradient, weight
    gradient; None where unmeasured), used instead of looking them up on every call. Without autograd (inference,
    evaluation) the forward runs directly, without the autograd function."""
    if not torch.is_grad_enabled():
        xc = x if x.dtype == packed.dtype else x.to(packed.dtype)
        return _product(xc, weight, packed, bias, weight_lp, bias_lp, True, plan)[1]
    # a weight that trains changes every optimizer step, and the dispatcher prices in what that costs a backend;
    # decided here because autograd runs Function.forward with grad mode off
    static = not weight.requires_grad
    return _SparseLinearFn.apply(x, weight, packed, bias, packed_t, weight_lp, bias_lp, static, plan)
