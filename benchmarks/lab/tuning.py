"""The lab build's tuning knobs (``csrc/lab.h``), set from Python: :func:`tuning` forces them inside a block.

Knobs: ``sm90_config`` (the 2:4 sparse-wgmma SpMM's tile configuration, 0-35 as numbered in ``csrc/README.md``; -1
the product's choice), ``vnm_pipe`` (the V:2:M wgmma SpMM's pipeline: 0 registers, 1 staged, 2 registers + L1
prefetch, 3 warp-specialised, 4 = 3 with one gather for both slabs where they keep the same columns, M = 8), ``vnm_tile`` (64: 64-token tiles at M = 8; 0 the product's), ``vnm_xt`` (1: the V:2:M kernel's X^T path at every
token count and weight size, 0: never, -1: the product's rule), ``sddmm_gather_regs`` (1: the wgmma SDDMM at
M = 8 loads X into registers; 0 the product's), ``split_k`` (> 0: that many splits of each tile's k-tiles in both
sparse-wgmma SpMMs wherever they may split; 0 the product's count), ``small_tiles`` (1: the 2:4 wgmma kernel's
few-token tiles up to 256 tokens, 0: never, the persistent large configurations and their split-K instead; -1 the
product's rule). They exist only in the lab build: run with ``HF_SPARSE_BUILD_LAB=1``
set before the extension is first built in the process (it is read at build time only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hf_sparse.ops._build import KernelUnavailableError, lab_build, load_extension

__all__ = ["KNOBS", "require_lab_build", "tuning"]

KNOBS = ("sm90_config", "vnm_pipe", "vnm_tile", "vnm_xt", "sddmm_gather_regs", "split_k", "small_tiles")
SM90_CONFIGS = range(36)  # the tile configurations of the lab build (csrc/lab.h kSm90Configs)


def require_lab_build(what: str) -> None:
    """Raise SystemExit saying how to run ``what`` unless this process builds the lab extension."""
    if not lab_build():
        raise SystemExit(f"{what} needs the lab build: run it with HF_SPARSE_BUILD_LAB=1")


@contextlib.contextmanager
def tuning(**knobs: int) -> Iterator[None]:
    """Set lab knobs (names of :data:`KNOBS`) inside the block and restore them after; the extension must be the lab
    build (``HF_SPARSE_BUILD_LAB=1``). With no knobs the block runs the product's choices on any build."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"hf_sparse lab: unknown knobs {sorted(unknown)}; use {KNOBS}")
    if not knobs:
        yield
        return
    ext = load_extension()
    if not hasattr(ext, "lab_set"):
        raise KernelUnavailableError(
            "hf_sparse lab: the loaded extension is the product build, which has no tuning knobs; set "
            "HF_SPARSE_BUILD_LAB=1 before the first kernel call of the process"
        )
    before = {}
    try:
        for name, value in knobs.items():
            before[name] = ext.lab_set(name, int(value))
        yield
    finally:
        for name, value in before.items():
            ext.lab_set(name, value)
