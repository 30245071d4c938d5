"""Diagnostic: where a loaded model's prefill goes on the GPU, by kernel, for a compressed checkpoint against the same
weights dense. It answers whether a prefill ratio below the kernels' own is GPU work (plans, casts, views) or host.

    python benchmarks/profile_prefill.py [--model llama] [--configs 2:4T 64:2:8] [--calls 5] [--top 12]

For each configuration: ``bench_trainer``'s model (seeded), pruned one-shot by magnitude, saved with
``hf_sparse.save_pretrained``, loaded with ``from_pretrained(dtype=bfloat16)``; then the same weights densified
(``hf_sparse.to_dense``). Each model is warmed up (plans measured), timed (median wall ms of 10 prefills), then
profiled over ``--calls`` prefills: GPU time per kernel name, per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_trainer  # noqa: E402


def kernel_ms(model, ids, calls: int) -> dict[str, float]:
    """GPU milliseconds per prefill, by kernel name (the profiler's device events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            model(input_ids=ids)
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.name[:90]] += event.device_time / 1e3 / calls
    return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama", choices=list(bench_trainer.MODELS))
    ap.add_argument("--configs", nargs="+", default=["2:4T", "64:2:8"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    import hf_sparse

    shape = bench_trainer.MODELS[args.model]
    cls = AutoModelForMaskedLM if args.model == "bert-large" else AutoModelForCausalLM
    print(f"# {args.model} prefill, {shape['batch']} x {shape['seq']} tokens, {torch.cuda.get_device_name()}")
    for config in args.configs:
        folder = tempfile.mkdtemp(prefix="profile_prefill_")
        model = bench_trainer.build_model(args.model).to("cuda")
        pruner = hf_sparse.oneshot(model, bench_trainer.oneshot_config(config), progress=False)
        hf_sparse.save_pretrained(model, folder, pruner)
        del model, pruner
        torch.cuda.empty_cache()
        g = torch.Generator().manual_seed(2)
        loaded = cls.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
        ids = torch.randint(0, loaded.config.vocab_size, (shape["batch"], shape["seq"]), generator=g).to("cuda")
        rows = {}
        with torch.inference_mode():
            for name in (config, "dense"):
                model = loaded if name == config else hf_sparse.to_dense(loaded)  # in place, after the sparse run
                bench_trainer.forward_ms(model, ids, 5)
                wall = statistics.median(bench_trainer.forward_ms(model, ids, 10))
                kernels = kernel_ms(model, ids, args.calls)
                rows[name] = (wall, kernels)
                if name == config:
                    plans = defaultdict(int)
                    for module in model.modules():
                        kernel = getattr(module, "_kernel", None)
                        if kernel is not None:
                            for plan in kernel.plans.values():
                                plans[plan[0]] += 1
                    print(f"\n## {config}: forward plans (layers x token buckets) {dict(plans)}")
        for name, (wall, kernels) in rows.items():
            total = sum(kernels.values())
            print(f"\n### {name}: wall {wall:.2f} ms, GPU kernels {total:.2f} ms per prefill")
            for kname, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"- {ms:7.3f} ms  {kname}")
        del loaded, model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
