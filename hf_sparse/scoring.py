"""Importance scores: which weights matter. Larger means keep.

A score is a class with ``score(name, weight) -> Tensor`` (the logical ``(out, in)`` weight in, same-shaped
importance out) and optional hooks to collect statistics during training. Adding one is a class and one
:func:`register_score` call; the pruner looks it up by the name in :class:`~hf_sparse.SparsityConfig`.

A score that does more than rank weights (second-order OBS picks whole subsets per group *and* moves the weights
that stay) sets ``provides_prune`` and implements :meth:`Score.prune`; the pruner then calls it instead of
``score`` + :func:`~hf_sparse.masks.compute_mask`, and calls :meth:`Score.compensate` after any mask it builds
itself (transposable 2:4, global unstructured thresholds).

A score that looks at the layers' inputs (Wanda, SparseGPT) sets ``needs_calibration``: before each mask update the
pruner runs calibration batches through the model block by block (:mod:`hf_sparse.calibration`) and hands the
score each targeted layer's inputs through :meth:`Score.observe_input` just before that layer is pruned.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .masks import _top_k_last_dim, compute_mask
from .obs import MAX_SUBSETS, accumulate_fisher, damped_fisher, obs_prune, obs_saliency, obs_update
from .patterns import NM, VNM, Pattern, Unstructured
from .registry import SCORES
from .sparsegpt import accumulate_hessian, accumulate_sq_norms, sparsegpt_prune, sparsegpt_saliency, wanda_score

if TYPE_CHECKING:
    from .config import SparsityConfig

__all__ = [
    "CalibratedScore",
    "MagnitudeScore",
    "ObsScore",
    "Score",
    "SparseGPTScore",
    "WandaScore",
    "available_scores",
    "get_score",
    "register_score",
]


class Score:
    """Base class. Subclasses set ``name`` through :func:`register_score` and implement :meth:`score`.

    ``needs_gradients``: when True the pruner calls :meth:`observe_gradient` with each optimizer step's full
    gradient (after accumulation, all-reduce and clipping), during the ``gradient_window`` steps before each mask
    update (every step when ``None``), so a score can build curvature estimates.
    ``provides_prune``: the pruner calls :meth:`prune` for masks and new weights instead of ranking :meth:`score`.
    ``needs_calibration``: the pruner calls :meth:`observe_input` with each layer's calibration inputs before it
    prunes that layer (see :class:`CalibratedScore`).
    """

    needs_gradients: bool = False
    gradient_window: int | None = None
    provides_prune: bool = False
    needs_calibration: bool = False

    @classmethod
    def from_config(cls, config: SparsityConfig) -> Score:
        """Build from the run's config (scores with options read their fields here); ``cls()`` by default."""
        return cls()

    def score(self, name: str, weight: Tensor) -> Tensor:
        raise NotImplementedError

    def observe_gradient(self, name: str, weight: Tensor, grad: Tensor) -> None:
        """Called with each layer's logical gradient when ``needs_gradients``; a no-op by default."""

    def observe_input(self, name: str, inputs: Tensor) -> None:
        """Called with ``(tokens, in_features)`` inputs of layer ``name`` when ``needs_calibration``; a no-op here."""

    def share_statistics(self, name: str, source: str) -> None:
        """Layer ``name`` sees the same inputs as ``source`` (query, key and value): reuse its statistics."""

    def release(self, name: str) -> None:
        """Drop layer ``name``'s statistics once it is pruned; a no-op by default."""

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


