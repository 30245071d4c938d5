"""Build-on-first-use of the CUDA extension (``csrc/``), cached by ``torch.utils.cpp_extension``.

Nothing here runs at import time: :func:`load_extension` is called by an op the first time it needs the GPU.
Without a CUDA device or ``nvcc`` it raises :class:`KernelUnavailableError`, which says what to do. The sources come
from the installed package (``hf_sparse/csrc``, what a wheel ships) or else from the source checkout (``csrc/``).

The build holds what the product runs: the SpMM kernels and tile configurations the kernel choice can reach, the
SDDMM, pack and mask kernels, the compact layer's C++ autograd node. Read when the extension is built (first use in a
process, or ``python -m hf_sparse.ops.build``), never per call:

``HF_SPARSE_CUDA_ARCH_LIST``  semicolon/space separated compute capabilities (``"8.0;8.6;9.0"``); default: the
                              current GPU's. ``9.0`` builds ``sm_90a`` machine code, which also enables the
                              ``wgmma`` kernels (``csrc/*_sm90.cu``) on cc 9.0 GPUs.
``HF_SPARSE_BUILD_DIR``       where the build is cached (default: torch's extension cache), one subfolder per
                              extension (product, lab, extra flags), so that two builds at once never share a
                              ``build.ninja``.
``HF_SPARSE_BUILD_VERBOSE``   ``1`` prints the compiler commands.
``HF_SPARSE_NVCC_FLAGS``      extra nvcc flags; the extension name gets a hash of them so differently built copies
                              never share a cache entry.
``HF_SPARSE_BUILD_LAB``       ``1`` builds the lab extension instead (``-DHF_SPARSE_LAB``, its own cache entry): every
                              tile configuration and pipeline of the sm_90a kernels, switched at run time by the
                              benchmarks' ``lab.tuning`` (``benchmarks/lab/``). No hf_sparse code path needs it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from ..masks import use_extension

__all__ = [
    "KernelUnavailableError",
    "arch_flags",
    "build_flags",
    "csrc_dir",
    "load_extension",
]

logger = logging.getLogger(__name__)

EXTENSION_NAME = "hf_sparse_C"
SOURCES = (
    "binding.cpp",
    "spmm.cu",
    "spmm_sm90.cu",
    "spmm_vnm_sm90.cu",
    "spmm_vnm_xt_sm90.cu",
    "spmm_vnm_xt_sm90_fp16.cu",
    "spmv_vnm.cu",
    "sddmm.cu",
    "sddmm_sm90.cu",
    "pack.cu",
    "mask.cu",
    "refresh.cu",
    "mask_select.cu",
)
HEADERS = (
    "check.h",
    "common.cuh",
    "kernels.h",
    "lab.h",
    "launch.h",
    "sm90_common.cuh",
    "spmm_vnm_xt_sm90.cuh",
    "tensor_map.h",
    "tile_config.h",
    "tma_sm90.cuh",
    "transpose_tokens.cuh",
    "wgmma_dense.cuh",
    "wgmma_sp.cuh",
)


class KernelUnavailableError(RuntimeError):
    """The CUDA kernels cannot be used here (no GPU, no nvcc, or the build failed)."""


def csrc_candidates() -> tuple[Path, Path]:
    """Where the CUDA sources may be, in the order they are looked for: the installed package's ``hf_sparse/csrc``
    (a wheel, ``pip install .``), then the source checkout's ``csrc/`` (an editable install, ``PYTHONPATH``)."""
    here = Path(__file__).resolve().parent
    return here.parent / "csrc", here.parent.parent / "csrc"


