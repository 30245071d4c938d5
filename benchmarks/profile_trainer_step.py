"""Where a ``Trainer`` step's time goes: the host's time to issue it against the GPU's time to run it, and the
profiler's top operators, for one configuration of ``bench_trainer.py`` in this process.

    python benchmarks/profile_trainer_step.py --model bert-large --config 2:4T --mode compiled [--steps 30]
        [--profile-steps 3] [--rows 25]

Steps before the last ``--profile-steps`` are warm-up (kernel plans, ``torch.compile``); the profiled steps run under
``torch.profiler`` (CPU and CUDA activities). Printed: the wall clock per profiled step (the profiler slows the host),
the profiler's self CPU and self CUDA totals per step (host busy, GPU kernels), two tables (by self CPU time, by CUDA
time), and with ``--children`` what runs inside the first two calls of the named ops. A diagnostic, not the
benchmark: ``bench_trainer.py`` times what a user sees.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from bench_trainer import add_configuration_arguments, build_trainer
from transformers import TrainerCallback


class Profile(TrainerCallback):
    def __init__(self, start: int, steps: int) -> None:
        self.start, self.end = start, start + steps
        self.prof = None
        self.t0 = 0.0

    def on_step_end(self, a, state, control, **kw):
        if state.global_step == self.start:
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif state.global_step == self.end:
            torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.t0) * 1e3 / (self.end - self.start)
            self.prof.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_configuration_arguments(ap, mode="compiled", steps=30)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument(
        "--children",
        nargs="*",
        default=[],
        help="print what runs inside the first calls of the ops whose names start so",
    )
    args = ap.parse_args()
    prof = Profile(args.steps - args.profile_steps - 1, args.profile_steps)
    trainer = build_trainer(
        args.model, args.config, args.mode, args.steps, "/tmp/profile_trainer_step", [prof], compact_fallback="never"
    )
    trainer.train()
    events = prof.prof.key_averages()
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60)
    totals = {
        k: float(v) / args.profile_steps for k, v in re.findall(r"Self (CPU|CUDA) time total: ([0-9.]+)ms", by_cpu)
    }
    print(
        f"## {args.model} {args.config} {args.mode}: wall {prof.wall_ms:.1f} ms/step (profiled), host busy "
        f"{totals.get('CPU', float('nan')):.1f} ms/step, GPU kernels {totals.get('CUDA', float('nan')):.1f} ms/step"
    )
    print(by_cpu)
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    for name in args.children:
        calls = [e for e in prof.prof.events() if e.name.startswith(name)][:2]
        for call in calls:
            print(f"### {name}: {call.cpu_time_total:.1f} us CPU, self {call.self_cpu_time_total:.1f} us")
            for child in call.cpu_children:
                print(f"    {child.name}: {child.cpu_time_total:.1f} us")
                for grandchild in child.cpu_children:
                    print(f"        {grandchild.name}: {grandchild.cpu_time_total:.1f} us")


if __name__ == "__main__":
    main()
