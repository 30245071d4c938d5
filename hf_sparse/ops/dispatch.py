"""Pick, per (kind, token bucket, shape, dtype, pattern), the fastest way to run a sparse linear: our kernel, dense
cuBLAS on the masked master weight, or cuSPARSELt. Each choice is measured once with CUDA events on the call's own
tensors and cached, so turning sparsity on is never slower than dense.

A V:2:M weight (M >= 8) keeps at most 2 of every M columns of a row, so every aligned 4-wide chunk of a row holds at
most 2 nonzeros: it is also a 2:4 weight (with more zeros than 2:4 needs). The 2:4 backends therefore run it too,
at 2:4 speed and without the gather of the kept columns that the V:2:M kernels pay: cuSPARSELt straight from the
masked weight, and our 2:4 kernel on a 2:4 pack of it (``"sparse24"``, built once per mask and repacked when the
values change). They leave the extra sparsity unused, but on the H200 the V:2:M kernels are slower than 2:4 at
M = 8 and 16 (``benchmarks/RESULTS.md``), so the measurement decides.

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
import time
import weakref
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cslt
from ._layout import PackedWeight, kept_columns
from .pack import pack, repack
from .sddmm import scatter_dense, sddmm
from .spmm import activate, kernel_activation, spmm, spmm_2d, spmm_function

__all__ = [
    "adopt_view24",
    "backend_mode",
    "can_measure",
    "choice",
    "choices",
    "clear_cache",
    "fastest",
    "linear_forward",
    "resolved_forward",
    "run_forward",
    "view24_of",
    "weight_grad",
]

Forward = Literal["sparse", "sparse24", "dense", "cslt"]
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

    def pop(self, t: Tensor) -> None:
        if self.get(t) is not None:
            del self._data[id(t)]

    def clear(self) -> None:
        self._data.clear()


class _Derived:
    """Something built from a packed weight's values (a cuSPARSELt ``CsltWeight``, a 2:4 view) and the packed values
    it was last built from: a repack gives ``p`` new values, which is how :func:`_derived` knows to rebuild."""

    __slots__ = ("obj", "source")

    def __init__(self, obj, source: Tensor) -> None:
        self.set(obj, source)

    def set(self, obj, source: Tensor) -> None:
        """``obj`` is now what was built from the packed values ``source``."""
        self.obj = obj
        self.source = weakref.ref(source)


_cslt_cached = _PerTensorCache()  # packed.meta -> _Derived(CsltWeight) (one per mask: plans survive repacks)
_bias_lp = _PerTensorCache()  # bias -> (its version, its copy in the compute dtype at a fixed address)
_cslt = _PerTensorCache()  # eager fallback: packed.values -> torch._cslt_compress of the weight
_cslt_algs: dict[tuple, int] = {}  # eager fallback: shape key -> algorithm found by _cslt_sparse_mm_search
_masks = _PerTensorCache()  # packed.meta -> dense bool mask (meta is shared by every repack of one mask)
_views24 = _PerTensorCache()  # V:2:M packed.meta -> _Derived(its weight packed as 2:4)


def clear_cache() -> None:
    """Forget every measured choice (e.g. after changing GPU clocks or library versions), cuSPARSELt plans and
    2:4 views too."""
    _choices.clear()
    _cslt_algs.clear()
    _cslt_cached.clear()
    _views24.clear()


def choices() -> dict[tuple, str]:
    """A copy of the measured choices, for logging."""
    return dict(_choices)


def choice(
    kind: Literal["fwd", "fwd+gelu", "fwd_train", "dw"], tokens: int, p: PackedWeight, device: torch.device
) -> str | None:
    """The measured backend for this call shape (``"sparse"``, ``"sparse24"``, ``"dense"``, ``"cslt"``), or None if
    not measured.

    ``"fwd"``: a forward on a static weight; ``"fwd+gelu"``: the same followed by the exact GELU (fused into our 2:4
    kernel); ``"fwd_train"``: on a weight that trains (see :func:`linear_forward`)."""
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


def can_measure() -> bool:
    """Whether a measurement may run now: not while torch.compile traces nor while a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return False
    return not torch.cuda.is_current_stream_capturing()