def csrc_dir() -> Path:
    """The first of :func:`csrc_candidates` that holds every source and header the extension is built from."""
    needed = (*SOURCES, *HEADERS)
    for cand in csrc_candidates():
        if all((cand / name).is_file() for name in needed):
            return cand
    tried = ", ".join(str(c) for c in csrc_candidates())
    raise KernelUnavailableError(
        f"hf_sparse: the CUDA sources ({', '.join(needed)}) were not found in {tried}; reinstall hf_sparse (its "
        "wheel ships them as hf_sparse/csrc) or install it from a source checkout, or use the dense path"
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


def _build_dir(name: str) -> str | None:
    """``HF_SPARSE_BUILD_DIR/name`` (created), or None for torch's cache, which already keeps one folder per name."""
    root = os.environ.get("HF_SPARSE_BUILD_DIR")
    if not root:
        return None
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    return build_dir


def loaded_extension() -> ModuleType | None:
    """The extension if this process has already loaded it, else None; never builds. For optional fast paths (the
    fused masking of :func:`hf_sparse.masks.apply_masks`) that must not start a build of every kernel on their own."""
    return load_extension() if load_extension.cache_info().currsize else None


_build_failures: dict[str, KernelUnavailableError] = {}  # extension name -> why compiling it failed in this process


def _stale(library: Path, src: Path) -> bool:
    """Whether the cached ``library`` is missing or older than a source or header: the next load compiles."""
    if not library.is_file():
        return True
    built = library.stat().st_mtime
    return any((src / name).stat().st_mtime > built for name in (*SOURCES, *HEADERS))


@functools.cache
def lab_build() -> bool:
    """Whether this process builds (and loads) the lab extension: ``HF_SPARSE_BUILD_LAB=1``, read once per process,
    by the first build or by a lab tool asking."""
    value = os.environ.get("HF_SPARSE_BUILD_LAB", "0")
    if value not in ("0", "1", ""):
        raise KernelUnavailableError(f"hf_sparse: HF_SPARSE_BUILD_LAB={value!r}; use 1 (the lab build) or 0 / unset")
    return value == "1"


def build_flags(archs: list[str] | None = None, lab: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    """The nvcc flags of the extension: the product's, plus ``-DHF_SPARSE_LAB`` for the lab build and ``extra``."""
    return ["-O3", "-std=c++17", "-lineinfo", *arch_flags(archs), *(["-DHF_SPARSE_LAB"] if lab else []), *extra]


def _extension_name(lab: bool, extra: tuple[str, ...]) -> str:
    """The cache entry of a build: the lab build and extra flags each get their own."""
    name = EXTENSION_NAME + ("_lab" if lab else "")
    return name + ("_" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else "")


@functools.cache
def load_extension() -> ModuleType:
    """Compile (first call only; cached on disk) and import the extension. Raises KernelUnavailableError.

    A compile says so on stderr when it starts (about a minute on 16 cores) and when it ends. A compile that
    failed is not retried in the same process (``SparseTrainer`` asks at train start and again when it switches
    layers to the kernels): it would fail the same way, after the same time."""
    _check_toolchain()
    from torch.utils import cpp_extension

    src = csrc_dir()
    lab = lab_build()
    extra = tuple(os.environ.get("HF_SPARSE_NVCC_FLAGS", "").split())
    name = _extension_name(lab, extra)
    if name in _build_failures:
        raise _build_failures[name]
    build_dir = _build_dir(name)
    cache = Path(build_dir or cpp_extension._get_build_directory(name, verbose=False))
    compiles = _stale(cache / f"{name}.so", src)
    if compiles:
        print(
            f"hf_sparse: compiling the CUDA kernels{' (lab build)' if lab else ''} into {cache} (first use only, "
            "about a minute on 16 cores; `python -m hf_sparse.ops.build` does it ahead of time)...",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    try:
        extension = cpp_extension.load(
            name=name,
            sources=[str(src / s) for s in SOURCES],
            # no -std: torch picks its headers' own (C++17 in torch 2.11, C++20 in 2.13)
            # the -D flags of HF_SPARSE_NVCC_FLAGS reach the binding too, so it binds what they compile in
            extra_cflags=["-O3", *(["-DHF_SPARSE_LAB"] if lab else []), *(f for f in extra if f.startswith("-D"))],
            extra_cuda_cflags=build_flags(lab=lab, extra=extra),
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
    if compiles:
        print(f"hf_sparse: CUDA kernels built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    use_extension(extension)  # the mask selection and fused masking of hf_sparse.masks run on it from now on
    return extension
