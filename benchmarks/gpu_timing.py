"""GPU time of one call, three ways, for the kernel benchmarks: how the L2 cache is left before the clock starts
decides a few-token GEMM's time.

- ``flushed_us(fn, flush="write")``: the L2 flushed the way ``triton.testing.do_bench`` flushes it, by writing 256 MB
  of zeros. The L2 then holds tens of MB of dirty lines, which the timed call writes back to DRAM while it reads its
  weight: a cost no model's forward has.
- ``flushed_us(fn, flush="read")``: the L2 flushed by reading 256 MB, so it holds clean lines only: the weight is
  cold, as in a model's forward, and nothing is written back.
- ``chain_us(fns)``: a model's forward: calls on distinct weights (together larger than the L2, so each is cold)
  issued back to back, nothing flushed; the GPU time of the chain over its length, gaps between kernels included.

Each issues its calls behind a ~1 ms sleep kernel, so the host's launch cost never shows in the GPU clock: these are
GPU times, the kernels' own and the gaps between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_FLUSH_BYTES = 256 << 20
_SLEEP_CYCLES = 2_000_000  # ~1 ms at the H100 / H200 clocks: longer than issuing a few calls on a slow host


def l2_flusher(flush: str) -> Callable[[], object]:
    """A call that flushes the L2 by ``flush`` = ``"write"`` (do_bench's 256 MB of zeros, which leaves dirty lines) or
    ``"read"`` (reading 256 MB: clean lines only); its buffer lives as long as the call."""
    if flush not in ("write", "read"):
        raise ValueError(f"flush={flush!r}: expected 'write' or 'read'")
    buf = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    return buf.zero_ if flush == "write" else buf.sum


def flushed_us(fn: Callable[[], object], flush: str = "write", reps: int = 25) -> float:
    """Median GPU time of ``fn`` in µs, after an L2 flush by ``flush`` = ``"write"`` (do_bench's) or ``"read"``."""
    flush_l2 = l2_flusher(flush)
    fn()  # warm-up: plans, kernels loaded
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush_l2()
        torch.cuda._sleep(_SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def chain_us(fns: list[Callable[[], object]], reps: int = 15) -> float:
    """Median GPU time per call, in µs, of ``fns`` issued back to back (a model's forward over distinct weights)."""
    for f in fns:
        f()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES + 100_000 * len(fns))
        start.record()
        for f in fns:
            f()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / len(fns))
    return sorted(times)[len(times) // 2]


def cold_copies(weight_bytes: int, l2_bytes: int | None = None) -> int:
    """How many distinct copies of a weight of ``weight_bytes`` a chain cycles through so that each call finds its
    weight out of the L2: together at least three L2s, and never fewer than two."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, -(-3 * l2_bytes // weight_bytes))