_BUSY_CYCLES = 2_000_000  # ~1 ms of GPU spin ahead of each timed call (longer than any candidate's host work)


def _fastest(candidates: dict[str, Callable[[], object]], rounds: int = 7, host_too: bool = False) -> str:
    """The candidate with the lowest median GPU time, measured in interleaved rounds.

    Each timed call is enqueued behind a ~1 ms spin kernel, so its CUDA events time the GPU's work alone: timed from
    an idle GPU, a call would also carry the host's time to issue it, and the backend with more Python would lose
    for that reason only. Rounds visit every candidate in turn, so clock ramps and other drifts during the
    measurement (it runs inside the first training step) fall on all of them alike. A candidate that raises (e.g.
    cuSPARSELt refusing a shape) is dropped.

    ``host_too``: rank by the median GPU time plus the median host time to issue the call (timed while the GPU is
    still busy with the spin, so it is the host's own time) above that of the candidate with the least: a backend
    with a heavier host side (cuSPARSELt: ~85 us per call against ~22 us for our kernel under cProfile on the H200
    machine, ``benchmarks/RESULTS.md``) must save that much GPU time to win, which is what it costs where the host
    is the limit, while candidates with the same host work (our kernels) are still ranked by GPU time alone. (Ranking
    by the larger of GPU and host time, tried first, left those to noise wherever the host time was the larger: run
    L1 picked the V:2:M kernel over the 2:4 view at 1024x1024, 2 ms of GPU time per BERT-large forward.)"""
    live, failures = {}, {}
    for name, fn in candidates.items():
        try:
            fn()  # warm-up: plans, algorithm searches, first-call allocations
        except RuntimeError as exc:
            failures[name] = exc
            continue
        live[name] = fn
    if not live:
        raise RuntimeError(f"hf_sparse.dispatch: every backend failed on this call: {failures}")
    spin = getattr(torch.cuda, "_sleep", None)  # private torch API: without it, time from an idle GPU
    times: dict[str, list[float]] = {name: [] for name in live}
    hosts: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(rounds):
        for name, fn in live.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if spin is not None:
                spin(_BUSY_CYCLES)
            start.record()
            issued = time.perf_counter()
            fn()
            hosts[name].append((time.perf_counter() - issued) * 1e3)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))

    host = {name: statistics.median(hosts[name]) for name in live}
    least_host = min(host.values())

    def cost(name: str) -> float:
        gpu = statistics.median(times[name])
        return gpu + (host[name] - least_host) if host_too and spin is not None else gpu

    return min(times, key=cost)


fastest = _fastest  # the measurement harness, for layers that keep their own measured plans


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


def _derived(cache: _PerTensorCache, p: PackedWeight, build: Callable, rebuild: Callable, force: bool):
    """The object cached for ``p``'s mask in ``cache``: ``build()`` on first use, ``rebuild(obj)`` (returning the
    new object) when ``p`` was repacked since, or always with ``force``."""
    st = cache.get(p.meta)
    if st is None:
        st = _Derived(build(), p.values)
        cache.put(p.meta, st)
    elif force or st.source() is not p.values:
        st.set(rebuild(st.obj), p.values)
    return st.obj


def _cslt_weight(weight: Tensor, p: PackedWeight, recompress: bool = False):
    """The cached ``CsltWeight`` of ``p``'s mask, holding ``weight``'s current values (recompressed after a repack,
    or always with ``recompress``: how the dispatcher prices a call whose weight changes every optimizer step)."""

    def recompressed(cw):
        cw.compress(weight.to(p.dtype).contiguous())  # in place: the plans stay
        return cw

    return _derived(_cslt_cached, p, lambda: cslt.compress(weight.to(p.dtype).contiguous()), recompressed, recompress)


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


def _view24(weight: Tensor, p: PackedWeight, repack_values: bool = False) -> PackedWeight:
    """``weight`` (the V:2:M weight ``p`` packs) packed as 2:4 for our 2:4 kernel: built in full once per mask, then
    only its values re-gathered when ``p`` was repacked (or always with ``repack_values``: how the dispatcher prices
    a call whose weight changes every optimizer step)."""
    return _derived(
        _views24,
        p,
        lambda: pack(weight.to(p.dtype).contiguous(), _dense_mask(p), 64, 4, p.dtype, validate=False),
        lambda view: repack(weight, view),
        repack_values,
    )


