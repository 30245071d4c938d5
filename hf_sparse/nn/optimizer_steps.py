"""A count of the ``torch.optim`` optimizer steps taken in this process.

A layer's kernel state is rebuilt from its weight only when the weight changed. The weight's version counter says so
for most writes, but fused optimizers (``AdamW(fused=True)``) write the parameters without bumping it, so the steps
themselves are counted through a global optimizer post-step hook, installed once by :func:`watch_optimizer_steps`.
"""

from __future__ import annotations

__all__ = ["optimizer_steps", "watch_optimizer_steps"]

_steps = 0
_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1


def watch_optimizer_steps() -> None:
    """Install (once) the global post-step hook that counts optimizer steps."""
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(_count_step)


def optimizer_steps() -> int:
    """Optimizer steps taken since :func:`watch_optimizer_steps` was first called (0 before)."""
    return _steps
