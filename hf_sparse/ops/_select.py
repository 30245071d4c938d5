"""Which CUDA kernel an op runs: the sm_90a ``wgmma`` one where it can run and was measured faster, else the sm_80+
warp-level one; an environment variable forces either (tests, benchmarks). Shared by :mod:`.spmm` and :mod:`.sddmm`.
"""

from __future__ import annotations

import os

import torch

__all__ = ["kernel_choice", "kernel_function", "wgmma_available"]

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


_functions: dict[tuple, object] = {}  # (env, its value, m, device index, names) -> the extension function


def kernel_function(
    env: str, fallback: str, auto_wgmma_m: frozenset[int], m: int, device: torch.device, names: tuple[str, str]
):
    """The extension function :func:`kernel_choice` picks (``names``: the ``wgmma`` one, then the ``fallback`` one),
    looked up once per (env setting, m, device): the ops call this on every launch, and the choice's Python (env
    validation, the capability query, the build check) would cost more host time than the launch itself."""
    key = (env, os.environ.get(env), m, device.index, names)
    fn = _functions.get(key)
    if fn is None:
        from ._build import load_extension

        wgmma = kernel_choice(env, fallback, auto_wgmma_m, m, device) == "wgmma"
        fn = _functions[key] = getattr(load_extension(), names[0] if wgmma else names[1])
    return fn