class CalibratedScore(Score):
    """Base of the scores computed from the layers' calibration inputs: one statistic tensor per layer, accumulated
    by :meth:`accumulate` from every batch's ``(tokens, in_features)`` inputs (padding tokens left out), shared by
    layers with the same inputs, dropped as soon as the layer is pruned. The pruner collects one layer (or one group
    of layers sharing their inputs) at a time, so one statistic is alive at once."""

    needs_calibration = True

    def __init__(self) -> None:
        self._stats: dict[str, Tensor] = {}

    def accumulate(self, stat: Tensor | None, inputs: Tensor) -> Tensor:
        raise NotImplementedError

    def observe_input(self, name: str, inputs: Tensor) -> None:
        self._stats[name] = self.accumulate(self._stats.get(name), inputs)

    def share_statistics(self, name: str, source: str) -> None:
        if source in self._stats:
            self._stats[name] = self._stats[source]

    def release(self, name: str) -> None:
        self._stats.pop(name, None)

    def statistics(self, name: str) -> Tensor:
        if name not in self._stats:
            raise RuntimeError(
                f"score {type(self).__name__}: no calibration input reached layer {name!r}; the pruner collects "
                "them before each mask update (hf_sparse.oneshot, or a Trainer with SparsityCallback/SparseTrainer)"
            )
        return self._stats[name]

    def reset(self) -> None:
        self._stats.clear()


@register_score("wanda")
class WandaScore(CalibratedScore):
    """Wanda (Sun et al. 2023): ``|W_ij| · ‖X_j‖₂``, the weight's magnitude times the norm of its input feature over
    the calibration tokens.

    N:M and V:N:M rank within their groups as magnitude does; unstructured sparsity is taken per output row (each
    row keeps the same fraction, Wanda's comparison group) unless ``global_unstructured`` asks for one threshold
    across layers; transposable 2:4 ranks the Wanda score. Statistics: ``in_features`` floats per layer.
    """

    provides_prune = True

    def accumulate(self, stat: Tensor | None, inputs: Tensor) -> Tensor:
        return accumulate_sq_norms(stat, inputs)

    def score(self, name: str, weight: Tensor) -> Tensor:
        return wanda_score(weight, self.statistics(name))

    def prune(
        self, name: str, weight: Tensor, pattern: Pattern, previous: Tensor | None = None
    ) -> tuple[Tensor, None]:
        score = self.score(name, weight)
        if previous is not None:
            score = score.masked_fill(~previous.to(score.device), -1.0)  # pruned earlier: stays pruned
        if isinstance(pattern, Unstructured):
            return _top_k_last_dim(score, round((1.0 - pattern.sparsity) * score.shape[1])), None
        return compute_mask(score, pattern), None


@register_score("sparsegpt")
class SparseGPTScore(CalibratedScore):
    """SparseGPT (Frantar & Alistarh 2023): layer-wise reconstruction with the inputs' Hessian ``H = Xᵀ X``; masks
    and moved weights from :func:`hf_sparse.sparsegpt.sparsegpt_prune` (N:M, V:N:M and unstructured chosen during
    the sweep; transposable 2:4 and global unstructured masks built by the pruner from :meth:`score`, then
    compensated with the same sweep).

    Statistics: ``H`` in float32, ``in_features² · 4`` bytes for the one layer being pruned (2.4 MB for a
    768-wide input, 36 MB for BERT-base's 3072-wide FFN output layer, 485 MB for a 7B-class 11008-wide
    ``down_proj``), plus about as much again while the layer is pruned (``U``).
    """

    provides_prune = True

    def __init__(self, damp: float = 0.01, block_size: int = 128) -> None:
        super().__init__()
        self.damp = damp
        self.block_size = block_size

    @classmethod
    def from_config(cls, config: SparsityConfig) -> SparseGPTScore:
        return cls(config.sparsegpt_damp, config.sparsegpt_block_size)

    def accumulate(self, stat: Tensor | None, inputs: Tensor) -> Tensor:
        return accumulate_hessian(stat, inputs)

    def score(self, name: str, weight: Tensor) -> Tensor:
        return sparsegpt_saliency(weight, self.statistics(name), self.damp)

    def prune(
        self, name: str, weight: Tensor, pattern: Pattern, previous: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return sparsegpt_prune(
            weight, self.statistics(name), pattern, eligible=previous, damp=self.damp, block_size=self.block_size
        )

    def compensate(self, name: str, weight: Tensor, mask: Tensor) -> Tensor:
        _, new_weight = sparsegpt_prune(
            weight, self.statistics(name), None, mask=mask, damp=self.damp, block_size=self.block_size
        )
        return new_weight
