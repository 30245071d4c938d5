"""cuSPARSELt 2:4 SpMM with a cached plan: per call, one ``cusparseLtMatmul`` and nothing else.

``torch._cslt_sparse_mm`` rebuilds descriptors, algorithm selection and plan on every call (~0.3-0.4 ms on an
H200), which is 4-10x a whole BERT-sized GEMM. :func:`compress` returns a ``CsltWeight`` (``csrc/cusparselt.cpp``)
that keeps all of that: the compressed weight, and one plan per (token count, bias pointer) whose algorithm
``cusparseLtMatmulSearch`` picked once per power-of-two token bucket. ``CsltWeight.compress(w)`` rewrites the
values after an optimizer step and keeps the plans.

cuSPARSELt's rules for 16-bit operands (:func:`supports`): weight rows and columns multiples of 16 (structured
operand), token count a multiple of 8 (dense operand), 16-byte aligned contiguous tensors. Other calls must go
elsewhere (our SpMM or dense); ``CsltWeight.matmul`` raises a RuntimeError naming the rule.

Nothing here runs at import; :func:`available` builds the extension on first use and is False where cuSPARSELt,
nvcc or a GPU is missing.

Status (H200, cuSPARSELt 0.8, 2026-11-22): bf16 measured and checked (``benchmarks/RESULTS.md``); the one GPU test
run crashed at its first fp16 case, so the dispatcher sends only bf16 here until ``tests/ops/test_cslt_gpu.py``
passes on a GPU with fp16 (``dispatch._CACHED_CSLT_DTYPES``).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from ._build import KernelUnavailableError, load_cslt_extension

__all__ = ["available", "compress", "supports", "versions"]

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16)


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


def compress(weight: Tensor):
    """A ``CsltWeight`` holding ``weight`` (R x K, bf16/fp16, 2:4 along K, zeros at pruned positions) compressed.

    ``weight`` must be contiguous: pass ``w.t().contiguous()`` for a transposed weight (once per optimizer step).
    """
    return load_cslt_extension().CsltWeight(weight)


def versions() -> tuple[int, int]:
    """(cuSPARSELt version loaded in this process, version of the header the extension was built with)."""
    return tuple(load_cslt_extension().versions())
