"""Sparse Tensor Core ops: ``torch.library`` custom ops with pure-PyTorch references as their CPU implementation.

Importing this package never touches CUDA or nvcc: the extension is built on the first CUDA call
(:mod:`._build`), or ahead of time with ``python -m hf_sparse.ops.build``. :func:`force_kernel` forces which CUDA
kernel SpMM / SDDMM run (tests, benchmarks); the automatic choice is :func:`._select.choose_kernel`.
"""

from __future__ import annotations

from ._build import KernelUnavailableError
from ._layout import PackedWeight, dense_from_packed, kept_columns
from ._select import force_kernel
from .pack import pack, pack_from_logical
from .sddmm import scatter_dense, sddmm, sddmm_reference
from .spmm import spmm, spmm_reference

__all__ = [
    "KernelUnavailableError",
    "PackedWeight",
    "dense_from_packed",
    "force_kernel",
    "kept_columns",
    "pack",
    "pack_from_logical",
    "scatter_dense",
    "sddmm",
    "sddmm_reference",
    "spmm",
    "spmm_reference",
]
