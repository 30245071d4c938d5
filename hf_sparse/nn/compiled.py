"""A compact layer under torch.compile: one ``hf_sparse::compact_linear`` op in the graph, its backward one
``hf_sparse::compact_backward``.

On CUDA both ops are the extension's C++ functions (registered for the CUDA key in ``csrc/binding.cpp``, the same ones
the eager C++ autograd node runs), so the compiled graph reaches the kernels with no Python between; elsewhere they
run the references below. Their tensor arguments are the layer's kernel state
(:meth:`hf_sparse.nn.compact.CompactKernel.native_arguments`), which torch.compile reads from the kernel on every call
of the compiled code; what is not a tensor (the plan, the sizes) is a constant of the graph, decided while
torch.compile traces by :func:`_compiled_plan`, which runs for real then: it builds the kernel state, refreshes the
packs and measures the plan of the call's token bucket on a stand-in input. A call that trains makes its packs from
the values inside the op, as the eager C++ node does; the pack inference holds follows the values through the refresh
after each optimizer step (:func:`hf_sparse.nn.compact.refresh_all`) and through any eager call; a weight written by
hand while only compiled inference code runs is seen at the next optimizer step (``load_state_dict`` drops the kernel
state, and torch.compile traces the layer again). The bias gradient is computed in the graph, where Inductor fuses its
reduction into the kernel that produces the output gradient.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..ops.spmm import activate
from .compact import dense_at_index
from .refresh import kept_index_of

if TYPE_CHECKING:
    from .compact import SparseLinear

__all__ = ["compact_linear", "register_compact_layer"]

_compact_layers: weakref.WeakValueDictionary[int, SparseLinear] = weakref.WeakValueDictionary()


def register_compact_layer(layer: SparseLinear) -> int:
    """Give ``layer`` the id :func:`_compiled_plan` finds it by."""
    layer_id = id(layer)
    _compact_layers[layer_id] = layer
    return layer_id


def _layer_of(layer_id: int) -> SparseLinear:
    layer = _compact_layers.get(layer_id)
    if layer is None:
        raise RuntimeError(
            f"hf_sparse: compact layer {layer_id} of a compiled graph no longer exists; compile the model again"
        )
    return layer


@torch._dynamo.assume_constant_result
def _compiled_plan(layer_id: int, tokens: int, trains: bool, dtype: torch.dtype) -> tuple[str, str, str]:
    """The plan of a compiled call of ``tokens`` tokens (a power of two: the token bucket): run for real while
    torch.compile traces (its result is a constant of the graph), it builds the layer's kernel state, brings its packs
    up to date and measures the plan on a stand-in input of that size (drawn from a private generator: the run's
    random stream stays as it is), as an eager first call would."""
    layer = _layer_of(layer_id)
    kernel = layer.kernel_state(dtype)
    generator = torch.Generator(kernel.device).manual_seed(0)
    x2 = torch.empty(tokens, kernel.cols, dtype=dtype, device=kernel.device).normal_(generator=generator)
    return kernel.prepare(layer, x2, trains, while_tracing=True)


_lib = torch.library.Library("hf_sparse", "FRAGMENT")
_lib.define(
    "compact_linear(Tensor x2, Tensor weight, Tensor? bias, Tensor? bias_c, Tensor values, Tensor meta, "
    "Tensor columns, Tensor? values_t, Tensor? meta_t, Tensor? columns_t, Tensor meta_g, Tensor columns_g, "
    "Tensor? sel, Tensor? sel_columns, int rows, int cols, int m, int v_g, int m_g, int plan, int kernels) -> Tensor"
)
_lib.define(
    "compact_backward(Tensor dy2, Tensor x2, Tensor weight, Tensor? bias, Tensor? sel, Tensor? sel_columns, "
    "Tensor? values_t, Tensor? meta_t, Tensor? columns_t, Tensor meta_g, Tensor columns_g, int rows, int cols, "
    "int v_g, int m_g, int plan, int kernels, bool need_dx, bool need_dw) -> (Tensor, Tensor, Tensor)"
)


def _compact_linear_reference(x2, weight, bias, bias_c, values, meta, columns, values_t, meta_t, columns_t, meta_g,
                              columns_g, sel, sel_columns, rows, cols, m, v_g, m_g, plan, kernels):  # fmt: skip
    """``x2 W^T + bias_c`` from the kept values at their positions in the compute dtype, accumulated in fp32 (the
    ops' references' rule)."""
    index = kept_index_of(sel, sel_columns, rows, cols, v_g, m_g).view(-1)
    w = dense_at_index(weight, index, rows, cols, x2.dtype).float()
    y = x2.float() @ w.t()
    return (y if bias_c is None else y + bias_c.float()).to(x2.dtype)


def _compact_backward_reference(dy2, x2, weight, bias, sel, sel_columns, values_t, meta_t, columns_t, meta_g,
                                columns_g, rows, cols, v_g, m_g, plan, kernels, need_dx, need_dw):  # fmt: skip
    """The gradients from the kept values at their positions; those not asked for are empty."""
    index = kept_index_of(sel, sel_columns, rows, cols, v_g, m_g).view(-1)
    dy2 = dy2.to(x2.dtype)
    dx = torch.mm(dy2, dense_at_index(weight, index, rows, cols, x2.dtype)) if need_dx else x2.new_empty(0)
    if need_dw:
        dw = torch.mm(dy2.t(), x2).view(-1).index_select(0, index).view(weight.shape).to(weight.dtype)
    else:
        dw = weight.new_empty(0)
    db = x2.new_empty(0) if bias is None else dy2.sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, dw, db


_lib.impl("compact_linear", _compact_linear_reference, "CPU")
_lib.impl("compact_backward", _compact_backward_reference, "CPU")


@torch.library.register_fake("hf_sparse::compact_linear", lib=_lib)
def _(x2, weight, bias, bias_c, values, meta, columns, values_t, meta_t, columns_t, meta_g, columns_g, sel,
      sel_columns, rows, cols, m, v_g, m_g, plan, kernels):  # fmt: skip
    return x2.new_empty(x2.shape[0], rows)


@torch.library.register_fake("hf_sparse::compact_backward", lib=_lib)
def _(dy2, x2, weight, bias, sel, sel_columns, values_t, meta_t, columns_t, meta_g, columns_g, rows, cols, v_g, m_g,
      plan, kernels, need_dx, need_dw):  # fmt: skip
    dx = x2.new_empty(x2.shape) if need_dx else x2.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    return dx, dw, x2.new_empty(0) if bias is None else bias.new_empty(bias.shape)


def _setup_context(ctx, inputs, output):
    x2, weight, bias, _, _, _, _, values_t, meta_t, columns_t, meta_g, columns_g, sel, sel_columns = inputs[:14]
    ctx.save_for_backward(x2, weight, bias, sel, sel_columns, values_t, meta_t, columns_t, meta_g, columns_g)
    rows, cols, _, v_g, m_g, plan, kernels = inputs[14:]
    ctx.sizes = (rows, cols, v_g, m_g, plan, kernels)


def _backward(ctx, dy2):
    x2, weight, bias, sel, sel_columns, values_t, meta_t, columns_t, meta_g, columns_g = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, _ = torch.ops.hf_sparse.compact_backward(
        dy2, x2, weight, None, sel, sel_columns, values_t, meta_t, columns_t, meta_g, columns_g, *ctx.sizes, need_dx,
        need_dw,
    )  # fmt: skip
    # the bias gradient in the graph, where Inductor fuses the reduction into the kernel that makes dy2
    db = dy2.sum(0, dtype=torch.float32).to(bias.dtype) if need_db else None
    return (dx if need_dx else None, dw if need_dw else None, db) + (None,) * 18


torch.library.register_autograd("hf_sparse::compact_linear", _backward, setup_context=_setup_context, lib=_lib)


def compact_linear(layer: SparseLinear, x: Tensor, dtype: torch.dtype) -> Tensor:
    """The layer's forward as torch.compile traces it: the cast to the compute ``dtype`` and the activation in the
    graph, the layer itself one ``hf_sparse::compact_linear`` op on its kernel state, for the plan of the call's token
    bucket (a graph serves one bucket: the bucket's bounds are guards)."""
    bias = layer.bias
    trains = torch.is_grad_enabled() and (
        layer.weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
    )
    x2 = x.reshape(-1, layer.in_features)
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    bucket = 1
    while bucket < x2.shape[0]:  # compact.token_bucket by comparisons: under dynamic shapes they become guards
        bucket *= 2
    plan = _compiled_plan(layer._compact_id, bucket, trains, dtype)
    kernel = layer._kernel
    y = torch.ops.hf_sparse.compact_linear(x2, layer.weight, bias, *kernel.native_arguments(layer, plan, trains))
    if layer.activation is not None:
        y = activate(y, layer.activation)
    return y.view(*x.shape[:-1], layer.out_features)
