"""Does a compact layer's measured plan hold when its weight is cold? The dispatcher (``hf_sparse.ops.dispatch``)
times its candidates back to back, so a weight that fits in the L2 stays there between rounds; in a model's forward
each layer's weight is read cold.

    python benchmarks/check_dispatch_choice.py [--patterns 2:4 64:2:8] [--tokens 1 16 64 80 95 128 256]
        [--shapes 4096x4096 ...] [--json out.jsonl]

For each (pattern, shape, token count) a bf16 compact layer (``SparseLinear`` from a magnitude-pruned ``nn.Linear``)
runs one inference call, which measures its plan. Every candidate the dispatcher compared is recorded with what the
dispatcher measured (GPU and host ms, L2 warm) and timed again after a clean L2 flush
(``gpu_timing.flushed_us(flush="read")``); ``nn.Linear`` in bf16 on the dense weight is timed the same way. Printed:
the plan, each candidate's warm and cold GPU time, and ``nn.Linear``'s cold time over the chosen candidate's
(``x dense``: above 1 the compact layer is faster than the dense layer it replaced).
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_compact_layer import compact_from
from bench_kernels import LLAMA_SHAPES, parse_shape
from gpu_timing import flushed_us
from torch import nn

from hf_sparse.ops import dispatch


class Recorder:
    """Wraps :func:`hf_sparse.ops.dispatch.measure`, which the compact layer's ranking (``dispatch.costs``) calls, to
    keep for every measurement the candidates' ``(GPU ms, host ms)`` the dispatcher ranked on and each candidate's
    cold GPU time."""

    def __init__(self) -> None:
        self.rankings: list[dict] = []
        self._measure = dispatch.measure

    def __enter__(self) -> Recorder:
        def measure(candidates, rounds=7):
            measured = self._measure(candidates, rounds)
            cold = {name: flushed_us(candidates[name], flush="read") for name in measured}
            self.rankings.append({"warm": measured, "cold_us": cold})
            return measured

        dispatch.measure = measure
        return self

    def __exit__(self, *exc) -> None:
        dispatch.measure = self._measure


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", nargs="+", default=["2:4"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 80, 95, 128, 192, 256])
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in LLAMA_SHAPES])
    ap.add_argument("--json", default=None, help="append one JSON object per row to this file")
    args = ap.parse_args()
    print(f"# check_dispatch_choice: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        "| pattern | in -> out | tokens | plan | candidates: warm GPU us / host us / cold GPU us | nn.Linear cold us "
        "| x dense |"
    )
    print("| --- | --- | ---: | --- | --- | ---: | ---: |")
    for pattern in args.patterns:
        for k, r in args.shapes:
            torch.manual_seed(0)
            layer = compact_from(nn.Linear(k, r, device="cuda", dtype=torch.bfloat16), pattern)
            dense = nn.Linear(k, r, device="cuda", dtype=torch.bfloat16)
            for n in args.tokens:
                x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                layer._drop_derived()  # a fresh kernel state: a new measurement at this token count
                with torch.inference_mode(), Recorder() as rec:
                    layer(x)
                    plan = next(iter(layer._kernel.plans.values()))
                    dense_us = flushed_us(lambda dense=dense, x=x: dense(x), flush="read")
                ranking = rec.rankings[0]
                chosen = ranking["cold_us"][plan[0]]
                cells = ", ".join(
                    f"{name} {1000 * gpu:.1f} / {1000 * host:.1f} / {ranking['cold_us'][name]:.1f}"
                    for name, (gpu, host) in ranking["warm"].items()
                )
                print(
                    f"| {pattern} | {k} -> {r} | {n} | {plan[0]} | {cells} | {dense_us:.1f} | "
                    f"{dense_us / chosen:.2f}x |",
                    flush=True,
                )
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(
                            json.dumps(
                                {
                                    "pattern": pattern,
                                    "k": k,
                                    "r": r,
                                    "tokens": n,
                                    "plan": plan[0],
                                    "warm": ranking["warm"],
                                    "cold_us": ranking["cold_us"],
                                    "dense_cold_us": dense_us,
                                }
                            )
                            + "\n"
                        )
            del layer
            del dense
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
