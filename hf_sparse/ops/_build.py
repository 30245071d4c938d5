"""Build-on-first-use of the CUDA extension (``csrc/``), cached by ``torch.utils.cpp_extension``.

Nothing here runs at import time: :func:`load_extension` is called by an op the first time it needs the GPU.
Without a CUDA device or ``nvcc`` it raises :class:`KernelUnavailableError`, which says what to do.

Environment:
``HF_SPARSE_CUDA_ARCH_LIST``  semicolon/space separated compute capabilities (``"8.0;8.6;9.0"``); default: the
                              current GPU's. ``9.0`` builds ``sm_90a`` machine code, which also enables the
                              sparse-``wgmma`` SpMM (``csrc/spmm_sm90.cu``) on cc 9.0 GPUs.
``HF_SPARSE_BUILD_DIR``       where the build is cached (default: torch's extension cache).
``HF_SPARSE_BUILD_VERBOSE``   ``1`` prints the compiler commands.
``HF_SPARSE_NVCC_FLAGS``      extra nvcc flags (tuning runs, e.g. ``-DHF_SPARSE_SPMM_VARIANT=1``); the extension
                              name gets a hash of them so differently built copies never share a cache entry.
``HF_SPARSE_CUSPARSELT_DIR``  a cuSPARSELt installation (``include/cusparseLt.h`` and ``lib/libcusparseLt.so*``) for
                              the cached cuSPARSELt path (:func:`load_cslt_extension`); default: the
                              ``nvidia-cusparselt-cu1x`` pip package torch depends on, then ``CUDA_HOME``.

The cuSPARSELt path (``csrc/cusparselt.cpp``) is a second, separate extension: where cuSPARSELt is missing only
that path is unavailable.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from ..masks import use_extension

__all__ = [
    "KernelUnavailableError",
    "arch_flags",
    "csrc_dir",
    "find_cusparselt",
    "load_cslt_extension",
    "load_extension",
]

logger = logging.getLogger(__name__)

EXTENSION_NAME = "hf_sparse_C"
SOURCES = (
    "binding.cpp",
    "spmm.cu",
    "spmm_sm90.cu",
    "spmm_vnm_sm90.cu",
    "sddmm.cu",
    "sddmm_sm90.cu",
    "pack.cu",
    "mask.cu",
    "refresh.cu",
    "mask_select.cu",
)
CSLT_EXTENSION_NAME = "hf_sparse_cslt"
CSLT_SOURCES = ("cusparselt.cpp",)


class KernelUnavailableError(RuntimeError):
    """The CUDA kernels cannot be used here (no GPU, no nvcc, or the build failed)."""


def csrc_dir() -> Path:
    """The folder holding the CUDA sources: ``<repo>/csrc`` (source checkout) or ``hf_sparse/csrc`` (wheel)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent.parent / "csrc", here.parent / "csrc"):
        if (cand / "spmm.cu").is_file():
            return cand
    raise KernelUnavailableError(
        "hf_sparse: the CUDA sources (csrc/spmm.cu) are not installed; install hf_sparse from a source checkout "
        "or use the dense path"
    )


def _arch_list() -> list[str]:
    env = os.environ.get("HF_SPARSE_CUDA_ARCH_LIST", "").replace(";", " ").replace(",", " ").split()
    if env:
        return env
    major, minor = torch.cuda.get_device_capability()
    return [f"{major}.{minor}"]


