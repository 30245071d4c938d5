"""``hf_sparse::spmm``: ``Y = X W^T (+ bias)`` with W packed V:2:M; X and Y exactly as nn.Linear sees them.

CUDA: the ``mma.sp`` kernel (``csrc/spmm.cu``), or on a cc 9.0 GPU with an sm_90a build a sparse-``wgmma`` kernel
with the same packed layout: ``csrc/spmm_sm90.cu`` for plain 2:4, ``csrc/spmm_vnm_sm90.cu`` for V:2:M with M >= 8
(it gathers the kept columns of X into shared memory; from 65 tokens on 1024 rows and more, at V = 64 on 1024 from 256,
from 33 tokens at M >= 16 from 4097 rows or on weights of 2^27 elements and more, and at M = 8 where V = 128 on
weights of 2^25 and more,
``csrc/spmm_vnm_xt_sm90.cu`` transposes X first and copies whole kept rows of X^T; at 1-4 tokens, where one CTA per 16
rows fits one wave of two per SM and X fits its shared memory, ``csrc/spmv_vnm.cu`` runs the product on the CUDA
cores). Which one runs:
:func:`hf_sparse.ops._select.choose_kernel` (wgmma where it can run, at the group sizes of :data:`AUTO_WGMMA_M`: all of
them); :func:`hf_sparse.ops.force_kernel` forces either.
CPU (and CUDA shapes the kernels cannot take, e.g. ``K % 8 != 0``): the reference, which decompresses W and
multiplies in fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ._layout import PackedWeight, dense_from_packed
from ._select import SPMM_WGMMA_M, device_kernel, kernel_function

__all__ = [
    "ACTIVATIONS",
    "AUTO_WGMMA_M",
    "activate",
    "fuses_activation",
    "kernel_activation",
    "spmm",
    "spmm_function",
    "spmm_kernel",
    "spmm_reference",
]

# Activations SpMM can apply to its output (``activation=``), with the code the kernels take: the exact (erf) GELU of
# torch.nn.functional.gelu. The 2:4 sparse-wgmma kernel applies it in its epilogue (csrc/common.cuh ``activate``), in
# fp32 before the cast; every other path applies F.gelu to the output.
ACTIVATIONS = {"gelu": 1}


def spmm_reference(x: Tensor, p: PackedWeight, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """fp32-accumulated ``act(x @ W^T + bias)`` from the packed form, in ``x.dtype`` (the spec the kernel is held to)."""
    w = dense_from_packed(p, torch.float32)
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    if activation is not None:
        y = activate(y, activation)
    return y.to(x.dtype)


def _act_code(activation: str | None) -> int:
    if activation is None:
        return 0
    code = ACTIVATIONS.get(activation)
    if code is None:
        raise ValueError(f"hf_sparse.spmm: activation {activation!r} is not one of {sorted(ACTIVATIONS)} (or None)")
    return code


def activate(y: Tensor, activation: str) -> Tensor:
    """``activation`` (an :data:`ACTIVATIONS` name) applied to ``y`` as a separate op: where no kernel fuses it."""
    _act_code(activation)  # validates the name
    return torch.nn.functional.gelu(y)


def fuses_activation(m: int, device: torch.device) -> bool:
    """Whether the kernel that runs group size ``m`` on ``device`` applies an activation in its epilogue (the 2:4
    sparse-wgmma kernel), so that :func:`spmm` needs no separate pass for it."""
    return m == 4 and spmm_kernel(m, device) == "wgmma"


def kernel_activation(activation: str | None, m: int, device: torch.device) -> tuple[int, str | None]:
    """How the kernel for group size ``m`` on ``device`` runs ``activation``: ``(code, after)``, the ``act`` argument
    of :func:`spmm_function`'s function and the activation left to apply to its output (None when fused or none)."""
    code = _act_code(activation)
    if code == 0 or fuses_activation(m, device):
        return code, None
    return 0, activation


def _kernel_ok(x: Tensor, cols: int) -> bool:
    return cols % 8 == 0 and x.data_ptr() % 16 == 0


#: group sizes M at which the sparse-wgmma kernel runs where it can (measured faster than mma.sp: see _select)
AUTO_WGMMA_M = SPMM_WGMMA_M


def spmm_kernel(m: int, device: torch.device | None = None) -> str:
    """The CUDA kernel a pattern with group size ``m`` runs on, on ``device``: ``"wgmma"`` or ``"mma_sp"`` (what
    :func:`hf_sparse.ops.force_kernel` forces now, else the automatic choice; that one builds the extension on first
    call to ask whether the sm_90a kernel is in it)."""
    return device_kernel("spmm", m, device)


def spmm_function(m: int, device: torch.device):
    """The extension function :func:`spmm_kernel` picks for group size ``m`` on ``device``, called as
    ``fn(x2, values, meta, columns, bias, rows, cols, v, m, act)`` with ``x2`` 2-D, contiguous, 16-byte aligned,
    ``cols % 8 == 0`` and everything in one dtype (the binding checks the rest); ``act``: 0, or an
    :data:`ACTIVATIONS` code where :func:`fuses_activation` says the kernel has it."""
    return kernel_function("spmm", m, device)


def _run_kernel(
    x: Tensor,
    values: Tensor,
    meta: Tensor,
    columns: Tensor,
    bias: Tensor | None,
    rows: int,
    cols: int,
    v: int,
    m: int,
    activation: str | None = None,
) -> Tensor:
    """The CUDA kernel call itself (``x`` 2-D, contiguous, 16-byte aligned, ``cols % 8 == 0``), the activation fused
    where the kernel has it, else applied after."""
    code, after = (0, None) if activation is None else kernel_activation(activation, m, x.device)
    y = spmm_function(m, x.device)(x, values, meta, columns, bias, rows, cols, v, m, code)
    return y if after is None else activate(y, after)


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
            return _run_kernel(x, values, meta, columns, bias, rows, cols, v, m)
        warnings.warn(
            f"hf_sparse.spmm: in_features={cols} is not a multiple of 8 (or x is misaligned); using the slow "
            "reference path. Pad the layer to a multiple of 8 for the kernel.",
            stacklevel=2,
        )
    return spmm_reference(x, p, bias)


@_spmm_op.register_fake
def _(x, values, meta, columns, valid, bias, rows, cols, v, m):
    return x.new_empty((x.shape[0], rows))


def spmm(x: Tensor, packed: PackedWeight, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """``x`` (..., K) bf16/fp16 in the packed dtype -> (..., R). No copy of ``x`` when it is contiguous.
    ``activation``: ``"gelu"`` applies the exact GELU to the output (fused into the 2:4 sparse-wgmma kernel)."""
    _act_code(activation)  # validates the name
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
    if x2.is_cuda and _kernel_ok(x2, packed.cols) and not torch.compiler.is_compiling():
        # hot path (every sparse linear call): straight to the kernel, without the host time of the custom op's
        # Python dispatch; the op below is the same call, kept for torch.compile and opcheck
        y = _run_kernel(
            x2,
            packed.values,
            packed.meta,
            packed.columns,
            bias,
            packed.rows,
            packed.cols,
            packed.v,
            packed.m,
            activation,
        )
        return y.reshape(*lead, packed.rows)
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
    if activation is not None:
        y = activate(y, activation)
    return y.reshape(*lead, packed.rows)
