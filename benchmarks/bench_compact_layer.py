"""One compact ``SparseLinear`` against ``nn.Linear`` under bf16 autocast: a training step's forward and backward
(and an fp32-master optimizer-style write) and an inference forward, wall clock with the host included.

    python benchmarks/bench_compact_layer.py [--tokens 8192] [--patterns 2:4T 2:4 64:2:8] [--iters 50]

Shapes are BERT-large's and the Llama-style model's projections. Each figure is the median over ``--iters``
iterations of the wall time of 10 back-to-back calls (synchronised at both ends), divided by 10, so the host's time
to issue the work counts as it does in a training step. Also printed: the plans each layer measured (training and inference).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_trainer import oneshot_config
from torch import nn

from hf_sparse import Pruner
from hf_sparse.nn import SparseLinear

SHAPES = [(1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096), (11008, 4096), (4096, 11008)]


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 100.0)  # ms per call
    return statistics.median(out)


def compact_from(linear: nn.Linear, pattern: str) -> SparseLinear:
    wrapper = nn.Sequential(linear)
    pruner = Pruner(wrapper, oneshot_config(pattern, targets=[r"^0$"]))
    pruner.bind(1)
    pruner.update(0)
    mask = pruner.masks["0"]
    pruner.remove_hooks()
    return SparseLinear.from_dense(linear, mask, pruner.current_pattern())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--patterns", nargs="+", default=["2:4T", "2:4", "64:2:8"])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    print(f"# bench_compact_layer: {torch.cuda.get_device_name()}, torch {torch.__version__}, tokens {args.tokens}")
    print(
        "| out x in | pattern | train dense ms | train compact ms | ratio | infer dense ms | infer compact ms "
        "| ratio | plan |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for out_f, in_f in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(args.tokens, in_f, device="cuda", requires_grad=True)
        dy = torch.randn(args.tokens, out_f, device="cuda", dtype=torch.bfloat16)
        dense = nn.Linear(in_f, out_f, device="cuda")

        def train(layer, x=x, dy=dy):
            def run():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = layer(x)
                y.backward(dy)
                with torch.no_grad():  # what the optimizer step does to the weight: a write that bumps it
                    layer.weight.add_(layer.weight.grad, alpha=-1e-9)
                    layer.weight.grad = None
                x.grad = None

            return run

        def infer(layer, x=x):
            xb = x.detach().to(torch.bfloat16)

            def run():
                with torch.inference_mode():
                    layer(xb)

            return run

        t_dense = timed(train(dense), args.iters)
        dense_bf16 = nn.Linear(in_f, out_f, device="cuda", dtype=torch.bfloat16)
        i_dense = timed(infer(dense_bf16), args.iters)
        for pattern in args.patterns:
            layer = compact_from(nn.Linear(in_f, out_f, device="cuda"), pattern)
            try:
                t_c = timed(train(layer), args.iters)
                plan = layer._kernel.plans if layer._kernel is not None else None
                inf_layer = compact_from(nn.Linear(in_f, out_f, device="cuda", dtype=torch.bfloat16), pattern)
                i_c = timed(infer(inf_layer), args.iters)
                plan = (plan or {}) | (inf_layer._kernel.plans if inf_layer._kernel is not None else {})
            except Exception as exc:  # report and go on: one shape must not hide the others
                print(f"| {out_f}x{in_f} | {pattern} | {t_dense:.3f} | error: {exc!r} |")
                continue
            print(
                f"| {out_f}x{in_f} | {pattern} | {t_dense:.3f} | {t_c:.3f} | {t_dense / t_c:.3f}x | {i_dense:.3f} | "
                f"{i_c:.3f} | {i_dense / i_c:.3f}x | {plan} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