def arch_flags(archs: list[str] | None = None) -> list[str]:
    """nvcc ``-gencode`` flags for the arch list (sm_90 gets ``sm_90a``; PTX of the newest is embedded)."""
    flags = []
    archs = archs or _arch_list()
    for arch in archs:
        num = arch.replace(".", "").replace("+PTX", "")
        if not num.isdigit() or int(num) < 80:
            raise KernelUnavailableError(
                f"hf_sparse: CUDA arch {arch!r} is not supported (need 8.0 or newer); fix HF_SPARSE_CUDA_ARCH_LIST"
            )
        suffix = "a" if num == "90" else ""
        flags.append(f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}")
    if any(a.replace(".", "").replace("+PTX", "") == "90" for a in archs):
        # sm_90a machine code is in the build: the sparse-wgmma SpMM (csrc/spmm_sm90.cu) may be launched on cc 9.0
        flags.append("-DHF_SPARSE_HAS_SM90A")
    newest = max(archs, key=lambda a: int(a.replace(".", "").replace("+PTX", ""))).replace(".", "").replace("+PTX", "")
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def _check_toolchain() -> None:
    """Raise KernelUnavailableError unless a CUDA GPU of cc >= 8.0 and nvcc are there."""
    if not torch.cuda.is_available():
        raise KernelUnavailableError(
            "hf_sparse: the sparse kernels need a CUDA GPU (sm_80 or newer) and none is visible; run on a GPU or "
            "use the dense path (the ops' CPU implementations are the pure-PyTorch reference)"
        )
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        raise KernelUnavailableError(
            f"hf_sparse: this GPU has compute capability {major}.x; Sparse Tensor Cores need 8.0 or newer"
        )
    from torch.utils import cpp_extension

    if (
        cpp_extension.CUDA_HOME is None
        or shutil.which("nvcc", path=os.path.join(cpp_extension.CUDA_HOME, "bin")) is None
    ):
        raise KernelUnavailableError(
            "hf_sparse: nvcc was not found, so the CUDA kernels cannot be built; install the CUDA toolkit matching "
            f"torch.version.cuda={torch.version.cuda} and set CUDA_HOME, or build ahead of time with "
            "`python -m hf_sparse.ops.build` where nvcc exists"
        )


def _build_dir() -> str | None:
    build_dir = os.environ.get("HF_SPARSE_BUILD_DIR")
    if build_dir:
        os.makedirs(build_dir, exist_ok=True)
    return build_dir


def loaded_extension() -> ModuleType | None:
    """The extension if this process has already loaded it, else None; never builds. For optional fast paths (the
    fused masking of :func:`hf_sparse.masks.apply_masks`) that must not start a build of every kernel on their own."""
    return load_extension() if load_extension.cache_info().currsize else None


_build_failures: dict[str, KernelUnavailableError] = {}  # extension name -> why compiling it failed in this process


@functools.cache
def load_extension() -> ModuleType:
    """Compile (first call only; cached on disk) and import the extension. Raises KernelUnavailableError.

    A compile that failed is not retried in the same process (``SparseTrainer`` asks at train start and again when
    it switches layers to the kernels): it would fail the same way, after the same minutes."""
    _check_toolchain()
    from torch.utils import cpp_extension

    src = csrc_dir()
    build_dir = _build_dir()
    extra = os.environ.get("HF_SPARSE_NVCC_FLAGS", "").split()
    flags = ["-O3", "-std=c++17", "-lineinfo", *arch_flags(), *extra]
    name = EXTENSION_NAME + ("_" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else "")
    if name in _build_failures:
        raise _build_failures[name]
    try:
        extension = cpp_extension.load(
            name=name,
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=["-O3"],  # no -std: torch picks its headers' own (C++17 in torch 2.11, C++20 in 2.13)
            extra_cuda_cflags=flags,
            extra_include_paths=[str(src)],
            build_directory=build_dir,
            verbose=os.environ.get("HF_SPARSE_BUILD_VERBOSE") == "1",
        )
    except Exception as exc:  # the compiler's message is in exc; keep it and say what to do
        err = _build_failures[name] = KernelUnavailableError(
            f"hf_sparse: building the CUDA kernels failed ({exc}); set HF_SPARSE_BUILD_VERBOSE=1 to see the compiler "
            "commands, check that nvcc matches torch.version.cuda, or use the dense path"
        )
        raise err from exc
    use_extension(extension)  # the mask selection and fused masking of hf_sparse.masks run on it from now on
    return extension


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

    Linked against the same ``libcusparseLt.so.0`` torch loads (same soname, so one copy in the process).
    """
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
            name=f"{CSLT_EXTENSION_NAME}_{tag}",
            sources=[str(csrc_dir() / s) for s in CSLT_SOURCES],
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
