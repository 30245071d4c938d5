"""Diagnostic: the same model's training forward and backward with compact layers against masked dense layers, in ONE
process, interleaved (A B A B ...), so that the host's speed, which moves a whole ``Trainer`` run by up to ±15 %
between processes, falls on both alike.

    python benchmarks/ab_training_step.py [--model bert-large] [--configs 2:4T 64:2:8] [--iters 30] [--cprofile 0]
        [--compile] [--layers N] [--batch B --seq S] [--profile-ops 0]

Per configuration: three copies of the model (bench_trainer's, random weights): dense; pruned one-shot by magnitude
with its ``nn.Linear`` layers masked by the pruner (its gradient hooks, as ``SparseTrainer`` runs them); pruned the
same way with its layers compact (``compaction.make_compact``). Each iteration runs one forward and backward of each under
bf16 autocast on the same random batch, no optimizer; it records the host's time to issue the forward, to issue the
backward, and the wall time to the end of the GPU's work (synchronised before and after). Printed: the medians over
the iterations after three warm-up ones (the compact layers measure their plans in their first), and the ratio.
``--cprofile N``: the N Python functions with the most own host time over the compact model's forwards.
``--compile``: each copy runs as ``torch.compile(model)`` (what ``TrainingArguments(torch_compile=True)`` does).
``--layers``, ``--batch``, ``--seq``: a shallower model or fewer tokens; with few tokens the GPU waits for the host, so
the figures are the host's cost of the step. ``--profile-ops N``: the N host-side operators with the most self CPU
time over the dense and the compact model's forward and backward (``torch.profiler``, CPU only).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time

import torch
from bench_trainer import MODELS, build_model, host_launch_us, oneshot_config


def one_step(model, batch) -> tuple[float, float, float]:
    """(forward host ms, backward host ms, wall ms) of one forward and backward."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3


def main() -> int:
    from hf_sparse.compaction import make_compact
    from hf_sparse.pruner import Pruner

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-large", choices=list(MODELS))
    ap.add_argument("--configs", nargs="+", default=["2:4T", "64:2:8"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--profile-ops", type=int, default=0)
    args = ap.parse_args()
    shape = dict(MODELS[args.model])
    shape.update({key: getattr(args, key) for key in ("batch", "seq") if getattr(args, key)})
    print(
        f"# ab_training_step: {torch.cuda.get_device_name()}, {args.model} ({args.layers or 'all'} layers, "
        f"{shape['batch']} x {shape['seq']} tokens{', compiled' if args.compile else ''}), "
        f"host {host_launch_us():.1f} us per op"
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30000, (shape["batch"], shape["seq"]), generator=g).cuda()
    batch = {"input_ids": ids, "labels": ids}
    print("| config | layers | forward host ms | backward host ms | wall ms | speed vs dense | vs masked dense |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for config in args.configs:
        dense = build_model(args.model, args.layers).cuda().train()
        masked, compact = copy.deepcopy(dense), copy.deepcopy(dense)
        pruners = {}
        for name, model in (("masked dense", masked), ("compact", compact)):
            pruner = Pruner(model, oneshot_config(config))
            pruner.bind(1)
            pruner.update(0)
            pruners[name] = pruner
        make_compact(compact, pruners["compact"])
        models = {"dense": dense, "masked dense": masked, "compact": compact}
        if args.compile:
            models = {name: torch.compile(model) for name, model in models.items()}
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in models}
        for i in range(args.iters + 3):
            order = list(models)[i % 3 :] + list(models)[: i % 3]  # each model first in turn
            for name in order:
                t = one_step(models[name], batch)
                if i >= 3:
                    times[name].append(t)
        medians = {name: [statistics.median(t[j] for t in ts) for j in range(3)] for name, ts in times.items()}
        for name, (fwd, bwd, wall) in medians.items():
            ratios = f"{medians['dense'][2] / wall:.3f}x | {medians['masked dense'][2] / wall:.3f}x"
            print(f"| {config} | {name} | {fwd:.2f} | {bwd:.2f} | {wall:.2f} | {ratios} |")
        if args.cprofile:
            prof = cProfile.Profile()
            for _ in range(5):
                torch.cuda.synchronize()
                prof.enable()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = models["compact"](**batch).loss
                prof.disable()
                loss.backward()
                compact.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        for name in ("dense", "compact") if args.profile_ops else ():
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = models[name](**batch).loss
                    loss.backward()
                    models[name].zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            print(f"## {name}, 3 forwards and backwards")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_ops))
        for pruner in pruners.values():
            pruner.remove_hooks()
        del dense, masked, compact, models, pruners
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
