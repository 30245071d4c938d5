"""BERT-large training step, dense vs SparseTrainer's kernel path, with a CUDA-time breakdown; plus inference of a
``from_pretrained``-loaded compressed checkpoint. All in one run; prints markdown tables.

    python benchmarks/bench_train_step.py [--patterns 2:4T 64:2:8 64:2:16] [--steps 10] [--masked-dense]
                                          [--no-inference] [--no-train] [--graph] [--host-profile 25]

Model: ``BertForMaskedLM`` built from ``BertConfig`` (24 layers, hidden 1024, 16 heads, FFN 4096, vocab 30522; no
download), batch 16 x 512 random tokens, fp32 master weights, bf16 autocast, fused AdamW, SDPA attention.
The sparse step is exactly what SparseTrainer runs once the masks are final: one-shot masks from
:class:`hf_sparse.Pruner`, :func:`hf_sparse.nn.kernel_path.enable_kernel_path`, and after each optimizer step
``pruner.apply(optimizer)`` (the callback's re-masking, which leaves out the layers whose fused AdamW state it has
zeroed at pruned positions). ``2:4T`` is transposable 2:4 (sparse input gradient possible).

Step time: median over ``--steps`` steps of CUDA-event time after 3 warm-up steps (the dispatcher measures during
the first). Breakdown: ``torch.profiler`` over 3 more steps, device time of every kernel summed by category.
Host time: seconds the host takes to issue one step (no synchronisation inside the timed steps): where it exceeds the
CUDA kernel time, the step is host-bound and Python is what to make faster. ``--host-profile N`` also prints the
N functions with the most self time under ``cProfile`` over 3 steps of each configuration. ``--graph`` also times
the step and the inference forward replayed from a CUDA graph (captured after the warm-up): where graph launches are
cheap, their time where the host is not the limit. (On the H200 machine they are not: replays took 2-4x the eager
time for dense and sparse alike, ``benchmarks/RESULTS.md``.)
Amdahl bound: the step time if the pruned layers' GEMMs ran at the ideal sparse speed (1/density) and nothing else
changed; the pruned layers' share of GEMM time is estimated from their FLOP share of all GEMM FLOPs.

Inference: the forward of a checkpoint saved with ``hf_sparse.save_pretrained`` and loaded with ``from_pretrained``
(``SparseLinear`` layers, the dispatcher's choices) against the dense model with the same pruned weights, timed two
ways: CUDA events around the forward (host-bound where Python issues work slower than the GPU runs it; the host time
to issue one forward is printed too) and the sum of its CUDA kernel times (``torch.profiler``: the GPU's work).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from math import nan

import torch
from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM

from hf_sparse import Pruner, SparsityConfig, save_pretrained, to_dense
from hf_sparse.nn.kernel_path import enable_kernel_path
from hf_sparse.ops import dispatch

CATEGORIES = ("linear GEMM", "attention", "elementwise/other", "optimizer", "sparse kernels", "pack/scatter")


def bert_large() -> BertConfig:
    return BertConfig(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )


def build(seed: int = 0) -> BertForMaskedLM:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return BertForMaskedLM(bert_large())


def prune(model, pattern: str) -> Pruner:
    transposable = pattern.endswith("T")
    cfg = SparsityConfig(pattern=pattern.rstrip("T"), schedule="oneshot", start=0, end=0, transposable=transposable)
    pruner = Pruner(model, cfg)
    pruner.bind(1)
    pruner.update(0)
    return pruner


def category(name: str) -> str:
    n = name.lower()
    if "hf_sparse" in n:
        return "pack/scatter" if "pack" in n else "sparse kernels"
    if "scatter" in n or "gather" in n:
        return "pack/scatter"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "flash" in n or "fmha" in n or "attention" in n or "attn" in n:
        return "attention"
    if "sparse" in n or "cusparselt" in n:
        return "sparse kernels"
    if any(t in n for t in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "sm80_", "wgmma")):
        return "linear GEMM"
    return "elementwise/other"


def make_step(model, pruner, batch: int, seq: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 30522, (batch, seq), device="cuda", generator=gen)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pruner is not None:
            pruner.apply(opt)

    return step


def graphed_step(model, pruner, batch: int, seq: int):
    """The step of :func:`make_step` captured in one CUDA graph (PyTorch's whole-network recipe: a capturable fused
    AdamW of its own, gradients allocated inside the graph, autocast without its cast cache); returns the replay.
    Replayed, the step costs the host one call, so its time is the GPU's: the step where the host is not the limit.
    Everything the kernel path does between steps is in the graph too (the batched repack at the first stale layer,
    the masking after the optimizer step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)
    ids = torch.randint(0, 30522, (batch, seq), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if pruner is not None:
            pruner.apply(opt)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def time_steps(step, n: int) -> float:
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(run):
    """``run`` captured once in a CUDA graph; returns the replay. A replay costs the host one call, so its time is
    the GPU's: what the forward takes where the host is not the limit (or under torch.compile's "reduce-overhead")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def host_ms(step, n: int) -> float:
    """Host time to issue one step (ms; median over ``n`` steps): no synchronisation inside the timed steps, so
    where the GPU is the limit the host runs ahead and this is the host's own time."""
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def print_host_profile(step, top: int, n: int = 3) -> None:
    """The ``top`` functions by self time under cProfile over ``n`` steps (ms per step)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # (cc, nc, tottime, cumtime, callers)
    print(f"    host profile ({n} steps; ms per step: self, cumulative; calls per step; function):")
    for (file, line, func), (_, calls, self_s, cum_s, _) in rows:
        where = "/".join(file.rsplit("/", 2)[-2:]) + f":{line}"
        print(f"    {self_s / n * 1e3:8.3f} {cum_s / n * 1e3:8.3f} {calls / n:8.0f}  {func} ({where})")


def breakdown(step, n: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """(ms per step by category, top kernels' ms per step) from torch.profiler device times."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    cats: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.device_time_total / 1e3 / n if hasattr(evt, "device_time_total") else evt.cuda_time_total / 1e3 / n
        cats[category(evt.name)] += ms
        kernels[evt.name[:90]] += ms
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    return dict(cats), top


def gemm_flop_share_pruned(cfg: BertConfig) -> float:
    """Fraction of the linear-GEMM FLOPs (encoder linears + MLM head; SDPA's attention GEMMs are counted as
    attention) spent in the prunable encoder linears."""
    h, f, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    pruned = layers * (4 * h * h + 2 * h * f)
    head = h * h + h * v
    return pruned / (pruned + head)


def routes(model) -> str:
    counts: dict[str, int] = defaultdict(int)
    for module in model.modules():
        state = module.__dict__.get("_hf_sparse_kernel")
        if state is not None:
            for route in set(state.routes.values()) or {"undecided"}:
                counts[route] += 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def train_section(args) -> None:
    cfg = bert_large()
    share = gemm_flop_share_pruned(cfg)
    rows = []
    dense_ms = dense_replay = None
    configs = ["dense", *args.patterns] + [f"{p} masked-dense" for p in args.patterns if args.masked_dense]
    for pattern in configs:
        gc.collect()  # the last configuration's model and pruner (reference cycles): not left to slow this one's host
        torch.cuda.empty_cache()
        model = build()
        pruner = None
        t0 = time.perf_counter()
        if pattern != "dense":
            pruner = prune(model, pattern.split()[0])
        if pruner is not None and not pattern.endswith("masked-dense"):  # masked-dense: SparsityConfig.kernels="never"
            switched = enable_kernel_path(model, pruner)
            if len(switched) != len(pruner.layers):
                print(f"  {pattern}: only {len(switched)}/{len(pruner.layers)} layers on the kernel path")
        setup = time.perf_counter() - t0
        step = make_step(model, pruner, args.batch, args.seq)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        ms = time_steps(step, args.steps)
        host = host_ms(step, args.steps)
        # before any torch.profiler use, which may leave graph replays slower
        replay = time_steps(graphed_step(model, pruner, args.batch, args.seq), args.steps) if args.graph else nan
        cats, top = breakdown(step)
        dense_ms = dense_ms or ms
        dense_replay = dense_replay or replay
        rows.append((pattern, ms, host, cats, routes(model), setup, replay))
        print(f"## {pattern}: {ms:.2f} ms/step, host {host:.2f} ms (setup {setup:.1f} s); top kernels, ms per step:")
        for name, t in top.items():
            print(f"    {t:7.3f}  {name}")
        if args.host_profile:
            print_host_profile(step, args.host_profile)
        sys.stdout.flush()
        del model, pruner, step
    print("\n### Training step, BERT-large, batch 16 x 512, bf16 autocast, fused AdamW (ms per step)\n")
    head = "| config | step (wall) | x dense | host time | CUDA kernel time | x dense | " + " | ".join(CATEGORIES)
    print(head + " | routes | step from a CUDA graph | x dense |")
    print("|" + "---|" * (len(CATEGORIES) + 9))
    dense_gpu = sum(rows[0][3].values())
    for pattern, ms, host, cats, rt, _, replay in rows:
        cells = " | ".join(f"{cats.get(c, 0.0):.2f}" for c in CATEGORIES)
        gpu = sum(cats.values())
        print(
            f"| {pattern} | {ms:.2f} | {dense_ms / ms:.3f} | {host:.2f} | {gpu:.2f} | {dense_gpu / gpu:.3f} | {cells} "
            f"| {rt} | {replay:.2f} | {dense_replay / replay:.3f} |"
        )
    cats = rows[0][3]
    total = sum(cats.values())
    gemm = cats.get("linear GEMM", 0.0)
    print(
        f"\nDense step: CUDA kernel time {total:.2f} ms/step, linear GEMMs {gemm:.2f} ms ({100 * gemm / total:.1f}%);"
        f" prunable encoder linears = {100 * share:.1f}% of GEMM FLOPs."
    )
    print("\n| pattern | density | Amdahl bound (pruned GEMMs at 1/density, rest unchanged) | GEMMs free |")
    print("|---|---|---|---|")
    pruned_ms = gemm * share
    for pattern in args.patterns:
        spec = pattern.rstrip("T")
        parts = [int(p) for p in spec.split(":")]
        density = parts[-2] / parts[-1]
        bound = total / (total - pruned_ms + pruned_ms * density)
        print(f"| {pattern} | {density:.3f} | {bound:.3f}x | {total / (total - pruned_ms):.3f}x |")


def gemm_ms(cats: dict[str, float]) -> float:
    return cats.get("linear GEMM", 0.0) + cats.get("sparse kernels", 0.0)


def inference_section(args) -> None:
    print("\n### Inference forward of a from_pretrained-loaded checkpoint, batch 16 x 512, bf16 (ms)\n")
    model = build().eval()
    ids = torch.randint(0, 30522, (args.batch, args.seq), device="cuda")
    pruner = prune(model, args.inference_pattern)
    dense = build().eval().to(torch.bfloat16)
    dense.load_state_dict(model.state_dict())  # same pruned weights, plain dense modules

    def fwd(m):
        def run():
            with torch.no_grad():
                m(input_ids=ids)

        return run

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, pruner)
        del model
        loaded = AutoModelForMaskedLM.from_pretrained(tmp, dtype=torch.bfloat16).cuda().eval()
    rows = {}
    models = (("dense (same pruned weights)", dense), (f"loaded {args.inference_pattern}", loaded))
    for name, m in models:
        run = fwd(m)
        for _ in range(3):  # the first call measures the dispatcher's choices (never during a capture)
            run()
        eager = time_steps(run, args.steps)
        host = host_ms(run, args.steps)  # host time to issue one forward: shows when Python is the limit
        replay = time_steps(graphed(run), args.steps) if args.graph else nan  # before torch.profiler
        if args.host_profile:
            print(f"## inference, {name}: host {host:.2f} ms per forward")
            print_host_profile(run, args.host_profile)
        cats, _ = breakdown(run)
        rows[name] = (eager, host, sum(cats.values()), gemm_ms(cats), replay)
    to_dense(loaded)
    run = fwd(loaded)
    for _ in range(3):
        run()
    eager, replay = time_steps(run, args.steps), time_steps(graphed(run), args.steps) if args.graph else nan
    cats, _ = breakdown(run)
    rows[f"loaded {args.inference_pattern}, then hf_sparse.to_dense"] = (
        eager,
        float("nan"),
        sum(cats.values()),
        gemm_ms(cats),
        replay,
    )
    print(
        "| model | forward | x dense | host time to issue it | CUDA kernel time | x dense | linear GEMM + sparse "
        "| forward from a CUDA graph | x dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = next(iter(rows.values()))
    for name, (eager, host, kern, gemm, replay) in rows.items():
        print(
            f"| {name} | {eager:.2f} | {base[0] / eager:.3f} | {host:.2f} | {kern:.2f} | {base[2] / kern:.3f} | "
            f"{gemm:.2f} | {replay:.2f} | {base[4] / replay:.3f} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", nargs="+", default=["2:4T", "64:2:8", "64:2:16"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--inference-pattern", default="64:2:8")
    ap.add_argument("--no-inference", action="store_true")
    ap.add_argument("--no-train", action="store_true", help="inference section only")
    ap.add_argument("--graph", action="store_true", help="also time the step and forward replayed from a CUDA graph")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N", help="print the N top host functions")
    ap.add_argument(
        "--masked-dense", action="store_true", help="also time each pattern with the pruner but no kernel path"
    )
    args = ap.parse_args()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )
    if not args.no_train:
        train_section(args)
    if not args.no_inference:
        inference_section(args)
    print("\ndispatcher choices:", {k: v for k, v in dispatch.choices().items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
