"""Where a host-bound ``Trainer`` step loses its time, without a profiler: for each phase of a step, the host's time
in it and how far the GPU runs behind the host at its end.

    python benchmarks/trace_trainer_phases.py --model bert-large --config 2:4T [--steps 45] [--warmup 30]

One configuration of ``bench_trainer.py`` per process (the same trainer). Each phase boundary records the host's
clock and a CUDA event; one ``cuda.synchronize`` at the end of step ``--warmup`` anchors both clocks, none follows
until the run ends. Boundaries: ``on_step_begin``, ``training_step`` entered, the model's forward returned,
``training_step`` returned (backward issued), ``on_pre_optimizer_step`` (after ``Trainer``'s NaN check of the loss
and gradient clipping), ``on_optimizer_step``, ``on_step_end``.

Printed per phase (means over the timed steps): the host's time in the phase, the GPU's (event to event) and the
GPU's lag behind the host at the phase's end (event time minus host time). A lag near zero means the GPU waited for
the host there; a phase whose host time is large while the lag at its start was large and at its end near zero is the
host waiting in a synchronisation. ``--cprofile`` adds the host's Python functions by own time over the timed steps
(``cProfile`` slows the host, so the phase table is then not comparable); ``--sync-debug`` prints each call site
that synchronises with the GPU during the first timed step (``torch.cuda.set_sync_debug_mode``). A diagnostic, not the benchmark: ``bench_trainer.py`` times what a user sees.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
import traceback
import warnings

import torch
from bench_trainer import add_configuration_arguments, build_trainer, host_launch_us, training_plans
from transformers import TrainerCallback


class PhaseClock(TrainerCallback):
    """Records (host seconds, CUDA event) at every phase boundary of the steps after ``warmup``."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.anchor = None
        self.marks: list[tuple[int, str, float, torch.cuda.Event]] = []
        self.step = 0

    def mark(self, name: str) -> None:
        if self.anchor is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((self.step, name, time.perf_counter(), event))

    def on_step_begin(self, args, state, control, **kw):
        self.step = state.global_step
        self.mark("step_begin")

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.mark("pre_optimizer")

    def on_optimizer_step(self, args, state, control, **kw):
        self.mark("optimizer_done")

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.warmup:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self.anchor = (time.perf_counter(), event)
            return
        self.mark("step_end")


class HostDiagnostics(TrainerCallback):
    """``cProfile`` over the timed steps and the synchronising call sites of the first one."""

    def __init__(self, warmup: int, steps: int, rows: int, sync_debug: bool) -> None:
        self.warmup, self.steps, self.rows, self.sync_debug = warmup, steps, rows, sync_debug
        self.profile = cProfile.Profile() if rows else None
        self.sites: dict[str, int] = {}

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.warmup:
            if self.sync_debug:
                torch.cuda.set_sync_debug_mode("warn")
                warnings.simplefilter("always")
                warnings.showwarning = self.record_site
            if self.profile is not None:
                self.profile.enable()
        if state.global_step == self.warmup + 1 and self.sync_debug:
            torch.cuda.set_sync_debug_mode(0)
            for site, count in self.sites.items():
                print(f"synchronising call, {count}x:\n{site}")
        if state.global_step == self.steps and self.profile is not None:
            self.profile.disable()
            stats = pstats.Stats(self.profile)
            stats.sort_stats("tottime").print_stats(self.rows)

    def record_site(self, message, category, filename, lineno, file=None, line=None):
        site = "".join(traceback.format_stack(limit=9)[:-2])
        self.sites[site] = self.sites.get(site, 0) + 1


def instrument(trainer, clock: PhaseClock) -> None:
    """Marks ``training_step``'s entry and return and the model's forward return."""
    step = trainer.training_step

    def training_step(*a, **kw):
        clock.mark("step_entered")
        loss = step(*a, **kw)
        clock.mark("backward_issued")
        return loss

    trainer.training_step = training_step
    trainer.model.register_forward_hook(lambda *_: clock.mark("forward_done"))


def summarise(clock: PhaseClock) -> dict:
    """Means per phase, a phase named by the boundary that ends it (``step_begin``: from the previous step's end,
    i.e. the data loader and ``Trainer``'s bookkeeping)."""
    host0, event0 = clock.anchor
    points = [(0.0, 0.0)] + [((host - host0) * 1e3, event0.elapsed_time(event)) for _, _, host, event in clock.marks]
    rows: dict[str, dict[str, list[float]]] = {}
    for (h0, g0), (h1, g1), (_, name, _, _) in zip(points, points[1:], clock.marks, strict=False):
        row = rows.setdefault(name, {"host_ms": [], "gpu_ms": [], "lag_ms": []})
        row["host_ms"].append(h1 - h0)
        row["gpu_ms"].append(g1 - g0)
        row["lag_ms"].append(g1 - h1)
    return {name: {k: sum(v) / len(v) for k, v in row.items()} for name, row in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_configuration_arguments(ap, mode="eager", steps=45)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--cprofile", type=int, default=0, help="print this many functions by own host time")
    ap.add_argument("--sync-debug", action="store_true")
    args = ap.parse_args()

    launch_us = host_launch_us()
    clock = PhaseClock(args.warmup)
    trainer = build_trainer(
        args.model, args.config, args.mode, args.steps, tempfile.mkdtemp(prefix="trace_phases_"), [clock], "auto"
    )
    instrument(trainer, clock)
    if args.cprofile or args.sync_debug:
        trainer.add_callback(HostDiagnostics(args.warmup, args.steps, args.cprofile, args.sync_debug))
    trainer.train()
    torch.cuda.synchronize()
    table = summarise(clock)
    steps = args.steps - args.warmup
    wall = (clock.marks[-1][2] - clock.anchor[0]) * 1e3 / steps
    print(f"{args.model} {args.config} {args.mode}: {wall:.1f} ms/step (host to the last step_end), "
          f"host {launch_us:.1f} us per small op")  # fmt: skip
    print("| phase (ends at) | host ms | GPU ms | GPU lag at end ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, row in table.items():
        print(f"| {name} | {row['host_ms']:.2f} | {row['gpu_ms']:.2f} | {row['lag_ms']:.2f} |")
    plans = training_plans(trainer.model)
    print(
        json.dumps({"model": args.model, "config": args.config, "ms_per_step": wall, "phases": table, "plans": plans})
    )


if __name__ == "__main__":
    main()
