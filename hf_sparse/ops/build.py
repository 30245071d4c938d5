"""Ahead-of-time build of the CUDA kernels: ``python -m hf_sparse.ops.build``.

Compiles ``csrc/`` for ``HF_SPARSE_CUDA_ARCH_LIST`` (default: this GPU) into the extension cache (or
``HF_SPARSE_BUILD_DIR``), so the first training step does not pay for nvcc. With ``HF_SPARSE_BUILD_LAB=1`` it builds
the lab extension of the benchmarks instead (:mod:`hf_sparse.ops._build`).
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from ._build import KernelUnavailableError, load_extension

    start = time.perf_counter()
    try:
        ext = load_extension()
    except KernelUnavailableError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"hf_sparse: built {ext.__file__} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
