"""Where a training step's peak GPU memory goes: the persistent state (parameters, gradients, optimizer state, the
compact layers' kernel state) and, at the moment of the peak, the live allocations grouped by the code that made
them.

    python benchmarks/profile_training_memory.py --model llama --config 2:4T [--steps 6] [--record-from 4]
                                                 [--compact-fallback never] [--top 25]

The trainer is ``bench_trainer.py``'s (same model, batch, bf16 mixed precision, fused AdamW; ``dense`` for a plain
``Trainer``). Allocation history is recorded from step ``--record-from`` to the end (``torch.cuda.memory``'s
recorder, Python stacks); the trace is replayed to find the highest ``memory_allocated`` inside that window and the
blocks live at that instant. Allocations made before the window (parameters, optimizer state, kernel packs) have no
stack there; they are accounted by walking the model and the optimizer instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_trainer  # noqa: E402

GIB = 2**30


def owner(frames: list[dict]) -> str:
    """The innermost frame of the code that asked for a block: hf_sparse, transformers or torch's optimizer/autograd
    Python (the caching allocator's own frames and torch internals skipped)."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(key in name for key in ("hf_sparse", "transformers", "torch/optim", "accelerate")):
            short = name.split("site-packages/")[-1].split("/work/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)" if not frames else f"{frames[0].get('filename', '?')}:{frames[0].get('line')}"


def peak_live_set(trace: list[dict], baseline: int, start: int = 0) -> tuple[int, dict[int, dict]]:
    """Replay one device's trace: (highest allocated bytes at or after event ``start``, {addr: event} of the recorded
    blocks live then)."""
    live: dict[int, dict] = {}
    total, best, best_index = baseline, -1, -1
    for i, ev in enumerate(trace):
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
        elif action == "free_completed":
            live.pop(ev["addr"], None)
            total -= ev["size"]
        if i >= start and total > best:
            best, best_index = total, i
    live = {}
    for ev in trace[: best_index + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return best, live


def persistent_state(model, optimizer) -> dict[str, int]:
    """Bytes of what lives across steps: parameters, their gradients, the optimizer's state, the modules' buffers and
    the compact layers' kernel tensors (packs, transposed packs)."""
    import torch

    seen: set[int] = set()

    def once(t) -> int:
        """The bytes of ``t``'s storage, counted once (views and expanded tensors share it)."""
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            return 0
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    out = defaultdict(int)
    for p in model.parameters():
        out["parameters"] += once(p)
        out["gradients"] += once(p.grad) if p.grad is not None else 0
    for b in model.buffers():
        out["buffers (positions, masks)"] += once(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                out["optimizer state"] += once(value)
    for module in model.modules():
        kernel = getattr(module, "_kernel", None)
        if kernel is None:
            continue
        for name, value in vars(kernel).items():
            values = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            )
            for t in values:
                out[f"compact kernel state: {name}"] += once(t)
    return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama", choices=list(bench_trainer.MODELS))
    ap.add_argument("--config", default="2:4T")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--record-from", type=int, default=4, help="first recorded step (after warm-up and any switch)")
    ap.add_argument("--compact-fallback", default="never", choices=["auto", "never"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--record-all", action="store_true", help="record from before the model is built")
    args = ap.parse_args()

    import torch
    from transformers import TrainerCallback

    state = {"start": 0}

    def record() -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=2_000_000)  # fmt: skip

    class Recorder(TrainerCallback):
        def on_step_begin(self, a, st, control, **kw):
            if st.global_step == args.record_from:
                torch.cuda.synchronize()
                state["before"] = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                state["opened"] = torch.cuda.memory_allocated()
                if args.record_all:
                    state["start"] = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
                else:
                    state["baseline"] = state["opened"]
                    record()

        def on_step_end(self, a, st, control, **kw):
            if st.global_step == args.steps:
                torch.cuda.synchronize()
                state["snapshot"] = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                state["peak"] = torch.cuda.max_memory_allocated()

    out = tempfile.mkdtemp(prefix="profile_memory_")
    if args.record_all:
        state["baseline"] = torch.cuda.memory_allocated()
        record()
    trainer = bench_trainer.build_trainer(args.model, args.config, "eager", args.steps, out, [Recorder()],
                                          args.compact_fallback)  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    trace = state["snapshot"]["device_traces"][torch.cuda.current_device()]
    replayed, live = peak_live_set(trace, state["baseline"], state["start"])
    print(f"# {args.model} {args.config}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"peak before step {args.record_from}: {state['before'] / GIB:.2f} GiB; in steps {args.record_from}-"
          f"{args.steps}: {state['peak'] / GIB:.2f} GiB (replayed trace: {replayed / GIB:.2f}); allocated when the "
          f"window opened: {state['opened'] / GIB:.2f} GiB")  # fmt: skip
    print("\n## Persistent state after the run (GiB)")
    persistent = persistent_state(trainer.model, trainer.optimizer)
    for key, value in persistent.items():
        if value:
            print(f"- {key}: {value / GIB:.3f}")
    print(f"- total: {sum(persistent.values()) / GIB:.3f}")
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in live.values():
        g = groups[owner(ev.get("frames", []))]
        g[0] += ev["size"]
        g[1] += 1
    print(
        f"\n## Blocks allocated {'since the start' if args.record_all else 'inside the window'} and live at its peak: {sum(g[0] for g in groups.values()) / GIB:.3f} GiB"
    )
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"- {size / GIB:7.3f} GiB in {count:5d} blocks: {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
