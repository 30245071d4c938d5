"""Pick, per (kind, token bucket, shape, dtype, pattern), the fastest way to run a sparse linear: our kernel, dense
cuBLAS on the masked master weight, or cuSPARSELt (2:4 only). Each choice is measured once with CUDA events on the
call's own tensors and cached, so turning sparsity on is never slower than dense.

cuSPARSELt runs through :mod:`hf_sparse.ops.cslt` (``"cslt"``): one compressed weight per packed mask, its
values recompressed in place after each repack, and one cached plan per token count with the algorithm searched
once per token bucket, so a call is a single ``cusparseLtMatmul``. Where that extension cannot be built (no
cuSPARSELt header or library), torch's eager ``torch._cslt_sparse_mm`` (searched algorithm, but descriptors and plan
rebuilt on every call) is the fallback behind the same name.

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

from . import cslt
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

    def clear(self) -> None:
        self._data.clear()


class _CachedCslt:
    """A ``CsltWeight`` (compressed weight + plans) and the packed values it was last compressed from."""

    __slots__ = ("values", "weight")

    def __init__(self, weight, values: Tensor) -> None:
        self.weight = weight
        self.values = weakref.ref(values)


_cslt_cached = _PerTensorCache()  # packed.meta -> _CachedCslt (one per mask: plans survive repacks)
_bias_lp = _PerTensorCache()  # bias -> (its version, its copy in the compute dtype at a fixed address)
_cslt = _PerTensorCache()  # eager fallback: packed.values -> torch._cslt_compress of the weight
_cslt_algs: dict[tuple, int] = {}  # eager fallback: shape key -> algorithm found by _cslt_sparse_mm_search
_masks = _PerTensorCache()  # packed.meta -> dense bool mask (meta is shared by every repack of one mask)


def clear_cache() -> None:
    """Forget every measured choice (e.g. after changing GPU clocks or library versions), cuSPARSELt plans too."""
    _choices.clear()
    _cslt_algs.clear()
    _cslt_cached.clear()


def choices() -> dict[tuple, str]:
    """A copy of the measured choices, for logging."""
    return dict(_choices)


def choice(kind: Literal["fwd", "fwd_train", "dw"], tokens: int, p: PackedWeight, device: torch.device) -> str | None:
    """The measured backend for this call shape (``"sparse"``, ``"dense"``, ``"cslt"``), or None if not measured.

    ``"fwd"``: a forward on a static weight; ``"fwd_train"``: on a weight that trains (see :func:`linear_forward`)."""
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


def _cslt_eager_state(weight: Tensor, p: PackedWeight, x2: Tensor, recompress: bool = False):
    comp = _cslt.get(p.values)
    if comp is None or recompress:
        comp = torch._cslt_compress(weight.to(p.dtype).contiguous())
        _cslt.put(p.values, comp)
    key = _key("cslt", x2.shape[0], p, x2.device)
    alg = _cslt_algs.get(key)
    if alg is None:
        alg = _cslt_algs[key] = torch._cslt_sparse_mm_search(comp, x2.t())
    return comp, alg


def _cslt_weight(weight: Tensor, p: PackedWeight, recompress: bool = False):
    """The cached ``CsltWeight`` of ``p``'s mask, holding ``weight``'s current values (recompressed after a repack,
    or always with ``recompress``: how the dispatcher prices a call whose weight changes every optimizer step)."""
    st = _cslt_cached.get(p.meta)
    if st is None:
        st = _CachedCslt(cslt.compress(weight.to(p.dtype).contiguous()), p.values)
        _cslt_cached.put(p.meta, st)
    elif recompress or st.values() is not p.values:
        st.weight.compress(weight.to(p.dtype).contiguous())
        st.values = weakref.ref(p.values)
    return st.weight


def _stable_bias(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``bias`` in ``dtype`` at an address that stays the same across calls (a cuSPARSELt plan holds the bias
    pointer, so a fresh cast per call would cost a new plan per call); re-cast in place when the bias changes."""
    if bias is None or (bias.dtype == dtype and bias.is_contiguous()):
        return bias
    try:
        version = bias._version
    except RuntimeError:  # inference tensors keep no version: cast per call
        return bias.to(dtype).contiguous()
    hit = _bias_lp.get(bias)
    if hit is None:
        hit = (version, bias.detach().to(dtype).contiguous())
        _bias_lp.put(bias, hit)
    elif hit[0] != version:
        hit[1].copy_(bias.detach())
        _bias_lp.put(bias, (version, hit[1]))
    return hit[1]


def _cslt_usable() -> bool:
    return cslt.available() or hasattr(torch, "_cslt_compress")


def _cslt_linear(x2: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None, recompress: bool = False) -> Tensor:
    """``x2 @ weight^T + bias`` by cuSPARSELt: the cached plan when the extension builds here and takes the dtype
    (bf16), else torch's eager op. ``recompress``: compress the weight again first, on either path."""
    if p.dtype in cslt.CACHED_DTYPES and cslt.available():
        return _cslt_weight(weight, p, recompress).matmul(x2, _stable_bias(bias, p.dtype), _can_measure())
    comp, alg = _cslt_eager_state(weight, p, x2, recompress)
    b = None if bias is None else bias.to(p.dtype)
    return torch._cslt_sparse_mm(comp, x2.t(), b, alg_id=alg, transpose_result=True)


def linear_forward(
    x: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None, *, static_weight: bool = True
) -> Tensor:
    """``x @ weight^T + bias`` in ``p.dtype``; ``weight`` is the masked master (same values as ``p``).

    ``static_weight=False`` (training: the weight changes after every optimizer step) is measured and cached apart
    (kind ``"fwd_train"``), and there the cuSPARSELt candidate is timed with the recompression it then needs on every
    step: on the H200 that recompression costs more than cuSPARSELt saves over cuBLAS at BERT shapes
    (``benchmarks/RESULTS.md``), and pricing it into the measurement keeps the choice honest at every shape.
    """
    mode = _mode()
    if mode == "dense":
        return F.linear(x, weight.to(p.dtype), None if bias is None else bias.to(p.dtype))
    if not x.is_cuda or mode == "sparse":
        return spmm(x, p, bias)
    key = _key("fwd" if static_weight else "fwd_train", x.numel() // p.cols if p.cols else 0, p, x.device)
    if _choices.get(key) == "dense":  # the common case once measured: no candidate table, no reshapes
        return F.linear(x, weight.to(p.dtype), None if bias is None else bias.to(p.dtype))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.cols)
    b = None if bias is None else bias.to(p.dtype)
    candidates: dict[str, Callable[[], Tensor]] = {
        "sparse": lambda: spmm(x2, p, b),
        "dense": lambda: F.linear(x2, weight.to(p.dtype), b),
    }
    if p.m == 4 and cslt.supports(p.rows, p.cols, x2.shape[0], p.dtype) and x2.is_contiguous() and _cslt_usable():
        candidates["cslt"] = lambda: _cslt_linear(x2, weight, p, bias)
    choice = _choices.get(key)
    if choice is None:
        if not _can_measure():
            choice = "sparse"
        else:
            timed = dict(candidates)
            if "cslt" in timed and not static_weight:
                timed["cslt"] = lambda: _cslt_linear(x2, weight, p, bias, recompress=True)
            times = {}
            for name, fn in timed.items():
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
