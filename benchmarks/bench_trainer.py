"""What a user sees: ``Trainer.train()`` wall clock, dense ``Trainer`` against ``SparseTrainer``, each configuration in
a fresh process; then the saved checkpoint loaded with ``from_pretrained``: prefill time and GPU memory after
warm-up against the dense model with the same weights.

    python benchmarks/bench_trainer.py [--models bert-large llama] [--configs dense 2:4T 2:4 64:2:8]
                                       [--compile eager compiled] [--steps 50] [--warmup 30] [--no-load]
                                       [--compact-fallback auto|never] [--rounds 1]
                                       [--worker-timeout S]

Models (built from their configs, no download):

* ``bert-large``: ``BertForMaskedLM`` (24 layers, hidden 1024, 16 heads, FFN 4096), batch 16 x 512 random tokens.
* ``llama``: ``LlamaForCausalLM`` (4 layers, hidden 4096, intermediate 11008, 32 heads), batch 4 x 2048.

Training: bf16 mixed precision (fp32 master weights), ``adamw_torch_fused``, SDPA attention, no logging, saving or
evaluation during the run. Sparse configurations prune one-shot at step 0 (``schedule="oneshot"``); ``2:4T`` is
transposable 2:4. ``SparseTrainer`` keeps its default ``compact_fallback="auto"`` (it times compact against masked
dense layers over steps 0-25 and keeps the faster, on CUDA and without torch.compile), so the default window starts
after that decision. ms/step is the wall clock from the end of step ``--warmup`` to the end of the last step (one
``cuda.synchronize`` at each end, none in between, so the host's time to issue the steps is included exactly as a
user pays it), divided by the steps in between. Peak memory: ``torch.cuda.max_memory_allocated()`` over the run, and the steady
peak: over the timed steps only.

Loaded model (eager only, one fresh process each): the checkpoint ``SparseTrainer.save_model`` wrote, loaded with
``from_pretrained(dtype=torch.bfloat16)`` onto the GPU, against the same weights saved dense. Memory is
``torch.cuda.memory_allocated()`` after 5 warm-up forwards, next to the bytes of the checkpoint's tensors in bf16; prefill is
the median wall time of 20 forwards under ``inference_mode`` (synchronised around each); one-token the same for a forward
of the first token of each sequence (batch-size tokens through every linear layer, as in decoding, without a cache).

Every worker prints one JSON line; the driver prints markdown tables with ratios against dense of the same model
and mode, measured in the same run. Each training worker also reports how fast its host issues a small CUDA op
(``host_launch_us``): the lent machines' hosts differ, and a host-bound step's ratio moves with them. With
``--rounds N`` every configuration trains N times (each round in a rotated order, the checkpoints of round 0 loaded)
and a last table gives each configuration's median ratio against the dense run of its round, with the extremes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

DEVICE = "cuda"

MODELS = {
    "bert-large": {"batch": 16, "seq": 512},
    "llama": {"batch": 4, "seq": 2048},
}


def model_config(name: str, layers: int | None = None):
    """The benchmark's model ``name``; ``layers``: another number of layers (diagnostics that only need the per-layer
    cost, with a shorter torch.compile)."""
    from transformers import BertConfig, LlamaConfig

    if name == "bert-large":
        config = BertConfig(
            vocab_size=30522,
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            max_position_embeddings=512,
            attn_implementation="sdpa",
        )
    else:
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=2048,
            attn_implementation="sdpa",
        )
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def build_model(name: str, layers: int | None = None):
    import torch
    from transformers import BertForMaskedLM, LlamaForCausalLM

    torch.manual_seed(0)
    cls = BertForMaskedLM if name == "bert-large" else LlamaForCausalLM
    return cls(model_config(name, layers))


class RandomTokens:
    """A map-style dataset of random token ids (labels = inputs: MLM over every token, or the causal-LM shift)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def host_launch_us(device: str = DEVICE, calls: int = 1000) -> float:
    """Host time to issue one small op on ``device`` (µs, mean over ``calls`` back to back): how fast this lease's
    host is. A host-bound step's ratio against dense moves with it, so each worker reports it."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        x.add_(1)
    issued = (time.perf_counter() - start) / calls * 1e6
    if x.is_cuda:
        torch.cuda.synchronize()
    return issued


def oneshot_config(spec: str, **extra):
    """The benchmarks' sparsity: magnitude pruning, one-shot at step 0, to ``spec`` (a pattern, with ``T`` appended
    for transposable 2:4, e.g. ``"2:4T"``); ``extra``: further ``SparsityConfig`` fields."""
    import hf_sparse

    return hf_sparse.SparsityConfig(
        score="magnitude",
        pattern=spec.rstrip("T"),
        schedule="oneshot",
        start=0,
        end=0,
        transposable=spec.endswith("T"),
        **extra,
    )


def add_configuration_arguments(ap: argparse.ArgumentParser, mode: str, steps: int) -> None:
    """``--model``, ``--config``, ``--mode``, ``--steps``: one configuration of this benchmark, for the diagnostics
    that run one in their own process (``profile_trainer_step.py``, ``trace_trainer_phases.py``)."""
    ap.add_argument("--model", default="bert-large", choices=list(MODELS))
    ap.add_argument("--config", default="2:4T")
    ap.add_argument("--mode", default=mode, choices=["eager", "compiled"])
    ap.add_argument("--steps", type=int, default=steps)


def build_trainer(model_name: str, config: str, mode: str, steps: int, output_dir: str, callbacks: list,
                  compact_fallback: str):  # fmt: skip
    """The trainer of one configuration: ``model_name`` built from its config, ``steps`` steps on random tokens, bf16
    mixed precision, fused AdamW, nothing logged, saved or evaluated, compiled where ``mode == "compiled"``. A dense
    ``Trainer`` for ``config == "dense"``, else a ``SparseTrainer`` pruning one-shot at step 0 by magnitude (``"2:4T"``:
    transposable 2:4)."""
    from transformers import Trainer, TrainingArguments

    import hf_sparse

    shape = MODELS[model_name]
    model = build_model(model_name)
    targs = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=shape["batch"],
        learning_rate=1e-4,
        bf16=True,
        optim="adamw_torch_fused",
        torch_compile=mode == "compiled",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=True,
        seed=0,
    )
    data = RandomTokens(shape["batch"] * steps, shape["seq"], model.config.vocab_size)
    if config == "dense":
        return Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    cfg = oneshot_config(config, compact_fallback=compact_fallback)
    return hf_sparse.SparseTrainer(
        model=model, args=targs, train_dataset=data, callbacks=callbacks, sparsity_config=cfg
    )


def train_worker(args) -> dict:
    import torch
    from transformers import TrainerCallback

    shape = MODELS[args.model]
    steps, warmup = args.steps, args.warmup

    class Clock(TrainerCallback):
        """The timed window, and the host time Python's garbage collector took in it (per generation: a full
        collection walks every object torch.compile left behind)."""

        def __init__(self) -> None:
            self.t0 = self.t1 = None
            self.gc_ms = [0.0, 0.0, 0.0]
            self._gc_began = 0.0

        def on_gc(self, phase, info):
            if self.t0 is None or self.t1 is not None:
                return
            if phase == "start":
                self._gc_began = time.perf_counter()
            else:
                self.gc_ms[info["generation"]] += (time.perf_counter() - self._gc_began) * 1e3

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == warmup:
                torch.cuda.synchronize()
                self.peak_before = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()  # the steady peak: after the warm-up (and any fallback phase)
                self.t0 = time.perf_counter()
            elif state.global_step == steps:
                torch.cuda.synchronize()
                self.t1 = time.perf_counter()

    launch_us = host_launch_us()
    clock = Clock()
    gc.callbacks.append(clock.on_gc)
    out = tempfile.mkdtemp(prefix="bench_trainer_")
    trainer = build_trainer(args.model, args.config, args.mode, steps, out, [clock], args.compact_fallback)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    ms = (clock.t1 - clock.t0) * 1e3 / (steps - warmup)
    result = {
        "model": args.model,
        "config": args.config,
        "mode": args.mode,
        "ms_per_step": ms,
        "tokens_per_s": shape["batch"] * shape["seq"] / ms * 1e3,
        "peak_gib": max(clock.peak_before, torch.cuda.max_memory_allocated()) / 2**30,
        "steady_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_launch_us": launch_us,
        "gc_ms_by_generation": [round(ms, 1) for ms in clock.gc_ms],
    }
    callback = getattr(trainer, "sparsity_callback", None)
    if callback is not None and callback.pruner is not None:  # what the compact fallback decided, and on what
        fallback = callback.fallback
        result["fallback"] = fallback.choice or fallback.declined
        result["timed_ms"] = {path: t.ms_per_step for path, t in fallback.timings.items()}
        result["savings_ms"] = fallback.savings_ms
    plans = training_plans(trainer.model)
    if plans:
        result["plans"] = plans
    if args.save_dir:
        trainer.save_model(args.save_dir)
        result["saved"] = args.save_dir
    return result


def training_plans(model) -> dict[str, int]:
    """The compact layers' measured training plans, "forward/input gradient/weight gradient" -> layers."""
    plans: dict[str, int] = {}
    for module in model.modules():
        kernel = getattr(module, "_kernel", None)
        for (_, trains), plan in getattr(kernel, "plans", {}).items():
            if trains:
                plans["/".join(plan)] = plans.get("/".join(plan), 0) + 1
    return plans