def view24_of(p: PackedWeight) -> PackedWeight | None:
    """The 2:4 view the dispatcher keeps for ``p``'s mask (a measured choice runs on it), or None."""
    st = _views24.get(p.meta)
    return None if st is None else st.obj


def adopt_view24(p: PackedWeight, view: PackedWeight) -> None:
    """Record ``view`` as the 2:4 view of ``p``'s current values: for a caller that repacked both together
    (:func:`hf_sparse.ops.repack_many`), so the next call does not repack the view again."""
    st = _views24.get(p.meta)
    if st is not None:
        st.set(view, p.values)


def _cslt_usable() -> bool:
    return cslt.available() or hasattr(torch, "_cslt_compress")


def _cslt_linear(x2: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None, recompress: bool = False) -> Tensor:
    """``x2 @ weight^T + bias`` by cuSPARSELt: the cached plan when the extension builds here and takes the dtype
    (bf16), else torch's eager op. ``recompress``: compress the weight again first, on either path."""
    if p.dtype in cslt.CACHED_DTYPES and cslt.available():
        return _cslt_weight(weight, p, recompress).matmul(x2, _stable_bias(bias, p.dtype), can_measure())
    comp, alg = _cslt_eager_state(weight, p, x2, recompress)
    b = None if bias is None else bias.to(p.dtype)
    return torch._cslt_sparse_mm(comp, x2.t(), b, alg_id=alg, transpose_result=True)


