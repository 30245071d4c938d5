"""Which CUDA kernel an op runs: the sm_90a ``wgmma`` one where it can run and was measured faster, else the sm_80+
warp-level one; an environment variable forces either (tests, benchmarks). Shared by :mod:`.spmm` and :mod:`.sddmm`.
"""

from __future__ import annotations

import os

import torch

__all__ = ["kernel_choice", "wgmma_available"]

_wgmma_ok: dict[int, bool] = {}  # device index -> the sm_90a kernels can run there (asked once per device)


def wgmma_available(device: torch.device) -> bool:
    """Whether ``device`` is a cc 9.0 GPU and the extension was built with sm_90a (builds it on first call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _wgmma_ok.get(index)
    if ok is None:
        from ._build import load_extension

        with torch.cuda.device(index):
            ok = _wgmma_ok[index] = bool(load_extension().spmm_wgmma_available())
    return ok


def kernel_choice(env: str, fallback: str, auto_wgmma_m: frozenset[int], m: int, device: torch.device | None) -> str:
    """``"wgmma"`` or ``fallback`` for group size ``m``: what ``env`` (``auto`` / ``fallback`` / ``wgmma``) forces, read
    on every call; in ``auto`` mode ``wgmma`` for the M of ``auto_wgmma_m`` where it can run (builds the extension on
    first call to ask). A forced ``wgmma`` where it cannot run is refused by the binding, which says why."""
    modes = ("auto", fallback, "wgmma")
    mode = os.environ.get(env, "auto")
    if mode not in modes:
        raise ValueError(f"hf_sparse: {env}={mode!r}; use one of {modes}")
    if mode != "auto":
        return mode
    if m not in auto_wgmma_m:
        return fallback
    return "wgmma" if wgmma_available(device or torch.device("cuda")) else fallback
