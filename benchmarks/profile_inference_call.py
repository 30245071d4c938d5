"""Diagnostic: the host time of one compact ``SparseLinear`` inference call at few tokens, by component, against
``nn.Linear``: where a decoding step's time goes when every layer call is host-bound.

    python benchmarks/profile_inference_call.py [--tokens 4] [--shape 11008x4096] [--patterns 2:4 64:2:8]

For each layer, under ``torch.inference_mode()`` on bf16 inputs (the plan already measured): the wall time per call of
1000 back-to-back calls while the GPU is kept busy by a spin kernel queued first (so the figure is the host's time to
issue the call, not the GPU's), for ``nn.Linear``, the layer's ``__call__``, and the extension call it ends in with
its arguments bound (``CompactKernel.resident_calls``; ``forward_compute`` where the layer is not resident); then the
top functions of a cProfile of the layer calls.
"""
# ruff: noqa: B023  (every timed lambda is called at once, inside its own loop iteration)

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from bench_compact_layer import compact_from
from torch import nn


def host_us(fn, calls: int = 1000) -> float:
    """Host microseconds per call of ``fn``, issued behind a spin kernel long enough to cover them all."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s at H100/H200 clocks: the GPU stays busy while the host issues the calls
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def print_top_functions(fn, calls: int, rows: int) -> None:
    """Print the ``rows`` Python functions with the most own host time over ``calls`` calls of ``fn`` (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--shape", default="11008x4096", help="out x in features")
    ap.add_argument("--patterns", nargs="+", default=["2:4", "64:2:8"])
    args = ap.parse_args()
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    print(f"# profile_inference_call: {torch.cuda.get_device_name()}, {args.tokens} tokens, {out_f}x{in_f}")
    x = torch.randn(args.tokens, in_f, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        dense = nn.Linear(in_f, out_f, device="cuda", dtype=torch.bfloat16)
        print(f"nn.Linear: {host_us(lambda: dense(x)):.1f} us per call")
    for pattern in args.patterns:
        layer = compact_from(nn.Linear(in_f, out_f, device="cuda", dtype=torch.bfloat16), pattern)
        with torch.inference_mode():
            layer(x)
            k = layer._kernel
            plan = k.plans[next(iter(k.plans))]
            print(f"{pattern}: plans {k.plans}, resident {layer._resident is k}")
            print(f"{pattern}: layer(x) {host_us(lambda: layer(x)):.1f} us per call")
            call = k.resident_calls.get(next(iter(k.plans))[0])
            if call is not None:  # the extension function resident_forward calls, its arguments bound
                fn, before, after = call
                alone = host_us(lambda: fn(x, *before, layer.bias, *after))
                print(f"{pattern}: the extension call alone {alone:.1f} us per call")
            else:
                alone = host_us(lambda: k.forward_compute(layer, x, plan, fuse=True))
                print(f"{pattern}: not resident; forward_compute alone {alone:.1f} us per call")
            print_top_functions(lambda: layer(x), calls=2000, rows=12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
