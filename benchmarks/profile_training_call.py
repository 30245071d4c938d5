"""Diagnostic: the host time of one compact ``SparseLinear`` training call (forward, then forward and backward), by
component, against the ``nn.Linear`` it replaces under bf16 autocast: where a host-bound training forward (BERT-large on
a slow host) spends its time per layer.

    python benchmarks/profile_training_call.py [--tokens 8192] [--shape 4096x1024] [--patterns 2:4T 64:2:8]

Each layer takes an fp32 input that requires grad under ``torch.autocast("cuda", torch.bfloat16)``, as a BERT layer
after its LayerNorm does, with its plan already measured. Printed per layer: the wall time per call of 200
back-to-back calls while the GPU is kept busy by a spin kernel queued first (so the figure is the host's time to issue
the work, not the GPU's), for the forward alone and for the forward with its backward; for the compact layer also the
extension's ``compact_linear`` alone, its arguments bound, and, without autograd, that function against the
dispatcher op ``hf_sparse::compact_linear`` that a compiled graph calls (the difference is the dispatcher's cost of
the op's arguments) and ``torch.mm`` of the same shapes; then the host-side ops of the compact forward by self CPU
time (``torch.profiler``, CPU only) and the top Python functions (cProfile).
"""
# ruff: noqa: B023  (every timed lambda is called at once, inside its own loop iteration)

from __future__ import annotations

import argparse

import torch
from bench_compact_layer import compact_from
from profile_inference_call import host_us, print_top_functions
from torch import nn

import hf_sparse.nn.compiled  # noqa: F401  (defines the hf_sparse::compact_linear op)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shape", default="4096x1024", help="out x in features")
    ap.add_argument("--patterns", nargs="+", default=["2:4T", "64:2:8"])
    args = ap.parse_args()
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    print(f"# profile_training_call: {torch.cuda.get_device_name()}, {args.tokens} tokens, {out_f}x{in_f}")
    x = torch.randn(args.tokens, in_f, device="cuda", requires_grad=True)
    dy = torch.randn(args.tokens, out_f, device="cuda", dtype=torch.bfloat16)
    layers = {"nn.Linear": nn.Linear(in_f, out_f, device="cuda")}
    for pattern in args.patterns:
        layers[pattern] = compact_from(nn.Linear(in_f, out_f, device="cuda"), pattern)
    for name, layer in layers.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x).backward(dy)  # the plan is measured here
            forward = host_us(lambda: layer(x), calls=200)
            both = host_us(lambda: layer(x).backward(dy), calls=200)
            print(f"{name}: forward {forward:.1f} us, forward + backward {both:.1f} us per call")
            k = getattr(layer, "_kernel", None)
            if k is None:
                continue
            plan = k.plans[next(key for key in k.plans if key[1])]
            print(f"{name}: training plan {plan}")
            bound = k.native_arguments(layer, plan, True)
            alone = host_us(lambda: k.native(x, layer.weight, layer.bias, *bound), calls=200)
            print(f"{name}: compact_linear alone {alone:.1f} us per call")
            x2 = x.detach().to(torch.bfloat16)
            w2 = layer.weight.detach().new_empty(out_f, in_f, dtype=torch.bfloat16).normal_()
            op = torch.ops.hf_sparse.compact_linear.default
            with torch.no_grad():
                native = host_us(lambda: k.native(x2, layer.weight, layer.bias, *bound), calls=200)
                dispatched = host_us(lambda: op(x2, layer.weight, layer.bias, *bound), calls=200)
                mm = host_us(lambda: torch.mm(x2, w2.t()), calls=200)
            print(
                f"{name}: without autograd: compact_linear {native:.1f} us, hf_sparse::compact_linear op "
                f"{dispatched:.1f} us, torch.mm {mm:.1f} us per call"
            )
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(100):
                    layer(x)
            torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            print_top_functions(lambda: layer(x), calls=500, rows=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
