"""The measurement harness behind every backend choice: time candidate calls on the GPU and name the fastest.

It holds no state. Whoever measures keeps what it measured: a compact layer
(:class:`hf_sparse.nn.compact.CompactKernel`) keeps one plan per token bucket, the cheapest of what :func:`costs`
measured once per bucket on the call's own tensors, and only when :func:`can_measure` says a measurement may run now;
in training it keeps what that plan surely saves against the masked dense layer (:func:`measure`: GPU and host time
apart).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["can_measure", "costs", "fastest", "measure", "spare_bytes"]

_BUSY_CYCLES = 2_000_000  # ~1 ms of GPU spin ahead of each timed call (longer than any candidate's host work)


def can_measure(while_tracing: bool = False) -> bool:
    """Whether a measurement may run now: not while a CUDA graph is captured, nor while torch.compile traces unless
    ``while_tracing`` (the caller is code that torch.compile runs for real during tracing, e.g. a function marked
    ``torch._dynamo.assume_constant_result``)."""
    if torch.compiler.is_compiling() and not while_tracing:
        return False
    return not torch.cuda.is_current_stream_capturing()


def spare_bytes(device: torch.device) -> int:
    """Bytes a measurement's transients may take on ``device`` without growing the process's memory: what the device
    has free plus what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def fastest(candidates: dict[str, Callable[[], object]], rounds: int = 7, host_too: bool = False) -> str:
    """The candidate with the lowest cost (:func:`costs`)."""
    measured = costs(candidates, rounds, host_too)
    return min(measured, key=measured.get)


def measure(candidates: dict[str, Callable[[], object]], rounds: int = 7) -> dict[str, tuple[float, float]]:
    """Each candidate's ``(GPU ms, host ms)``: the medians of its GPU time and of the host's time to issue it,
    measured in interleaved rounds.

    Each timed call is enqueued behind a ~1 ms spin kernel, so its CUDA events time the GPU's work alone: timed from
    an idle GPU, a call would also carry the host's time to issue it, and the backend with more Python would lose
    for that reason only. For the same reason the host time is the host's own (the GPU is still busy with the spin);
    without the spin kernel (a torch without ``torch.cuda._sleep``) it is 0. Rounds visit every candidate in turn,
    so clock ramps and other drifts during the measurement (it runs inside the first training step) fall on all of
    them alike. A candidate that raises a ``RuntimeError`` (e.g. a kernel refusing a shape) is dropped; the
    candidates that ran, in their order."""
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
    return {
        name: (statistics.median(times[name]), statistics.median(hosts[name]) if spin is not None else 0.0)
        for name in live
    }


def costs(candidates: dict[str, Callable[[], object]], rounds: int = 7, host_too: bool = False) -> dict[str, float]:
    """Each candidate's cost in ms: its median GPU time (:func:`measure`).

    ``host_too``: rank by the median GPU time plus the median host time to issue the call above that of the
    candidate with the least: a candidate with a heavier host side must save that much GPU time to win, which is
    what it costs where the host is the limit (inference, training steps of small layers), while candidates with the
    same host work are still ranked by GPU time alone. The candidates that ran, in their order."""
    measured = measure(candidates, rounds)
    least_host = min(host for _, host in measured.values())
    return {name: gpu + (host - least_host if host_too else 0.0) for name, (gpu, host) in measured.items()}
