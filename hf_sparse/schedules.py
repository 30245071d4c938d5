"""Gradual pruning schedules: training step -> target sparsity, quantised to the levels a pattern can reach.

A schedule is a function ``progress -> fraction of the final sparsity`` on ``[0, 1]``; adding one is a function and
one :func:`register_schedule` call. :class:`SchedulePlan` turns it into concrete steps for a run:

* before ``start`` nothing is pruned; at ``start`` and every ``update_every`` steps until ``end`` the masks are
  recomputed at the current target; from ``end`` on the final pattern holds.
* **N:M** (``n:m``) patterns move through the kept-per-group levels ``m-1, m-2, …, n`` (for 2:8:
  7:8 → 6:8 → … → 2:8). At each update the level is the densest one whose sparsity reaches the schedule's target
  (``keep = max(n, ceil(m * (1 - target)))``), so the mask is never sparser than the schedule asks.
* **V:N:M** (``v:n:m``) patterns move through the same kept-per-row counts ``k``: while ``k >= 4`` each block of
  ``v`` rows keeps ``k`` whole columns of every ``m`` (structured column pruning shared by the block); below 4
  each block keeps 4 columns and each row ``k`` of them, ending at ``v:n:m``. Every level is a subset of the one
  before, so weights pruned early never return.
* **unstructured** targets follow the schedule continuously.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .patterns import NM, VNM, Pattern, Unstructured
from .registry import SCHEDULES

__all__ = ["SchedulePlan", "available_schedules", "register_schedule"]


def register_schedule(name: str) -> Callable[[Callable[[float], float]], Callable[[float], float]]:
    """Register ``fn(progress in [0, 1]) -> fraction of the final sparsity in [0, 1]`` under ``name``."""
    return SCHEDULES.register(name)


def available_schedules() -> list[str]:
    return SCHEDULES.names()


@register_schedule("cubic")
def _cubic(progress: float) -> float:
    """Zhu & Gupta (2017): fast early, slow near the end, when fewer weights are left to choose from."""
    return 1.0 - (1.0 - progress) ** 3


@register_schedule("linear")
def _linear(progress: float) -> float:
    return progress


@register_schedule("oneshot")
def _oneshot(progress: float) -> float:
    return 1.0


def _resolve_step(value: float | int, total_steps: int) -> int:
    return value if isinstance(value, int) else int(round(value * total_steps))


@dataclass(frozen=True)
class SchedulePlan:
    """A schedule bound to one run: which pattern level holds at each optimizer step.

    ``level`` is what gets masked: for N:M and V:N:M an int (weights kept per group of ``m``), for unstructured the
    sparsity. ``None`` means dense (before the first update).
    """

    pattern: Pattern
    schedule: str
    start_step: int
    end_step: int
    update_every: int

    @classmethod
    def build(
        cls, pattern: Pattern, schedule: str, start: float | int, end: float | int, update_every: int, total_steps: int
    ) -> SchedulePlan:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; registered: {available_schedules()}")
        start_step = _resolve_step(start, total_steps)
        end_step = max(start_step, _resolve_step(end, total_steps))
        if schedule == "oneshot":
            end_step = start_step
        return cls(pattern, schedule, start_step, end_step, update_every)

    @property
    def final_sparsity(self) -> float:
        return self.pattern.sparsity

    def target_sparsity(self, step: int) -> float:
        """The schedule's continuous target at ``step`` (0 before ``start``)."""
        if step < self.start_step:
            return 0.0
        if step >= self.end_step:
            return self.final_sparsity
        progress = (step - self.start_step) / (self.end_step - self.start_step)
        return self.final_sparsity * SCHEDULES[self.schedule](progress)

    def is_update_step(self, step: int) -> bool:
        """Masks are recomputed at ``start``, every ``update_every`` steps after it, and at ``end``."""
        if step < self.start_step or step > self.end_step:
            return False
        return step == self.end_step or (step - self.start_step) % self.update_every == 0

    def level(self, step: int) -> int | float | None:
        """The pattern level in force after the update at the last update step ``<= step``."""
        last = self.last_update_step(step)
        if last is None:
            return None
        return self.quantise(self.target_sparsity(last))

    def last_update_step(self, step: int) -> int | None:
        if step < self.start_step:
            return None
        if step >= self.end_step:
            return self.end_step
        return step - (step - self.start_step) % self.update_every

    def quantise(self, sparsity: float) -> int | float | None:
        """The densest level whose sparsity reaches ``sparsity``; ``None`` if that is dense."""
        if isinstance(self.pattern, Unstructured):
            return sparsity if sparsity > 0 else None
        assert isinstance(self.pattern, NM | VNM)
        m, n = self.pattern.m, self.pattern.n
        keep = max(n, math.ceil(m * (1.0 - sparsity) - 1e-9))
        return None if keep >= m else keep

    def pattern_at(self, level: int | float) -> Pattern:
        """The concrete pattern to mask with at ``level`` (see the module docstring)."""
        if isinstance(self.pattern, Unstructured):
            return Unstructured(float(level))
        return self.pattern.at_level(int(level))
