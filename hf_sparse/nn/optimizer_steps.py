"""A count of the ``torch.optim`` optimizer steps taken in this process, and what runs after each.

A layer's kernel state is rebuilt from its weight only when the weight changed. The weight's version counter says so
for most writes, but fused optimizers (``AdamW(fused=True)``) write the parameters without bumping it, so the steps
themselves are counted through a global optimizer post-step hook, installed once by :func:`watch_optimizer_steps`.
The same hook runs the functions given to :func:`after_optimizer_step` (the compact layers' pack refresh, which
compiled code relies on: it does not check the weights on each call).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["after_optimizer_step", "optimizer_steps", "watch_optimizer_steps"]

_steps = 0
_hook = None
_after: list[Callable[[], None]] = []


def _count_step(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1
    for fn in _after:
        fn()


def watch_optimizer_steps() -> None:
    """Install (once) the global post-step hook that counts optimizer steps."""
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(_count_step)


def after_optimizer_step(fn: Callable[[], None]) -> None:
    """Run ``fn()`` after every optimizer step counted (once :func:`watch_optimizer_steps` has run)."""
    if fn not in _after:
        _after.append(fn)


def optimizer_steps() -> int:
    """Optimizer steps taken since :func:`watch_optimizer_steps` was first called (0 before)."""
    return _steps