def linear_forward(
    x: Tensor,
    weight: Tensor,
    p: PackedWeight,
    bias: Tensor | None,
    *,
    static_weight: bool = True,
    activation: str | None = None,
) -> Tensor:
    """``act(x @ weight^T + bias)`` in ``p.dtype``; ``weight`` is the masked master (same values as ``p``).

    ``activation``: None or ``"gelu"`` (exact), measured apart: our 2:4 kernel fuses it into its epilogue, the other
    backends apply it after the product.

    ``static_weight=False`` (training: the weight changes after every optimizer step) is measured and cached apart
    (kind ``"fwd_train"``), and there every candidate but dense cuBLAS is timed with what it must redo after every
    step (:func:`_training_timed`): on the H200 cuSPARSELt's recompression costs more than it saves over cuBLAS at
    BERT shapes (``benchmarks/RESULTS.md``), and pricing it into the measurement keeps the choice honest at every
    shape. For a V:2:M ``p`` (M >= 8) the 2:4 backends are candidates too (module docstring).
    """
    mode = _mode()
    if mode == "dense":
        return run_forward("dense", x, weight, p, bias, activation)
    if not x.is_cuda or mode == "sparse":
        return spmm(x, p, bias, activation)
    kind = ("fwd" if static_weight else "fwd_train") + ("" if activation is None else "+" + activation)
    key = _key(kind, x.numel() // p.cols if p.cols else 0, p, x.device)
    choice = _choices.get(key)
    if choice is None:
        choice = _measure_forward(key, x.reshape(-1, p.cols), weight, p, bias, static_weight, activation)
    return run_forward(choice, x, weight, p, bias, activation)


def run_forward(
    choice: str, x: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None, activation: str | None = None
) -> Tensor:
    """One forward on backend ``choice`` (one :func:`choice` returned), with as little host work as possible (this
    runs on every call): for a caller that keeps the measured choice itself, :func:`linear_forward` without the
    lookup. A "cslt" choice made for a token bucket falls back to our kernel for a count cuSPARSELt cannot take."""
    b = bias if bias is None or bias.dtype == p.dtype else bias.to(p.dtype)
    if choice == "dense":
        y = F.linear(x, weight if weight.dtype == p.dtype else weight.to(p.dtype), b)
        return y if activation is None else activate(y, activation)
    lead = x.shape[:-1]
    x2 = x if len(lead) == 1 else x.reshape(-1, p.cols)
    if choice == "cslt" and x2.is_contiguous() and cslt.supports(p.rows, p.cols, x2.shape[0], p.dtype):
        y = _cslt_linear(x2, weight, p, bias)
        if activation is not None:
            y = activate(y, activation)
    elif choice == "sparse24":
        y = spmm_2d(x2, _view24(weight, p), b, activation)
    else:
        y = spmm_2d(x2, p, b, activation)
    return y.reshape(*lead, p.rows) if len(lead) != 1 else y


def resolved_forward(
    p: PackedWeight,
    weight: Tensor,
    bias: Tensor | None,
    tokens: int,
    device: torch.device,
    activation: str | None = None,
) -> Callable[[Tensor], Tensor] | None:
    """The measured forward choice for a static weight at this token count as a function of ``x`` alone (None while
    unmeasured), for a caller whose weight, bias and environment stay as they are between calls (inference): the
    backend, the kernel function, the 2:4 view and the bias cast are looked up once here instead of on every call.
    On the H200 machine's host each of those lookups costs about as much as the launch itself
    (``benchmarks/RESULTS.md``). The caller must drop the function when ``weight``, ``bias`` or ``HF_SPARSE_*``
    change."""
    kind = "fwd" if activation is None else "fwd+" + activation
    choice = _choices.get(_key(kind, tokens, p, device))
    return None if choice is None else _resolve(choice, p, weight, bias, device, activation)


def _resolve(
    choice: str,
    p: PackedWeight,
    weight: Tensor,
    bias: Tensor | None,
    device: torch.device,
    activation: str | None = None,
):
    """:func:`run_forward` for ``choice`` with everything but ``x`` looked up now (see :func:`resolved_forward`)."""
    if choice not in ("sparse", "sparse24") or p.cols % 8:  # dense cuBLAS, cuSPARSELt: their own per-call path
        return lambda x: run_forward(choice, x, weight, p, bias, activation)
    target = p if choice == "sparse" else _view24(weight, p)
    fn = spmm_function(target.m, device)
    b = _stable_bias(bias, p.dtype)
    values, meta, columns, rows, cols, m = target.values, target.meta, target.columns, p.rows, p.cols, target.m
    act, after = kernel_activation(activation, m, device)

    def run(x: Tensor) -> Tensor:
        if x.dtype != p.dtype or not x.is_contiguous() or x.data_ptr() % 16 or torch.compiler.is_compiling():
            return run_forward(choice, x, weight, p, bias, activation)  # the general path takes (or refuses) it
        y = fn(x.view(-1, cols), values, meta, columns, b, rows, cols, m, act)
        if after is not None:
            y = activate(y, after)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], rows)

    return run


def _as_resolved(
    choice: str, x2: Tensor, weight: Tensor, p: PackedWeight, bias: Tensor | None, activation: str | None = None
):
    """A measurement candidate that runs ``choice`` the way :func:`resolved_forward` will (resolved on its first
    call, the warm-up), so its host time is the one later calls pay."""
    run = None

    def call() -> Tensor:
        nonlocal run
        if run is None:
            run = _resolve(choice, p, weight, bias, x2.device, activation)
        return run(x2)

    return call


def _measure_forward(
    key: tuple,
    x2: Tensor,
    weight: Tensor,
    p: PackedWeight,
    bias: Tensor | None,
    static_weight: bool,
    activation: str | None = None,
) -> str:
    """Time every backend that can run this call, cache the fastest under ``key`` and return it (``"sparse"``,
    uncached, while nothing can be measured: CUDA-graph capture, torch.compile tracing)."""
    if not can_measure():
        return "sparse"
    b = None if bias is None else bias.to(p.dtype)
    candidates: dict[str, Callable[[], Tensor]] = {
        "sparse": lambda: spmm(x2, p, b),
        "dense": lambda: F.linear(x2, weight.to(p.dtype), b),
    }
    if p.m > 4:  # V:2:M is also 2:4 (module docstring)
        candidates["sparse24"] = lambda: spmm(x2, _view24(weight, p), b)
    if cslt.supports(p.rows, p.cols, x2.shape[0], p.dtype) and x2.is_contiguous() and _cslt_usable():
        candidates["cslt"] = lambda: _cslt_linear(x2, weight, p, bias)
    if static_weight:  # inference: often host-bound, so a backend's host time counts too (see _fastest)
        timed = {name: _as_resolved(name, x2, weight, p, bias, activation) for name in candidates}
        choice = _fastest(timed, host_too=True)
    elif activation is not None:  # the kernel path runs no activation: none of its calls has one
        raise ValueError("hf_sparse.dispatch: an activation is only measured for static weights (inference)")
    else:
        choice = _fastest(_training_timed(candidates, x2, weight, p, b, bias))
    _choices[key] = choice
    if choice != "sparse24" and "sparse24" in candidates and not _chosen_elsewhere("sparse24", p):
        _views24.pop(p.meta)  # not worth its memory
    return choice


