"""Lab: cuSPARSELt 2:4 SpMM with a cached plan (``benchmarks/lab/cusparselt.cpp``), the cached cuSPARSELt baseline
of ``benchmarks/bench_kernels.py``. No hf_sparse layer runs it: compact layers choose between our kernels and dense
cuBLAS. Built on first use, as its own extension, only with ``HF_SPARSE_BUILD_LAB=1`` (:func:`available` is False
otherwise, and :func:`load_cslt_extension` says so).

Per call, one ``cusparseLtMatmul`` and nothing else: ``torch._cslt_sparse_mm`` rebuilds descriptors, algorithm
selection and plan on every call (~0.3-0.4 ms on an H200), which is 4-10x a whole BERT-sized GEMM. :func:`compress`
returns a ``CachedWeight`` that keeps all of that: the compressed weight, and one plan per (token count, bias pointer)
whose algorithm ``cusparseLtMatmulSearch`` picked once per power-of-two token bucket. ``CachedWeight.compress(w)``
rewrites the values after an optimizer step and keeps the plans.

cuSPARSELt's rules for 16-bit operands (:func:`supports`): weight rows and columns multiples of 16 (structured
operand), token count a multiple of 8 (dense operand), 16-byte aligned contiguous tensors. :class:`CachedWeight`
raises a ValueError naming the rule before anything reaches C++ (an error raised inside an extension crashes the
process on the H200 test machine: ``csrc/README.md``, Limits). bf16 only (:data:`CACHED_DTYPES`): fp16 crashed the
process at its first cached matmul on the H200 (``benchmarks/RESULTS.md``).

Where cuSPARSELt is looked for (:func:`find_cusparselt`): ``HF_SPARSE_CUSPARSELT_DIR`` (only that folder when set),
then the pip packages torch depends on (``site-packages/nvidia/*/include/cusparseLt.h``), then ``CUDA_HOME``, then
``/usr``. The extension links that ``libcusparseLt.so`` by soname with an rpath to its folder, so it shares the copy
torch has loaded; its name carries a hash of the paths.

Import with ``benchmarks/`` on ``sys.path`` (``from lab import cslt``), as the benchmark scripts have it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from hf_sparse.ops._build import KernelUnavailableError, _build_dir, _check_toolchain, lab_build

__all__ = [
    "CachedWeight",
    "available",
    "compress",
    "find_cusparselt",
    "load_cslt_extension",
    "supports",
    "versions",
]

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16)  # what cuSPARSELt runs (shape rules of :func:`supports`)
# What the cached path accepts. fp16 is refused: its first cusparseLtMatmul crashed the process (segfault) on the H200
# (benchmarks/RESULTS.md), cause not found; fp16 goes to torch's eager op.
CACHED_DTYPES = (torch.bfloat16,)


def _cusparselt_prefixes() -> list[Path]:
    """Folders that may hold ``include/cusparseLt.h`` and ``lib/libcusparseLt.so*``, best first."""
    env = os.environ.get("HF_SPARSE_CUSPARSELT_DIR")
    if env:
        return [Path(env)]
    prefixes: list[Path] = []
    try:  # the pip wheels torch depends on: nvidia/cusparselt (cu12) or nvidia/cu13 (cu13)
        import nvidia  # type: ignore[import-not-found]

        for root in map(Path, getattr(nvidia, "__path__", [])):
            prefixes += sorted(p.parent.parent for p in root.glob("*/include/cusparseLt.h"))
    except ImportError:
        pass
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME:
        prefixes.append(Path(cpp_extension.CUDA_HOME))
    prefixes.append(Path("/usr"))
    return prefixes


def find_cusparselt() -> tuple[Path, Path] | None:
    """``(include dir, library file)`` of a cuSPARSELt installation with both header and library, or None."""
    for prefix in _cusparselt_prefixes():
        headers = [prefix / "include" / "cusparseLt.h", prefix / "include" / "x86_64-linux-gnu" / "cusparseLt.h"]
        header = next((h for h in headers if h.is_file()), None)
        if header is None:
            continue
        for libdir in ("lib", "lib64", "lib/x86_64-linux-gnu"):
            libs = sorted((prefix / libdir).glob("libcusparseLt.so*"))
            if libs:
                return header.parent, libs[0]
    return None


@functools.cache
def load_cslt_extension() -> ModuleType:
    """Compile (first call only; cached) and import the cached-plan cuSPARSELt path. Raises KernelUnavailableError.

    Linked against the same ``libcusparseLt.so.0`` torch loads (same soname, so one copy in the process). Only in the
    lab build (``HF_SPARSE_BUILD_LAB=1``).
    """
    if not lab_build():
        raise KernelUnavailableError(
            "hf_sparse lab: the cached cuSPARSELt path is part of the lab build; set HF_SPARSE_BUILD_LAB=1 to build it"
        )
    _check_toolchain()
    found = find_cusparselt()
    if found is None:
        raise KernelUnavailableError(
            "hf_sparse: cuSPARSELt (cusparseLt.h and libcusparseLt.so) was not found, so the cached cuSPARSELt path "
            "is unavailable; `pip install nvidia-cusparselt-cu12` (CUDA 12) or `nvidia-cusparselt-cu13` (CUDA 13), "
            "or set HF_SPARSE_CUSPARSELT_DIR to a folder with include/ and lib/"
        )
    include, lib = found
    from torch.utils import cpp_extension

    tag = hashlib.sha1(f"{include}|{lib}|{(include / 'cusparseLt.h').stat().st_size}".encode()).hexdigest()[:8]
    try:
        return cpp_extension.load(
            name=f"hf_sparse_cslt_{tag}",
            sources=[str(Path(__file__).resolve().parent / "cusparselt.cpp")],
            extra_cflags=["-O3"],  # no -std: torch picks its headers' own (C++17 in torch 2.11, C++20 in 2.13)
            extra_include_paths=[str(include)],
            extra_ldflags=[f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"],
            with_cuda=True,
            build_directory=_build_dir(),
            verbose=os.environ.get("HF_SPARSE_BUILD_VERBOSE") == "1",
        )
    except Exception as exc:
        raise KernelUnavailableError(
            f"hf_sparse: building the cuSPARSELt path against {include} / {lib} failed ({exc}); set "
            "HF_SPARSE_BUILD_VERBOSE=1 to see the compiler commands, or HF_SPARSE_CUSPARSELT_DIR to another "
            "cuSPARSELt installation"
        ) from exc


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
    """A compressed 2:4 weight with its cuSPARSELt plans (``benchmarks/lab/cusparselt.cpp``), arguments checked here first.

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
