"""Importance scores: which weights matter. Larger means keep.

A score is a class with ``score(name, weight) -> Tensor`` (the logical ``(out, in)`` weight in, same-shaped
importance out) and optional hooks to collect statistics during training. Adding one is a class and one
:func:`register_score` call; the pruner looks it up by the name in :class:`~hf_sparse.SparsityConfig`. Second-order
(OBS) scoring joins this registry with gradient hooks of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["MagnitudeScore", "Score", "available_scores", "get_score", "register_score"]

_SCORES: dict[str, type[Score]] = {}


class Score:
    """Base class. Subclasses set ``name`` through :func:`register_score` and implement :meth:`score`.

    ``needs_gradients``: when True the pruner calls :meth:`observe_gradient` after every backward pass
    (before the gradient is masked), so a score can build curvature estimates.
    """

    needs_gradients: bool = False

    def score(self, name: str, weight: Tensor) -> Tensor:
        raise NotImplementedError

    def observe_gradient(self, name: str, weight: Tensor, grad: Tensor) -> None:
        """Called with each layer's logical gradient when ``needs_gradients``; a no-op by default."""

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned; nothing to restore by default."""


def register_score(name: str) -> Callable[[type[Score]], type[Score]]:
    def decorator(cls: type[Score]) -> type[Score]:
        if name in _SCORES:
            raise ValueError(f"score {name!r} is already registered")
        _SCORES[name] = cls
        return cls

    return decorator


def available_scores() -> list[str]:
    return sorted(_SCORES)


def get_score(name: str) -> Score:
    if name not in _SCORES:
        raise ValueError(f"unknown score {name!r}; registered: {available_scores()}")
    return _SCORES[name]()


@register_score("magnitude")
class MagnitudeScore(Score):
    """``|w|`` in float32 (bf16/fp16 weights are ranked exactly as stored)."""

    def score(self, name: str, weight: Tensor) -> Tensor:
        return weight.detach().abs().to(torch.float32)
