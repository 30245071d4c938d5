"""Never slower: what the compact fallback measures inside ``SparseTrainer.train()`` on the GPU, and what it keeps.

    python benchmarks/bench_compact_fallback.py [--models bert-large llama] [--configs 2:4T 2:4 64:2:8]
                                                [--timed 10] [--after 10] [--compile]

Each configuration trains in a fresh process the model and batch of ``bench_trainer.py`` (bf16, ``adamw_torch_fused``,
one-shot pruning at step 0, so the layers are compact from the first step) with the default
``SparsityConfig(compact_fallback="auto", compact_fallback_steps=--timed)``, for the measurement's ``2 * (3 + timed)``
steps plus ``--after`` steps. It prints one JSON line per configuration: the form kept, the two ms/step the fallback
measured (its INFO line), and the wall clock per step of the ``--after`` steps after the decision (one
``cuda.synchronize`` at each end).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> dict:
    import torch
    from bench_trainer import MODELS, RandomTokens, build_model
    from transformers import TrainerCallback, TrainingArguments

    import hf_sparse
    from hf_sparse.compact_fallback import WARMUP_STEPS

    shape = MODELS[args.model]
    decided = 2 * (WARMUP_STEPS + args.timed)
    steps = decided + args.after

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step in (decided + 1, steps):  # the first step after the decision is a warm-up
                torch.cuda.synchronize()
                setattr(self, "t0" if state.global_step == decided + 1 else "t1", time.perf_counter())

    model = build_model(args.model)
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench_fallback_"),
        max_steps=steps,
        per_device_train_batch_size=shape["batch"],
        learning_rate=1e-4,
        bf16=True,
        optim="adamw_torch_fused",
        torch_compile=args.compile,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    cfg = hf_sparse.SparsityConfig(
        score="magnitude",
        pattern=args.config.rstrip("T"),
        schedule="oneshot",
        start=0,
        transposable=args.config.endswith("T"),
        compact_fallback_steps=args.timed,
    )
    clock = Clock()
    data = RandomTokens(shape["batch"] * steps, shape["seq"], model.config.vocab_size)
    trainer = hf_sparse.SparseTrainer(
        model=model, args=targs, train_dataset=data, callbacks=[clock], sparsity_config=cfg
    )
    trainer.train()
    fallback = trainer.sparsity_callback.fallback
    return {
        "model": args.model,
        "config": args.config,
        "compile": args.compile,
        "choice": fallback.choice,
        "compact_ms": fallback.timings["compact"].ms_per_step,
        "dense_ms": fallback.timings["dense"].ms_per_step,
        "after_ms": (clock.t1 - clock.t0) * 1e3 / (steps - decided - 1),
        "gpu": torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert-large"], choices=["bert-large", "llama"])
    ap.add_argument("--configs", nargs="+", default=["2:4T", "2:4", "64:2:8"])
    ap.add_argument("--timed", type=int, default=10)
    ap.add_argument("--after", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("hf_sparse.compact_fallback").setLevel(logging.INFO)
        print(json.dumps(worker(args)), flush=True)
        return
    for model in args.models:
        for config in args.configs:
            cmd = [sys.executable, __file__, "--worker", "--model", model, "--config", config]
            cmd += ["--timed", str(args.timed), "--after", str(args.after)] + (["--compile"] if args.compile else [])
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
