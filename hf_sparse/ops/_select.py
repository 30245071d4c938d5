"""Which CUDA kernel an op runs, in one place: a pure choice function, and :func:`force_kernel` to override it.

SpMM runs the sparse-``wgmma`` kernel (sm_90a: ``csrc/spmm_sm90.cu`` for 2:4, ``csrc/spmm_vnm_sm90.cu`` for V:2:M)
where it can run and was measured faster than the ``mma.sp`` one (``csrc/spmm.cu``, sm_80+), i.e. for the group
sizes of :data:`SPMM_WGMMA_M`; SDDMM likewise runs ``csrc/sddmm_sm90.cu`` (dense ``wgmma``) over ``csrc/sddmm.cu``
(``mma.sync``) for :data:`SDDMM_WGMMA_M`. :func:`choose_kernel` is that rule and nothing else (no device query, no
state); :func:`kernel_function` applies it to a device, with what :func:`force_kernel` forces, and returns the
extension function. A compact layer (:mod:`hf_sparse.nn.compact`) asks once, when it makes its plan; the ops
:func:`hf_sparse.ops.spmm` / :func:`hf_sparse.ops.sddmm` ask on each call (one dict lookup).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "KERNELS",
    "SDDMM_WGMMA_M",
    "SPMM_WGMMA_M",
    "choose_kernel",
    "device_kernel",
    "force_kernel",
    "forced_kernel",
    "kernel_function",
    "wgmma_available",
]

#: op -> (its sm_80+ kernel, its sm_90a kernel): the names :func:`force_kernel` takes besides ``"auto"``
KERNELS = {"spmm": ("mma_sp", "wgmma"), "sddmm": ("mma", "wgmma")}

# Group sizes M at which the wgmma kernel runs where it can (benchmarks/RESULTS.md, "the V:2:M X^T path"). SpMM: every
# M. At M >= 16 against mma.sp: 1.05-4.8x at 16-64 tokens, 2.9-4.5x at 8192 tokens on the V:2:M kernel's X^T path
# (from 65 tokens on 1024 rows and more, at V = 64 on 1024 from 256 tokens, ``sm90_vnm_xt``); its register gather
# measured 0.6-2.1x of mma.sp at 256-512 tokens, which it now runs only below 1024 rows: there a compact layer's
# measured plan takes the weight's 2:4 view, faster than both in every such cell measured. SDDMM: see below.
SPMM_WGMMA_M = frozenset({4, 8, 16, 32, 64, 128})
# SDDMM, "SDDMM with dense wgmma": 3.8-5.2x at M = 4, 1.7-2.2x at 8, 1.5-1.9x at 16, 0.98-1.6x at 32; M = 64 and 128
# are not timed.
SDDMM_WGMMA_M = frozenset({4, 8, 16, 32})
_WGMMA_M = {"spmm": SPMM_WGMMA_M, "sddmm": SDDMM_WGMMA_M}

_forced: dict[str, str] = {}  # op -> the kernel force_kernel set; absent: auto


def choose_kernel(op: str, m: int, wgmma_ok: bool, forced: str | None = None) -> str:
    """The kernel ``op`` (``"spmm"`` / ``"sddmm"``) runs for group size ``m``: ``forced`` where given (a kernel name
    of :data:`KERNELS`, or ``"auto"``/None), else the wgmma one where ``wgmma_ok`` (a cc 9.0 GPU and an sm_90a build)
    and ``m`` is one it was measured faster at, else the sm_80+ one. Pure: no device, no environment."""
    fallback, wgmma = KERNELS[op]
    if forced not in (None, "auto"):
        if forced not in KERNELS[op]:
            raise ValueError(f"hf_sparse.ops.force_kernel: {op}={forced!r}; use one of {('auto', *KERNELS[op])}")
        return forced
    return wgmma if wgmma_ok and m in _WGMMA_M[op] else fallback


def forced_kernel(op: str) -> str | None:
    """The kernel :func:`force_kernel` forces on ``op`` now, or None (auto)."""
    return _forced.get(op)


@contextlib.contextmanager
def force_kernel(spmm: str | None = None, sddmm: str | None = None) -> Iterator[None]:
    """Force the CUDA kernel of SpMM (``"mma_sp"`` / ``"wgmma"`` / ``"auto"``) and / or SDDMM (``"mma"`` / ``"wgmma"``
    / ``"auto"``) inside the block, for every thread of the process; None leaves an op as it is. Read when a plan is
    made: by each op call, and by a compact layer when it builds its kernel state (a layer built inside the block
    keeps the forced kernels after it). A forced ``"wgmma"`` where it cannot run is refused by the kernel call,
    which says why.

    >>> with hf_sparse.ops.force_kernel(spmm="mma_sp"):
    ...     y = hf_sparse.ops.spmm(x, packed)
    """
    for op, kernel in (("spmm", spmm), ("sddmm", sddmm)):
        if kernel is not None:
            choose_kernel(op, 4, False, kernel)  # validates the name
    before = dict(_forced)
    try:
        for op, kernel in (("spmm", spmm), ("sddmm", sddmm)):
            if kernel == "auto":
                _forced.pop(op, None)
            elif kernel is not None:
                _forced[op] = kernel
        yield
    finally:
        _forced.clear()
        _forced.update(before)


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


def device_kernel(op: str, m: int, device: torch.device | None) -> str:
    """:func:`choose_kernel` on ``device`` with what :func:`force_kernel` forces now; asks the extension (building it
    on first use) whether the wgmma kernels run there only when that decides."""
    forced = _forced.get(op)
    if forced is not None or m not in _WGMMA_M[op]:
        return choose_kernel(op, m, False, forced)
    return choose_kernel(op, m, wgmma_available(device or torch.device("cuda")))


_functions: dict[tuple, object] = {}  # (op, forced kernel, m, device index) -> the extension function
_NAMES = {  # (op, kernel) -> the extension function that runs it
    ("spmm", "mma_sp"): "spmm",
    ("spmm", "wgmma"): "spmm_wgmma",
    ("sddmm", "mma"): "sddmm",
    ("sddmm", "wgmma"): "sddmm_wgmma",
}


def kernel_function(op: str, m: int, device: torch.device):
    """The extension function of the kernel :func:`device_kernel` picks, looked up once per (forced kernel, m,
    device): the ops call this on every launch, and the choice itself would cost more host time than the launch."""
    key = (op, _forced.get(op), m, device.index)
    fn = _functions.get(key)
    if fn is None:
        from ._build import load_extension

        fn = _functions[key] = getattr(load_extension(), _NAMES[(op, device_kernel(op, m, device))])
    return fn
