"""cuSPARSELt 2:4 SpMM with a cached plan: per call, one ``cusparseLtMatmul`` and nothing else.

``torch._cslt_sparse_mm`` rebuilds descriptors, algorithm selection and plan on every call (~0.3-0.4 ms on an
H200), which is 4-10x a whole BERT-sized GEMM. :func:`compress` returns a ``CsltWeight`` (``csrc/cusparselt.cpp``)
that keeps all of that: the compressed weight, and one plan per (token count, bias pointer) whose algorithm
``cusparseLtMatmulSearch`` picked once per power-of-two token bucket. ``CsltWeight.compress(w)`` rewrites the
values after an optimizer step and keeps the plans.

cuSPARSELt's rules for 16-bit operands (:func:`supports`): weight rows and columns multiples of 16 (structured
operand), token count a multiple of 8 (dense operand), 16-byte aligned contiguous tensors. Other calls must go
elsewhere (our SpMM or dense); :class:`CachedWeight` raises a ValueError naming the rule before anything reaches
C++. That order matters: on the H200 (torch 2.11, 2026-11-22) an argument error raised *inside* the extension
crashed the process (segfault while the error was being built; cause not found), so the extension's own checks
are a last line that no hf_sparse path reaches.

Nothing here runs at import; :func:`available` builds the extension on first use and is False where cuSPARSELt,
nvcc or a GPU is missing.

Status (H200, cuSPARSELt 0.8, 2026-11-22): bf16 measured and checked (``benchmarks/RESULTS.md``); fp16 crashed the
process at its first cached matmul in every GPU run, so :data:`CACHED_DTYPES` is bf16 only.

No hf_sparse layer runs it: compact layers choose between our kernels and dense cuBLAS. It is the cached
cuSPARSELt baseline of ``benchmarks/bench_kernels.py``.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from ._build import KernelUnavailableError, load_cslt_extension

__all__ = ["CachedWeight", "available", "compress", "supports", "versions"]

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16)  # what cuSPARSELt runs (shape rules of :func:`supports`)
# What the cached path accepts. fp16 is refused: its first cusparseLtMatmul crashed the process (segfault) on the H200
# in every GPU run of 2026-11-22 (tests/ops/test_cslt_gpu.py), cause not found; fp16 goes to torch's eager op.
CACHED_DTYPES = (torch.bfloat16,)


def supports(rows: int, cols: int, tokens: int, dtype: torch.dtype) -> bool:
    """Whether cuSPARSELt can run ``(tokens x cols) @ (rows x cols)^T`` in ``dtype`` (shape rules only)."""
    return (
        dtype in DTYPES
        and rows % 16 == 0
        and cols % 16 == 0
        and rows > 0
        and cols > 0
        and tokens % 8 == 0
        and tokens > 0
    )


@functools.cache
def available() -> bool:
    """True when the cached cuSPARSELt path can be built and loaded here (logged once otherwise)."""
    try:
        load_cslt_extension()
    except KernelUnavailableError as exc:
        logger.info("hf_sparse: cached cuSPARSELt path unavailable: %s", exc)
        return False
    return True


def _aligned(t: Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _check_weight(weight: Tensor, op: str) -> None:
    if not (weight.is_cuda and weight.dim() == 2):
        raise ValueError(
            f"hf_sparse.cslt.{op}: weight must be a 2-D CUDA tensor, got {weight.dim()}-D on {weight.device}"
        )
    if weight.dtype not in CACHED_DTYPES:
        raise ValueError(
            f"hf_sparse.cslt.{op}: the cached cuSPARSELt path runs bfloat16 only, got {weight.dtype} (float16 crashed "
            "in cuSPARSELt on an H200; use torch._cslt_sparse_mm)"
        )
    if not _aligned(weight):
        raise ValueError(f"hf_sparse.cslt.{op}: weight must be contiguous and 16-byte aligned (pass w.contiguous())")
    rows, cols = weight.shape
    if rows <= 0 or cols <= 0 or rows % 16 or cols % 16:
        raise ValueError(
            f"hf_sparse.cslt.{op}: cuSPARSELt needs both weight dimensions to be multiples of 16, got {(rows, cols)}; "
            "use hf_sparse.ops.spmm or dense F.linear for this layer"
        )


class CachedWeight:
    """A compressed 2:4 weight with its cuSPARSELt plans (``csrc/cusparselt.cpp``), arguments checked here first.

    ``matmul(x, bias=None, search=True)``: ``x @ W^T (+ bias)`` as one ``cusparseLtMatmul`` once the plan for this
    token count exists (``search``: let cuSPARSELt pick the algorithm for a new token bucket; never while a CUDA
    graph captures). ``compress(w)``: new values (same shape, dtype, device) into the same buffer; plans are kept.
    The counters ``plan_inits()``, ``searches()``, ``compressions()``, ``algorithms()`` are the extension's.
    """

    def __init__(self, weight: Tensor) -> None:
        _check_weight(weight, "compress")
        self.rows, self.cols = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self._impl = load_cslt_extension().CsltWeight(weight)

    def compress(self, weight: Tensor) -> None:
        _check_weight(weight, "compress")
        if (tuple(weight.shape), weight.dtype, weight.device) != ((self.rows, self.cols), self.dtype, self.device):
            raise ValueError(
                f"hf_sparse.cslt.compress: weight is {weight.dtype} {tuple(weight.shape)} on {weight.device}, this "
                f"compressed weight is {self.dtype} {(self.rows, self.cols)} on {self.device}"
            )
        self._impl.compress(weight)

    def matmul(self, x: Tensor, bias: Tensor | None = None, search: bool = True) -> Tensor:
        if x.device != self.device or x.dtype != self.dtype:
            raise ValueError(
                f"hf_sparse.cslt.matmul: x must be {self.dtype} on {self.device} like the weight, got {x.dtype} on "
                f"{x.device}"
            )
        if x.dim() != 2 or x.shape[1] != self.cols or not _aligned(x):
            raise ValueError(
                f"hf_sparse.cslt.matmul: x must be a contiguous, 16-byte aligned (tokens, {self.cols}) tensor, got "
                f"{tuple(x.shape)}"
            )
        if x.shape[0] <= 0 or x.shape[0] % 8:
            raise ValueError(
                f"hf_sparse.cslt.matmul: cuSPARSELt needs a token count that is a multiple of 8, got {x.shape[0]}; "
                "use hf_sparse.ops.spmm or dense F.linear for this call"
            )
        if bias is not None and (
            bias.device != self.device
            or bias.dtype != self.dtype
            or tuple(bias.shape) != (self.rows,)
            or not _aligned(bias)
        ):
            raise ValueError(
                f"hf_sparse.cslt.matmul: bias must be a contiguous, 16-byte aligned {self.dtype} vector of {self.rows} "
                f"entries on {self.device}, got {bias.dtype} {tuple(bias.shape)} on {bias.device}"
            )
        return self._impl.matmul(x, bias, search)

    def __getattr__(self, name: str):  # the extension's counters and accessors
        return getattr(self.__dict__["_impl"], name)


def compress(weight: Tensor) -> CachedWeight:
    """A :class:`CachedWeight` holding ``weight`` (R x K, bf16/fp16, 2:4 along K, zeros at pruned positions).

    ``weight`` must be contiguous: pass ``w.t().contiguous()`` for a transposed weight (once per optimizer step).
    """
    return CachedWeight(weight)


def versions() -> tuple[int, int]:
    """(cuSPARSELt version loaded in this process, version of the header the extension was built with)."""
    return tuple(load_cslt_extension().versions())
