"""Never slower than dense: time the compact layers against the masked dense ones inside training, keep the faster;
under torch.compile, time the compiled step against the eager one.

Once the pruned layers are compact (:mod:`hf_sparse.compaction`), :class:`CompactFallback` runs a fixed schedule of
real training steps, counted from the first step with compact layers ``s``, ``W`` = :data:`WARMUP_STEPS` and ``T`` =
``SparsityConfig.compact_fallback_steps``::

    [s, s+W)            compact, warm-up (the compact layers measure their kernel plans in their first step)
    [s+W, s+W+T)        compact, timed
    [s+W+T, s+2W+T)     masked dense (compaction.make_dense, optimizer state scattered back), warm-up
    [s+2W+T, s+2W+2T)   masked dense, timed
    after step s+2W+2T-1: the faster path (choose_path); back to compact (compaction.make_compact) unless dense won

The masked dense half runs only where the compact layers' own measurements leave the outcome open. Each compact
layer measured its plan against the masked dense layer it replaced when it made it, counting the GPU time it saves
less any host time it adds, never host time saved, which a step waiting for the GPU in its backward does not gain
(:func:`hf_sparse.nn.compact.sure_saving_ms`, :func:`hf_sparse.compaction.measured_saving_ms`); the GPU time
the optimizer step saves on the elements the compact layers do not hold is measured per element at the end of the
compact window (:func:`hf_sparse.compaction.optimizer_saving_ms`). Where those savings add up, per optimizer step, to more
than :data:`NOISE_MARGIN` of the compact step's measured time, the masked dense step cannot be faster by the margin
unless the measurements were wrong by more than that, so the run decides for the compact layers after their timed
window, logs one line saying why, and never holds the dense layers' state (a dense phase would put the run's peak
memory at the masked dense one's).

Under torch.compile (``TrainingArguments.torch_compile``) a switch of the layers would recompile the model, so the
same schedule times the compiled step against the eager one instead: the second half runs the compact layers with
torch.compile set aside (``torch.compiler.set_stance("force_eager")``: the compiled code stays cached, nothing is
recompiled), and the run goes on eager only where that measured faster by the noise margin. A compiled step can be
the slower one on a slow host: each compact layer in a compiled graph costs more host time than the ``nn.Linear`` it
replaced (guards on its kernel state, the op's arguments), and a model whose compiled step waits on the host (BERT-large
at 16 x 512) loses what its kernels save. The stance is process-wide: while the run trains eager, every compiled
function of the process runs eager. It is restored when training ends.

The comparison is skipped (one log line says why) under DDP/FSDP2 wrappers and, against masked dense layers, where
the dense layers' state would not fit in the free device memory. Its dense phase holds that state for ``W + T``
steps, so a run's peak memory is the masked dense one's; the steps after the decision hold only what the chosen path
needs.

Masked dense and compact training are the same computation (the switches move the optimizer state exactly), so
every timed step trains as any other. A timed window is wall clock per optimizer step: the device is synchronized
where a timed stretch begins and ends, not inside it; a checkpoint save or an evaluation ends a stretch (their time
is not a training step's) and the next step begins the next one. The schedule is in step numbers and
:meth:`CompactFallback.state_dict` goes into the checkpoint's pruner state, so a resumed run switches at the same
steps, times the rest of a cut window (its first step after the resume untimed), and after the decision continues on
the chosen path without measuring again.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

import torch
from torch import nn

from .compaction import make_compact, make_dense, measured_saving_ms, optimizer_saving_ms, why_not_compact_now
from .pruner import Pruner

__all__ = ["NOISE_MARGIN", "WARMUP_STEPS", "CompactFallback", "choose_path"]

logger = logging.getLogger(__name__)

#: Untimed steps after each switch: kernel plans are measured, allocator pools and ``torch.compile`` graphs built.
WARMUP_STEPS = 3
#: The masked dense layers win only if faster than the compact ones by more than this fraction of the compact time.
NOISE_MARGIN = 0.03

#: ``"compact"``: the compact layers as the run is set up (compiled under ``torch_compile``); ``"dense"``: the masked
#: dense layers; ``"eager"``: the compact layers with torch.compile set aside.
PathName = Literal["compact", "dense", "eager"]


def choose_path(compact_ms: float | None, dense_ms: float | None, margin: float = NOISE_MARGIN) -> PathName:
    """``"dense"`` when the other step (``dense_ms``, ms per optimizer step: masked dense layers, or the eager step
    under torch.compile) is faster than the compact one by more than ``margin`` of the compact time, else
    ``"compact"``: within the noise, or when a path could not be timed (``None``), the compact layers stay as set up,
    since they hold less memory (and the user asked for torch.compile)."""
    for name, value in (("compact_ms", compact_ms), ("dense_ms", dense_ms)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"choose_path: {name}={value!r} must be a finite time >= 0 (ms per step) or None")
    if not 0 <= margin < 1:
        raise ValueError(f"choose_path: margin={margin!r} must be a fraction in [0, 1)")
    if compact_ms is None or dense_ms is None:
        return "compact"
    return "dense" if dense_ms < compact_ms * (1 - margin) else "compact"


class _Timing:
    """Milliseconds and optimizer steps timed on one path, in closed stretches."""

    def __init__(self, ms: float = 0.0, steps: int = 0) -> None:
        self.ms, self.steps = ms, steps

    @property
    def ms_per_step(self) -> float | None:
        return self.ms / self.steps if self.steps else None


class CompactFallback:
    """The comparison of one training run (see the module docstring); :class:`~hf_sparse.SparsityCallback` forwards
    its step events here.

    Args:
        mode: ``SparsityConfig.compact_fallback``: ``"auto"`` (CUDA only), ``"always"`` or ``"never"``.
        steps: optimizer steps timed per path.
        warmup: untimed steps after each switch.
    """

    def __init__(self, mode: str = "auto", steps: int = 10, warmup: int = WARMUP_STEPS) -> None:
        self.mode, self.steps, self.warmup = mode, steps, warmup
        self.start: int | None = None  # first step with compact layers: the schedule counts from here
        self.declined: str | None = None  # why no comparison runs in this run
        self.choice: PathName | None = None
        self.rival: PathName = "dense"  # what the compact step is timed against: "eager" under torch.compile
        self.timings = {"compact": _Timing(), "dense": _Timing()}
        self._open: tuple[PathName, float, int] | None = None  # (path, start time, steps so far) of a timed stretch
        self._device: torch.device | None = None
        self._skip_next = False  # the first step after a resume is a warm-up
        self.passes = 1  # forward and backward passes per optimizer step (gradient accumulation)
        self.savings_ms: dict[str, float] | None = None  # what the decision counted: the layers', the optimizer step's
        self._stance = None  # torch.compile's stance set aside while the eager step runs (torch.compiler.set_stance)

    # ------------------------------------------------------------------ schedule
    def timed_steps(self, path: PathName) -> range:
        """The optimizer steps timed on ``path`` (empty before the schedule starts, or for a path not timed)."""
        if self.start is None or path not in self.timings:
            return range(0)
        first = self.start + self.warmup + (0 if path == "compact" else self.warmup + self.steps)
        return range(first, first + self.steps)

    def holds_dense(self, step: int) -> bool:
        """Whether the pruned layers are meant to be dense at ``step``: during the dense half of the measurement,
        and for good after the masked dense layers won."""
        return self._runs(step, "dense")

    def runs_eager(self, step: int) -> bool:
        """Whether ``step`` runs with torch.compile set aside: during the eager half of the measurement, and for good
        after the eager step won."""
        return self._runs(step, "eager")

    def _runs(self, step: int, path: PathName) -> bool:
        if self.choice is not None:
            return self.choice == path
        timed = self.timed_steps(path)
        return self.start is not None and timed.start - self.warmup <= step < timed.stop

    # ------------------------------------------------------------------ events
    def begin_step(
        self,
        step: int,
        max_steps: int,
        model: nn.Module,
        pruner: Pruner,
        optimizer,
        compiled: bool = False,
        passes: int = 1,
    ) -> None:
        """At the start of optimizer step ``step``, after the compact switch: start the schedule at the first step
        with compact layers, and begin a timed stretch on a timed step. ``compiled``: the model runs under
        torch.compile (``TrainingArguments.torch_compile``); ``passes``: forward and backward passes per optimizer
        step (``gradient_accumulation_steps``)."""
        self.passes = passes
        if self.start is None and self.choice is None and self.declined is None:
            self._plan(step, max_steps, model, pruner, optimizer, compiled)
        self._set_eager(self.runs_eager(step))
        path = self._timed_path(step)
        if path is None or self._open is not None:
            return
        if self._skip_next:
            self._skip_next = False
            return
        self._sync()
        self._open = (path, time.perf_counter(), 0)

    def end_step(self, done: int, pause: bool, model: nn.Module, pruner: Pruner, optimizer) -> None:
        """After optimizer step ``done - 1`` (``done`` = ``state.global_step``). ``pause``: a save, an evaluation or
        the end of training follows, which ends a timed stretch. Switches to dense after the compact window and
        decides after the dense one."""
        self._skip_next = False
        step = done - 1
        if self._open is not None:
            path, began, count = self._open
            self._open = (path, began, count + 1)
            if pause or step == self.timed_steps(path)[-1]:
                self._close()
        if self.choice is not None or self.start is None:
            return
        if step == self.timed_steps("compact")[-1]:
            if self.rival == "dense" and not self._layers_decide(pruner, optimizer):
                make_dense(model, pruner, optimizer=optimizer)
        elif step == self.timed_steps(self.rival)[-1]:
            self._decide(model, pruner, optimizer)

    def end_training(self) -> None:
        """At the end of training: torch.compile's stance as it was before the eager step (the decision holds for
        training steps; evaluation and inference afterwards run as the user set them up)."""
        self._set_eager(False)

    # ------------------------------------------------------------------ internals
    def _plan(self, step: int, max_steps: int, model: nn.Module, pruner: Pruner, optimizer, compiled: bool) -> None:
        if self.mode == "never":
            self.declined = "SparsityConfig.compact_fallback='never'"
            return
        compact = next(iter(pruner.compact_layers), None)
        if compact is None:
            return  # the schedule starts at the first step with compact layers
        self._device = compact.module.weight.device
        if self.mode == "auto" and self._device.type != "cuda":
            self.declined = "not on CUDA"  # the compact layers run their reference path: nothing worth timing
            return
        why = why_not_compact_now(model, optimizer)
        if compiled:
            self.rival = "eager"
            self.timings = {"compact": _Timing(), "eager": _Timing()}
        if why is None and self.mode == "auto" and not compiled:
            why = _dense_state_does_not_fit(pruner, self._device)
        needed = 2 * (self.warmup + self.steps)
        if why is None and max_steps - step < needed:
            why = f"{max_steps - step} optimizer steps are left and the comparison needs {needed}"
        if why is not None:
            self.declined = why
            logger.info(
                "hf_sparse: the compact layers are not timed against %s (%s); they stay compact",
                "the eager step" if compiled else "the masked dense ones",
                why,
            )
            return
        self.start = step

    def _timed_path(self, step: int) -> PathName | None:
        if self.choice is not None:
            return None
        for path in self.timings:
            if step in self.timed_steps(path):
                return path
        return None

    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _close(self) -> None:
        self._sync()
        path, began, count = self._open
        timing = self.timings[path]
        timing.ms += (time.perf_counter() - began) * 1e3
        timing.steps += count
        self._open = None

    def _layers_decide(self, pruner: Pruner, optimizer) -> bool:
        """After the compact window: decide for the compact layers without timing masked dense ones where what they
        surely save per optimizer step (their own measurements, per forward and backward pass, plus the optimizer
        step's, once) exceeds the noise margin of the compact step (see the module docstring)."""
        compact_ms = self.timings["compact"].ms_per_step
        layers = measured_saving_ms(pruner)
        if compact_ms is None or layers is None:
            return False
        self.savings_ms = {
            "layers": layers * self.passes,
            "optimizer step": optimizer_saving_ms(pruner, optimizer) or 0.0,
        }
        saved = sum(self.savings_ms.values())
        if saved < NOISE_MARGIN * compact_ms:
            return False
        self.choice = "compact"
        logger.info(
            "hf_sparse: compact layers %s ms/step; they surely save %.2f ms/step against the masked dense layers (their "
            "kernel plans %.2f, the optimizer step %.2f: more than %.0f%% of the step), so the masked dense layers are "
            "not timed: training goes on with the compact layers",
            _ms(compact_ms),
            saved,
            self.savings_ms["layers"],
            self.savings_ms["optimizer step"],
            100 * NOISE_MARGIN,
        )
        return True

    def _set_eager(self, eager: bool) -> None:
        """Set torch.compile aside (``eager``) or bring it back; a no-op where it already is so."""
        if eager and self._stance is None:
            self._stance = torch.compiler.set_stance("force_eager")
        elif not eager and self._stance is not None:
            self._stance.__exit__(None, None, None)  # the stance before: set_stance's own restore
            self._stance = None

    def _decide(self, model: nn.Module, pruner: Pruner, optimizer) -> None:
        compact, rival = self.timings["compact"], self.timings[self.rival]
        self.choice = "compact" if choose_path(compact.ms_per_step, rival.ms_per_step) == "compact" else self.rival
        if self.rival == "eager":
            self._set_eager(self.choice == "eager")
        elif self.choice == "compact":
            make_compact(model, pruner, optimizer)
        first, second, rival_won, compact_stays = _DECISION_WORDS[self.rival]
        logger.info(
            "hf_sparse: %s %s ms/step, %s %s ms/step (%d and %d timed steps): %s",
            first,
            _ms(compact.ms_per_step),
            second,
            _ms(rival.ms_per_step),
            compact.steps,
            rival.steps,
            rival_won if self.choice == self.rival else compact_stays,
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for the checkpoint (a stretch still open is not in it: its steps are timed again)."""
        return {
            "start": self.start,
            "declined": self.declined,
            "choice": self.choice,
            "rival": self.rival,
            "timings": {path: [t.ms, t.steps] for path, t in self.timings.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Continue the run of ``state`` (``device``: where the pruned layers are, to synchronize timed stretches)."""
        self.start, self.declined, self.choice = state["start"], state["declined"], state["choice"]
        self.rival = state.get("rival", "dense")  # a state without the key timed masked dense layers
        self.timings = {path: _Timing(*state["timings"][path]) for path in ("compact", self.rival)}
        self._open, self._device, self._skip_next = None, device, True


def _dense_state_does_not_fit(pruner: Pruner, device: torch.device) -> str | None:
    """Why the masked dense phase should not run: the dense weights, gradients and Adam moments of the compact layers
    (16 bytes per dense entry) would not fit in 80% of the free device memory. A run that chose sparse layers to fit
    must not run out of memory while timing dense ones."""
    layers = pruner.compact_layers
    need = sum(16 * layer.shape[0] * layer.shape[1] for layer in layers)
    free = torch.cuda.mem_get_info(device)[0]
    if need <= 0.8 * free:
        return None
    return f"the masked dense layers' state would need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free"


#: per rival: the decision line's names of the two paths, and what it says where the rival won or the compact step stays
_DECISION_WORDS = {
    "dense": (
        "compact layers",
        "masked dense layers",
        "training goes on with the masked dense layers, which are faster",
        "training goes on with the compact layers",
    ),
    "eager": (
        "compiled step",
        "eager step",
        "training goes on eager (torch.compile set aside), which is faster",
        "training goes on compiled",
    ),
}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
