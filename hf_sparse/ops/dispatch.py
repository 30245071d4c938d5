"""Pick, per (kind, token bucket, shape, dtype, pattern), the fastest way to run a sparse linear: our kernel, dense
cuBLAS on the masked master weight, or cuSPARSELt (2:4 only, tuned algorithm, compressed weight cached per packed
weight). Each choice is measured once with CUDA events on the call's own tensors and cached, so turning sparsity
on is never slower than dense.

``HF_SPARSE_BACKEND=sparse|dense|auto`` (default ``auto``) forces a choice, e.g. for tests. While a CUDA graph is
being captured or torch.compile traces, nothing is measured and the cached (or sparse) choice is used.
"""

from __future__ import annotations

import os
import statistics
import weakref
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ._layout import PackedWeight, kept_columns
from .sddmm import scatter_dense, sddmm
from .spmm import spmm

__all__ = ["backend_mode", "choice", "choices", "clear_cache", "linear_forward", "weight_grad"]

Forward = Literal["sparse", "dense", "cslt"]
WeightGrad = Literal["sparse", "dense"]

_choices: dict[tuple, str] = {}


class _PerTensorCache:
    """Values attached to a live tensor (keyed by identity; tensors cannot be dict keys by value), dropped with it."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t: Tensor):
        hit = self._data.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def put(self, t: Tensor, value: object) -> None:
        key = id(t)
        self._data[key] = (weakref.ref(t, lambda _, key=key: self._data.pop(key, None)), value)


_cslt = _PerTensorCache()  # packed.values -> cuSPARSELt-compressed weight (new values after a repack: recompressed)
_cslt_algs: dict[tuple, int] = {}  # shape key -> algorithm found by _cslt_sparse_mm_search (searched once per shape)
_masks = _PerTensorCache()  # packed.meta -> dense bool mask (meta is shared by every repack of one mask)


def clear_cache() -> None:
    """Forget every measured choice (e.g. after changing GPU clocks or library versions)."""
    _choices.clear()
    _cslt_algs.clear()


def choices() -> dict[tuple, str]:
    """A copy of the measured choices, for logging."""
    return dict(_choices)


def choice(kind: Literal["fwd", "dw"], tokens: int, p: PackedWeight, device: torch.device) -> str | None:
    """The measured backend for this call shape (``"sparse"``, ``"dense"``, ``"cslt"``), or None if not measured."""
    return _choices.get(_key(kind, tokens, p, device))


def backend_mode() -> str:
    """``HF_SPARSE_BACKEND``: ``"auto"`` (measure and pick), ``"sparse"`` or ``"dense"`` (forced)."""
    return _mode()


def _mode() -> str:
    mode = os.environ.get("HF_SPARSE_BACKEND", "auto")
    if mode not in ("auto", "sparse", "dense"):
        raise ValueError(f"hf_sparse: HF_SPARSE_BACKEND={mode!r}; use auto, sparse or dense")
    return mode


def _bucket(tokens: int) -> int:
    return 1 << max(0, (tokens - 1).bit_length())


def _can_measure() -> bool:
    if torch.compiler.is_compiling():
        return False
    return not torch.cuda.is_current_stream_capturing()


def _time(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _key(kind: str, tokens: int, p: PackedWeight, device: torch.device) -> tuple:
    return (kind, _bucket(tokens), p.rows, p.cols, p.v, p.m, p.dtype, device.index)


def _cslt_state(weight: Tensor, p: PackedWeight, x2: Tensor):
    comp = _cslt.get(p.values)
    if comp is None:
        comp = torch._cslt_compress(weight.to(p.dtype).contiguous())
        _cslt.put(p.values, comp)
    key = _key("cslt", x2.shape[0], p, x2.device)
    alg = _cslt_algs.get(key)
    if alg is None:
        alg = _cslt_algs[key] = torch._cslt_sparse_mm_search(comp, x2.t())
    return comp, alg


def _cslt_linear(x2: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None) -> Tensor:
    comp, alg = _cslt_state(weight, p, x2)
    return torch._cslt_sparse_mm(comp, x2.t(), bias, alg_id=alg, transpose_result=True)


def linear_forward(x: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None) -> Tensor:
    """``x @ weight^T + bias`` in ``p.dtype``; ``weight`` is the masked master (same values as ``p``)."""
    mode = _mode()
    if mode == "dense":
        return F.linear(x, weight.to(p.dtype), None if bias is None else bias.to(p.dtype))
    if not x.is_cuda or mode == "sparse":
        return spmm(x, p, bias)
    key = _key("fwd", x.numel() // p.cols if p.cols else 0, p, x.device)
    if _choices.get(key) == "dense":  # the common case once measured: no candidate table, no reshapes
        return F.linear(x, weight.to(p.dtype), None if bias is None else bias.to(p.dtype))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.cols)
    b = None if bias is None else bias.to(p.dtype)
    candidates: dict[str, Callable[[], Tensor]] = {
        "sparse": lambda: spmm(x2, p, b),
        "dense": lambda: F.linear(x2, weight.to(p.dtype), b),
    }
    if p.m == 4 and hasattr(torch, "_cslt_compress") and x2.shape[0] % 8 == 0 and x2.is_contiguous():
        candidates["cslt"] = lambda: _cslt_linear(x2, weight, p, b)
    choice = _choices.get(key)
    if choice is None:
        if not _can_measure():
            choice = "sparse"
        else:
            times = {}
            for name, fn in candidates.items():
                try:
                    times[name] = _time(fn)
                except RuntimeError:  # e.g. cuSPARSELt refusing a shape: just not a candidate
                    continue
            choice = min(times, key=times.get)
            _choices[key] = choice
    y = candidates.get(choice, candidates["sparse"])()
    return y.reshape(*lead, p.rows)


def _dense_mask(p: PackedWeight) -> Tensor:
    mask = _masks.get(p.meta)
    if mask is None:
        mask = torch.zeros(p.rows, p.cols, dtype=torch.bool, device=p.values.device)
        mask.scatter_(1, kept_columns(p), p.valid)
        _masks.put(p.meta, mask)
    return mask


def _masked_dense_grad(dy2: Tensor, x2: Tensor, p: PackedWeight, dtype: torch.dtype) -> Tensor:
    """``dy^T x`` zeroed at pruned positions, cast to ``dtype`` in the same pass as the masking."""
    full = dy2.t() @ x2
    out = torch.empty(full.shape, dtype=dtype, device=full.device)
    return torch.mul(full, _dense_mask(p), out=out)


def weight_grad(dy: Tensor, x: Tensor, p: PackedWeight, dtype: torch.dtype) -> Tensor:
    """Dense (R, K) gradient of the master weight, zero at pruned positions, in ``dtype``."""
    mode = _mode()
    dy2 = dy.reshape(-1, p.rows)
    x2 = x.reshape(-1, p.cols)
    candidates: dict[str, Callable[[], Tensor]] = {
        "sparse": lambda: scatter_dense(sddmm(dy2, x2, p), p, dtype),
        "dense": lambda: _masked_dense_grad(dy2, x2, p, dtype),
    }
    if mode == "dense":
        return candidates["dense"]()
    if not dy.is_cuda or mode == "sparse":
        return candidates["sparse"]()
    key = _key("dw", x2.shape[0], p, x.device)
    choice = _choices.get(key)
    if choice is None:
        if not _can_measure():
            return candidates["sparse"]()
        times = {name: _time(fn) for name, fn in candidates.items()}
        choice = min(times, key=times.get)
        _choices[key] = choice
    return candidates[choice]()
