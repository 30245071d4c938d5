"""How much of a data-parallel BERT-large training step is gradient all-reduce, dense and with 64:2:8 masks.

A 24-layer, hidden-1024 BERT with its MLM head (built from a config, random weights), batch 8 x 512 per GPU,
bf16 autocast over fp32 master weights, fused AdamW, DDP (bucket views); the sparse run prunes the encoder's
linear layers one-shot with the ``Pruner`` (masked gradients, re-zeroed weights: what ``SparseTrainer`` does).
Each GPU keeps its batch (weak scaling), so the ideal 2-GPU step takes as long as the 1-GPU step:
scaling efficiency = t(1 GPU) / t(N GPUs).

Run one world size per launch, then summarise (NVLink multicast must stay off on the lent machines):

    export NCCL_NVLS_ENABLE=0
    torchrun --nproc_per_node 1 benchmarks/bench_ddp_comm.py --results ddp.jsonl
    torchrun --nproc_per_node 2 benchmarks/bench_ddp_comm.py --results ddp.jsonl
    python benchmarks/bench_ddp_comm.py --summarize ddp.jsonl

``--kept_allreduce`` adds, for each sparse pattern on several GPUs, a run whose DDP communication hook
(``hf_sparse.distributed.KeptGradientAllReduce``) sends only the kept positions of pruned weights' gradients.

Per case it prints the step time (median of timed steps, CUDA-synchronised), and from a ``torch.profiler`` trace
of a few steps the GPU time in NCCL kernels per step and its share of the step. NCCL kernels overlap the backward
pass, so their share is an upper bound of what communication costs; the step-time difference between 1 and 2
GPUs is what it really costs (the exposed part).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from bench_kernels import json_lines


def _build(pattern: str | None, device: torch.device, layers: int, hidden: int):
    from transformers import BertConfig, BertForMaskedLM

    from hf_sparse import Pruner, SparsityConfig

    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(config).to(device)
    pruner = None
    if pattern is not None:
        pruner = Pruner(model, SparsityConfig(score="magnitude", pattern=pattern, schedule="oneshot", start=0))
        pruner.bind(1)
        pruner.update(0)
    return model, pruner


def _batch(batch: int, seq: int, vocab: int, device: torch.device, rank: int) -> dict:
    generator = torch.Generator(device="cpu").manual_seed(1000 + rank)
    ids = torch.randint(5, vocab, (batch, seq), generator=generator)
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=generator) < 0.15  # MLM: 15% of positions carry a label
    labels[chosen] = ids[chosen]
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def _measure(args, pattern: str | None, rank: int, world: int, device: torch.device, kept_only: bool = False) -> dict:
    model, pruner = _build(pattern, device, args.layers, args.hidden)
    wrapped, hook_state = model, None
    if world > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        if kept_only:
            from hf_sparse.distributed import KeptGradientAllReduce, kept_gradient_all_reduce_hook

            hook_state = KeptGradientAllReduce(pruner)
            wrapped.register_comm_hook(hook_state, kept_gradient_all_reduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    inputs = _batch(args.batch, args.seq, model.config.vocab_size, device, rank)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = wrapped(**inputs).loss
        loss.backward()
        optimizer.step()
        if pruner is not None:
            pruner.apply()
        optimizer.zero_grad(set_to_none=False)  # keep DDP's bucket views

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    nccl_ms = total_ms = 0.0
    if device.type == "cuda" and args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps):
                step()
            sync()
        for event in prof.key_averages():
            ms = event.device_time_total / 1e3 if hasattr(event, "device_time_total") else event.cuda_time_total / 1e3
            total_ms += ms
            if "nccl" in event.key.lower():
                nccl_ms += ms
        nccl_ms /= args.profile_steps
        total_ms /= args.profile_steps
    step_ms = 1e3 * statistics.median(times)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DDP reduces fp32 master grads
    sent = hook_state.elements_sent / hook_state.elements_total if hook_state is not None else 1.0
    if pruner is not None:
        pruner.remove_hooks()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "pattern": (pattern or "dense") + (" kept-only all-reduce" if kept_only else ""),
        "world": world,
        "step_ms": round(step_ms, 2),
        "nccl_ms_per_step": round(nccl_ms, 2),
        "nccl_share_of_step": round(nccl_ms / step_ms, 3) if step_ms else None,
        "gpu_kernel_ms_per_step": round(total_ms, 2),
        "tokens_per_s_per_gpu": round(args.batch * args.seq / (step_ms / 1e3)),
        "grad_mbytes_all_reduced": round(grad_bytes * sent / 2**20) if world > 1 else 0,
        "batch": f"{args.batch}x{args.seq}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    latest = {(r["pattern"], r["world"]): r for r in rows}  # a later run of the same case replaces an earlier one
    print("| pattern | GPUs | step ms | MiB all-reduced | NCCL ms/step (share) | scaling eff. | dense/this step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (pattern, world), r in sorted(latest.items(), key=lambda kv: (kv[0][1], kv[0][0] != "dense", kv[0][0])):
        one = latest.get((pattern.replace(" kept-only all-reduce", ""), 1))
        dense = latest.get(("dense", world))  # same world size
        eff = f"{one['step_ms'] / r['step_ms']:.3f}" if one else "—"
        ratio = f"{dense['step_ms'] / r['step_ms']:.3f}" if dense and pattern != "dense" else "—"
        share = f"{r['nccl_ms_per_step']:.2f} ({100 * r['nccl_share_of_step']:.1f}%)" if world > 1 else "—"
        mib = r["grad_mbytes_all_reduced"] if world > 1 else "—"
        print(f"| {pattern} | {world} | {r['step_ms']:.2f} | {mib} | {share} | {eff} | {ratio} |")
    if rows:
        print(
            f"\n{rows[-1]['device']}, torch {rows[-1]['torch']}, batch {rows[-1]['batch']} per GPU, {rows[-1]['date']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["dense", "64:2:8"])
    parser.add_argument(
        "--kept_allreduce",
        action="store_true",
        help="with several GPUs, also time each sparse pattern with KeptGradientAllReduce (only kept positions sent)",
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile_steps", type=int, default=3)
    parser.add_argument("--results", default=None, help="append one JSON line per case (rank 0)")
    parser.add_argument("--summarize", default=None, help="print the table of a results file and exit")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if world > 1:
        if device.type == "cuda":
            torch.distributed.init_process_group("nccl", device_id=device)
        else:
            torch.distributed.init_process_group("gloo")
    try:
        cases = [(spec, False) for spec in args.patterns]
        if args.kept_allreduce and world > 1:
            cases += [(spec, True) for spec in args.patterns if spec != "dense"]
        with json_lines(args.results if rank == 0 else None) as append:
            for spec, kept_only in cases:
                result = _measure(args, None if spec == "dense" else spec, rank, world, device, kept_only)
                if rank == 0:
                    print(json.dumps(result), flush=True)
                    append(result)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