def _training_timed(
    candidates: dict[str, Callable[[], Tensor]],
    x2: Tensor,
    weight: Tensor,
    p: PackedWeight,
    b: Tensor | None,
    bias: Tensor | None,
) -> dict[str, Callable[[], Tensor]]:
    """The candidates of a call on a weight that trains, each timed with what it costs again after every optimizer
    step: the kernel path repacks ``p`` once per step whenever a layer leaves dense cuBLAS, the 2:4 view is repacked
    too, cuSPARSELt recompresses. Dense cuBLAS needs nothing (its cast to ``p.dtype`` is autocast's anyway)."""
    timed = {"dense": candidates["dense"]}
    timed["sparse"] = lambda: (repack(weight, p), spmm(x2, p, b))[1]
    if "sparse24" in candidates:
        timed["sparse24"] = lambda: (repack(weight, p), spmm(x2, _view24(weight, p, repack_values=True), b))[1]
    if "cslt" in candidates:
        timed["cslt"] = lambda: (repack(weight, p), _cslt_linear(x2, weight, p, bias, recompress=True))[1]
    return timed


def _chosen_elsewhere(name: str, p: PackedWeight) -> bool:
    """Whether a measured choice for ``p``'s weight shape, pattern and dtype (any kind, any token bucket) uses
    backend ``name``: choices are per shape, so every layer of that shape may still call it."""
    shape = (p.rows, p.cols, p.v, p.m, p.dtype)
    return any(v == name and k[2:7] == shape for k, v in _choices.items())


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


def weight_grad(dy: Tensor, x: Tensor, p: PackedWeight, dtype: torch.dtype, choice: str | None = None) -> Tensor:
    """Dense (R, K) gradient of the master weight, zero at pruned positions, in ``dtype``. ``choice``: the measured
    backend (``"sparse"`` or ``"dense"``, from :func:`choice`) when the caller keeps it, else looked up here."""
    dy2 = dy if dy.dim() == 2 else dy.reshape(-1, p.rows)
    x2 = x if x.dim() == 2 else x.reshape(-1, p.cols)
    if choice is None:
        mode = _mode()
        if mode == "dense":
            return _masked_dense_grad(dy2, x2, p, dtype)
        choice = _choices.get(_key("dw", x2.shape[0], p, x.device)) if dy.is_cuda and mode == "auto" else "sparse"
    if choice is None:
        choice = _measure_weight_grad(dy2, x2, p, dtype)
    if choice == "dense":
        return _masked_dense_grad(dy2, x2, p, dtype)
    return scatter_dense(sddmm(dy2, x2, p), p, dtype)


def _measure_weight_grad(dy2: Tensor, x2: Tensor, p: PackedWeight, dtype: torch.dtype) -> str:
    """Time SDDMM + scatter against dense + mask, cache the faster (``"sparse"``, uncached, while nothing can be
    measured)."""
    if not can_measure():
        return "sparse"
    candidates: dict[str, Callable[[], Tensor]] = {
        "sparse": lambda: scatter_dense(sddmm(dy2, x2, p), p, dtype),
        "dense": lambda: _masked_dense_grad(dy2, x2, p, dtype),
    }
    choice = _choices[_key("dw", x2.shape[0], p, x2.device)] = _fastest(candidates)
    return choice