def checkpoint_tensor_bytes(folder: str) -> int:
    """Bytes of the checkpoint's tensors as loaded with ``dtype=torch.bfloat16``: floating tensors at 2 bytes per
    element (a model trained with fp32 masters saves fp32 values), integer tensors (positions) as stored."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as fh:
                for key in fh.keys():
                    t = fh.get_slice(key)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    total += n * {"U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}.get(t.get_dtype(), 2)
    return total


def forward_ms(model, input_ids, count: int) -> list[float]:
    """Wall ms of ``count`` forwards of ``model`` on ``input_ids``, the device synchronized around each."""
    import torch

    times = []
    for _ in range(count):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(input_ids=input_ids)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def load_worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    import hf_sparse

    shape = MODELS[args.model]
    cls = AutoModelForMaskedLM if args.model == "bert-large" else AutoModelForCausalLM
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = cls.from_pretrained(args.load, dtype=torch.bfloat16).to(DEVICE).eval()
    loaded = torch.cuda.memory_allocated() - base
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (shape["batch"], shape["seq"]), generator=g).to(DEVICE)

    with torch.inference_mode():
        forward_ms(model, ids, 5)  # warm-up: plans measured, packs built
        after = torch.cuda.memory_allocated() - base
        prefill = statistics.median(forward_ms(model, ids, 20))
        first = ids[:, :1]  # one token per sequence: the linear layers at batch-size tokens
        forward_ms(model, first, 5)
        one_token = statistics.median(forward_ms(model, first, 20))
    result = {
        "model": args.model,
        "config": args.config,
        "prefill_ms": prefill,
        "one_token_ms": one_token,
        "gib_loaded": loaded / 2**30,
        "gib_after_warmup": after / 2**30,
        "checkpoint_tensor_gib": checkpoint_tensor_bytes(args.load) / 2**30,
        "host_launch_us": host_launch_us(),
    }
    if args.dense_out:  # the same weights, dense, for the dense row of the table
        hf_sparse.to_dense(model).save_pretrained(args.dense_out)
    return result


WORKER_TIMEOUT_S: float | None = None  # --worker-timeout


def run_worker(argv: list[str]) -> dict | None:
    """One configuration in a fresh process; its JSON line with ``process_s`` (the worker's whole wall time: start,
    model, pruning, compilation, the steps) added, or None after printing the end of its output."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    print("$", " ".join(argv), file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        log = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
        print(f"worker timed out after {WORKER_TIMEOUT_S} s", out[-2000:], log[-6000:], file=sys.stderr, flush=True)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr, flush=True)
        return None
    res = json.loads(lines[-1])
    res["process_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def dense_of(rows: list[dict], r: dict) -> dict | None:
    """The dense training run of ``r``'s model, mode and round."""
    return next(
        (
            d
            for d in rows
            if (d["model"], d["mode"], d["round"], d["config"]) == (r["model"], r["mode"], r["round"], "dense")
        ),
        None,
    )


def driver(args) -> int:
    import torch

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"# bench_trainer: {gpu}, torch {torch.__version__}, {stamp}")
    print(f"command: python benchmarks/bench_trainer.py {' '.join(sys.argv[1:])}\n")
    root = tempfile.mkdtemp(prefix="bench_trainer_ckpt_")
    train_rows, load_rows = [], []
    for model in args.models:
        for mode in args.compile:
            for rnd in range(args.rounds):  # each round starts one configuration later: no config always runs first
                shift = rnd % len(args.configs)
                for config in args.configs[shift:] + args.configs[:shift]:
                    save = (
                        os.path.join(root, f"{model}-{config.replace(':', '_')}")
                        if not args.no_load and mode == "eager" and config != "dense" and rnd == 0
                        else ""
                    )
                    argv = ["--worker", "train", "--model", model, "--config", config, "--mode", mode]
                    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--save-dir", save]
                    argv += ["--compact-fallback", args.compact_fallback]
                    res = run_worker(argv)
                    if res is not None:
                        train_rows.append({**res, "round": rnd})
        if args.no_load:
            continue
        dense_dir = ""
        for res in [r for r in train_rows if r["model"] == model and r.get("saved")]:
            dense_out = "" if dense_dir else os.path.join(root, f"{model}-dense")
            argv = ["--worker", "load", "--model", model, "--config", res["config"], "--load", res["saved"]]
            loaded = run_worker([*argv, "--dense-out", dense_out])
            if loaded is not None:
                load_rows.append(loaded)
                dense_dir = dense_dir or dense_out
        if dense_dir:
            loaded = run_worker(["--worker", "load", "--model", model, "--config", "dense", "--load", dense_dir])
            if loaded is not None:
                load_rows.append(loaded)

    print("## Training through Trainer.train()\n")
    print(
        "| model | mode | round | config | ms/step | tokens/s | vs dense | peak GiB | vs dense | steady peak GiB "
        "| vs dense |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in train_rows:
        dense = dense_of(train_rows, r)
        speed = f"{dense['ms_per_step'] / r['ms_per_step']:.3f}x" if dense else "-"
        mem = f"{r['peak_gib'] / dense['peak_gib']:.3f}x" if dense else "-"
        steady = f"{r['steady_peak_gib'] / dense['steady_peak_gib']:.3f}x" if dense else "-"
        print(
            f"| {r['model']} | {r['mode']} | {r['round']} | {r['config']} | {r['ms_per_step']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {speed} | {r['peak_gib']:.2f} | {mem} | {r['steady_peak_gib']:.2f} | {steady} |"
        )
    if args.rounds > 1:
        print(f"\n### Over {args.rounds} rounds (speed against the dense run of the same round)\n")
        print("| model | mode | config | median ms/step | median vs dense | lowest | highest |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
        for key in dict.fromkeys((r["model"], r["mode"], r["config"]) for r in train_rows):
            rows = [r for r in train_rows if (r["model"], r["mode"], r["config"]) == key]
            ratios = [d["ms_per_step"] / r["ms_per_step"] for r in rows if (d := dense_of(train_rows, r))]
            spread = (
                f"{statistics.median(ratios):.3f}x | {min(ratios):.3f}x | {max(ratios):.3f}x"
                if ratios
                else "- | - | -"
            )
            print(f"| {' | '.join(key)} | {statistics.median(r['ms_per_step'] for r in rows):.1f} | {spread} |")
    decisions = [
        f"{r['model']} {r['config']} ({r['mode']}, round {r['round']}): {r['fallback']}; sure savings, ms/step: "
        + (", ".join(f"{part} {ms:.2f}" for part, ms in r["savings_ms"].items()) if r["savings_ms"] else "-")
        + "; timed ms/step: "
        + ", ".join(f"{path} {'-' if ms is None else format(ms, '.1f')}" for path, ms in r["timed_ms"].items())
        for r in train_rows
        if "fallback" in r
    ]
    if decisions:
        print("\ncompact fallback (choice, the layers' sure saving, ms/step timed on each path):")
        print("\n".join(f"- {line}" for line in decisions))
    launches = [f"{r['config']} ({r['mode']}) {r['host_launch_us']:.1f}" for r in train_rows if "host_launch_us" in r]
    launches += [f"{r['config']} (loaded) {r['host_launch_us']:.1f}" for r in load_rows if "host_launch_us" in r]
    if launches:
        print("\nhost time to issue one small CUDA op, µs, per worker: " + ", ".join(launches))
    if load_rows:
        print("\n## Loaded with from_pretrained(dtype=bfloat16), eager prefill\n")
        print(
            "| model | checkpoint | prefill ms | vs dense | one-token ms | vs dense | GiB loaded | GiB after warm-up "
            "| checkpoint tensors GiB | after warm-up / tensors |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in load_rows:
            dense = next((d for d in load_rows if d["model"] == r["model"] and d["config"] == "dense"), None)
            speed = f"{dense['prefill_ms'] / r['prefill_ms']:.3f}x" if dense else "-"
            one = f"{dense['one_token_ms'] / r['one_token_ms']:.3f}x" if dense else "-"
            print(
                f"| {r['model']} | {r['config']} | {r['prefill_ms']:.2f} | {speed} | {r['one_token_ms']:.2f} | {one} | "
                f"{r['gib_loaded']:.2f} | "
                f"{r['gib_after_warmup']:.2f} | {r['checkpoint_tensor_gib']:.2f} | "
                f"{r['gib_after_warmup'] / r['checkpoint_tensor_gib']:.3f} |"
            )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--configs", nargs="+", default=["dense", "2:4T", "2:4", "64:2:8"])
    ap.add_argument("--compile", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps (the compact fallback decides by step 26)")
    ap.add_argument("--compact-fallback", default="auto", choices=["auto", "never"])
    ap.add_argument("--no-load", action="store_true", help="skip the from_pretrained section")
    ap.add_argument(
        "--rounds", type=int, default=1, help="train every configuration this many times, rotating the order"
    )
    ap.add_argument("--worker-timeout", type=float, help="seconds a configuration may take (its output is printed)")
    # worker arguments (one configuration per process)
    ap.add_argument("--worker", choices=["train", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    ap.add_argument("--save-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    ap.add_argument("--dense-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global WORKER_TIMEOUT_S
    WORKER_TIMEOUT_S = args.worker_timeout
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if args.rounds < 1:
        ap.error(f"--rounds ({args.rounds}) must be at least 1")
    if args.worker == "train":
        print(json.dumps(train_worker(args)))
        return 0
    if args.worker == "load":
        print(json.dumps(load_worker(args)))
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
