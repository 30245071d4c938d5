"""Importance scores: which weights matter. Larger means keep.

A score is a class with ``score(name, weight) -> Tensor`` (the logical ``(out, in)`` weight in, same-shaped
importance out) and optional hooks to collect statistics during training. Adding one is a class and one
:func:`register_score` call; the pruner looks it up by the name in :class:`~hf_sparse.SparsityConfig`.

A score that does more than rank weights (second-order OBS picks whole subsets per group *and* moves the weights
that stay) sets ``provides_prune`` and implements :meth:`Score.prune`; the pruner then calls it instead of
``score`` + :func:`~hf_sparse.masks.compute_mask`, and calls :meth:`Score.compensate` after any mask it builds
itself (transposable 2:4, global unstructured thresholds).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .obs import MAX_SUBSETS, accumulate_fisher, damped_fisher, obs_prune, obs_saliency, obs_update
from .patterns import NM, VNM, Pattern
from .registry import SCORES

if TYPE_CHECKING:
    from .config import SparsityConfig

__all__ = ["MagnitudeScore", "ObsScore", "Score", "available_scores", "get_score", "register_score"]


class Score:
    """Base class. Subclasses set ``name`` through :func:`register_score` and implement :meth:`score`.

    ``needs_gradients``: when True the pruner calls :meth:`observe_gradient` with each optimizer step's full
    gradient (after accumulation, all-reduce and clipping), during the ``gradient_window`` steps before each mask
    update (every step when ``None``), so a score can build curvature estimates.
    ``provides_prune``: the pruner calls :meth:`prune` for masks and new weights instead of ranking :meth:`score`.
    """

    needs_gradients: bool = False
    gradient_window: int | None = None
    provides_prune: bool = False

    @classmethod
    def from_config(cls, config: SparsityConfig) -> Score:
        """Build from the run's config (scores with options read their fields here); ``cls()`` by default."""
        return cls()

    def score(self, name: str, weight: Tensor) -> Tensor:
        raise NotImplementedError

    def observe_gradient(self, name: str, weight: Tensor, grad: Tensor) -> None:
        """Called with each layer's logical gradient when ``needs_gradients``; a no-op by default."""

    def prune(
        self, name: str, weight: Tensor, pattern: Pattern, previous: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``(mask, new_weight or None)`` for ``pattern``; ``previous`` holds the weights allowed to stay (the
        previous mask of a gradual ramp). Only called when ``provides_prune``."""
        raise NotImplementedError

    def compensate(self, name: str, weight: Tensor, mask: Tensor) -> Tensor | None:
        """New weights for a mask the pruner chose (``None``: keep the weights as they are, the default)."""
        return None

    def reset(self) -> None:
        """Drop statistics after a mask update (they are collected again before the next one)."""

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned; nothing to restore by default."""


def register_score(name: str) -> Callable[[type[Score]], type[Score]]:
    """Register a :class:`Score` subclass under ``name`` (the value of ``SparsityConfig.score``)."""
    return SCORES.register(name)


def available_scores() -> list[str]:
    return SCORES.names()


def get_score(name: str, config: SparsityConfig | None = None) -> Score:
    """A fresh score object; with ``config``, built by the class's :meth:`Score.from_config`."""
    if name not in SCORES:
        raise ValueError(f"unknown score {name!r}; registered: {available_scores()}")
    cls = SCORES[name]
    return cls.from_config(config) if config is not None else cls()


@register_score("magnitude")
class MagnitudeScore(Score):
    """``|w|`` in float32 (bf16/fp16 weights are ranked exactly as stored)."""

    def score(self, name: str, weight: Tensor) -> Tensor:
        return weight.detach().abs().to(torch.float32)


@register_score("obs")
class ObsScore(Score):
    """Second-order Optimal Brain Surgeon pruning with a block-diagonal empirical Fisher (see :mod:`hf_sparse.obs`).

    Gradients: the full gradient of each of the ``num_grads`` optimizer steps before a mask update (the pruner
    only calls :meth:`observe_gradient` then; the statistics are dropped after each update, so they cost nothing
    the rest of the time). Per layer it keeps a float32 sum of ``g gᵀ`` per block of ``B`` consecutive input
    weights (``B`` = ``M`` of the pattern by default, 32 or the largest power of two dividing ``in_features`` for
    unstructured), which is exact, independent of ``num_grads``, and smaller than a ring buffer of ``num_grads``
    bf16 gradients (``2·num_grads`` bytes per weight = 64 at the default 32) whenever ``B ≤ 16``.

    Memory for a BERT-base-sized model (85M encoder linear weights) while collecting, at ``B = M``:
    ``85M · B · 4`` bytes = **1.36 GB at 2:4, 2.7 GB at 2:8, 5.4 GB at 64:2:16** (a ring buffer of 32 bf16
    gradients would be 5.4 GB for all three). The prune step works one layer at a time in float64, at its peak
    about five ``R·K·B·8``-byte tensors (1.5 GB for a 3072 × 768 layer at ``B = 16``). Both fit one GPU next to
    BERT-base training (a 24 GB card included); memory grows linearly with ``B``, so large ``obs_block_size``
    values are for smaller models.

    Not saved in Trainer checkpoints: after ``resume_from_checkpoint`` the gradients observed before the
    checkpoint are gone, and the next update uses those observed after it (masks, level and weights are restored
    exactly; only an update whose collection window straddles the checkpoint differs from an uninterrupted run).
    """

    needs_gradients = True
    provides_prune = True

    def __init__(
        self,
        num_grads: int = 32,
        damp: float = 1e-2,
        block_size: int | None = None,
        pattern: Pattern | None = None,
        max_subsets: int = MAX_SUBSETS,
    ) -> None:
        self.gradient_window = num_grads
        self.damp = damp
        self.block_size = block_size
        self.pattern = pattern
        self.max_subsets = max_subsets
        self._sums: dict[str, Tensor] = {}
        self._counts: dict[str, int] = {}
        self._warned = False

    @classmethod
    def from_config(cls, config: SparsityConfig) -> ObsScore:
        return cls(config.obs_num_grads, config.obs_damp, config.obs_block_size, config.parsed_pattern)

    def block_for(self, cols: int) -> int:
        """The Fisher block length for a layer with ``cols`` input features."""
        if self.block_size is not None:
            return self.block_size
        if isinstance(self.pattern, NM | VNM):
            return self.pattern.m
        return math.gcd(cols, 32)

    def observe_gradient(self, name: str, weight: Tensor, grad: Tensor) -> None:
        block = self.block_for(grad.shape[1])
        try:
            self._sums[name] = accumulate_fisher(self._sums.get(name), grad, block)
        except ValueError as err:
            raise ValueError(f"layer {name!r}: {err}") from None
        self._counts[name] = self._counts.get(name, 0) + 1

    def fisher(self, name: str, weight: Tensor) -> Tensor:
        """The damped Fisher blocks of layer ``name`` (identity, i.e. magnitude, before any gradient)."""
        count = self._counts.get(name, 0)
        if count == 0 and not self._warned:
            self._warned = True
            warnings.warn(
                "hf_sparse: OBS mask update with no gradient observed yet: it ranks by magnitude. Start pruning "
                f"at least obs_num_grads={self.gradient_window} steps into training (SparsityConfig.start)",
                stacklevel=4,
            )
        return damped_fisher(self._sums.get(name), count, self.damp, weight, self.block_for(weight.shape[1]))

    def score(self, name: str, weight: Tensor) -> Tensor:
        """Per-weight OBS saliency ``w² / (2 [F⁻¹]_ii)`` (float64)."""
        return obs_saliency(weight, self.fisher(name, weight))

    def prune(
        self, name: str, weight: Tensor, pattern: Pattern, previous: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return obs_prune(weight, self.fisher(name, weight), pattern, eligible=previous, max_subsets=self.max_subsets)

    def compensate(self, name: str, weight: Tensor, mask: Tensor) -> Tensor:
        return obs_update(weight, self.fisher(name, weight), mask).to(weight.dtype)

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
