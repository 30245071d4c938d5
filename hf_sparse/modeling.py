"""Finding the layers to prune in a Transformers model, and their logical ``(out, in)`` weight.

``nn.Linear`` stores ``(out_features, in_features)``; GPT-2's ``Conv1D`` stores the transpose ``(in, out)`` and
computes ``x @ W + b``. Everything above this module sees the logical ``(out, in)`` orientation: masks group along
the input dimension, which is what N:M means and what Sparse Tensor Cores compress.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field

from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from .config import SparsityConfig
from .patterns import Pattern

__all__ = ["TargetLayer", "find_target_layers", "logical_weight", "unwrap_model"]

logger = logging.getLogger(__name__)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip ``torch.compile`` / DDP wrappers so module names match the checkpoint's."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            return model


def logical_weight(module: nn.Module) -> Tensor:
    """The weight as ``(out_features, in_features)``: a view, so in-place edits reach the parameter."""
    if isinstance(module, Conv1D):
        return module.weight.T
    return module.weight


def logical_shape(module: nn.Module) -> tuple[int, int]:
    rows, cols = logical_weight(module).shape
    return int(rows), int(cols)


def is_prunable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | Conv1D)


@dataclass
class TargetLayer:
    """A layer chosen for pruning: its qualified name, the module, its logical ``(out, in)`` shape and whether the
    dense module stores ``(in, out)`` (GPT-2 ``Conv1D``).

    ``compact`` is set once the layer has been replaced by a compact module whose ``weight`` holds only the kept
    values, in the order of the mask's ``True`` entries (see :mod:`hf_sparse.compaction`); ``module`` is then that
    module, and :attr:`weight` is no longer a dense view.
    """

    name: str
    module: nn.Module
    shape: tuple[int, int] = field(init=False)
    transposed: bool = field(init=False)
    compact: bool = False

    def __post_init__(self) -> None:
        self.shape = logical_shape(self.module)
        self.transposed = isinstance(self.module, Conv1D)

    @property
    def weight(self) -> Tensor:
        """The logical ``(out, in)`` dense weight (a view of the parameter); compact layers have none."""
        if self.compact:
            raise RuntimeError(f"{self.name} is compact: its weight holds the kept values only")
        return logical_weight(self.module)


def _matches(name: str, regexes: list[str]) -> bool:
    return any(re.search(r, name) for r in regexes)


def find_target_layers(model: nn.Module, config: SparsityConfig, pattern: Pattern | None = None) -> list[TargetLayer]:
    """The Linear/Conv1D layers that ``config`` targets and ``pattern`` can tile, in module order.

    A layer whose shape the pattern cannot tile is left dense with one warning naming it, or raises if the user
    targeted it explicitly (``config.targets`` given and matching it).
    """
    pattern = pattern or config.parsed_pattern
    targets, ignore = config.target_regexes, config.ignore_regexes
    explicit = config.targets is not None
    chosen: list[TargetLayer] = []
    skipped: list[str] = []
    for name, module in unwrap_model(model).named_modules():
        if not is_prunable(module) or not _matches(name, targets) or _matches(name, ignore):
            continue
        rows, cols = logical_shape(module)
        problem = pattern.fit_error(rows, cols)
        if config.transposable and rows % 4:
            problem = f"out_features={rows} is not a multiple of 4 (transposable 2:4 masks tile 4x4 blocks)"
        if problem:
            if explicit:
                raise ValueError(
                    f"layer {name!r} ({rows}x{cols}) was targeted explicitly but pattern {pattern} cannot tile it: "
                    f"{problem}. Remove it from `targets` or add it to `ignore`."
                )
            skipped.append(f"{name} ({problem})")
            continue
        chosen.append(TargetLayer(name, module))
    if skipped:
        warnings.warn(
            f"hf_sparse: pattern {pattern} cannot tile {len(skipped)} layer(s), left dense: " + "; ".join(skipped),
            stacklevel=3,
        )
    if not chosen:
        raise ValueError(
            f"no layer matched targets={targets} (ignore={ignore}) with a shape pattern {pattern} can tile; "
            "print [n for n, _ in model.named_modules()] to see the names and set SparsityConfig.targets"
        )
    logger.info("hf_sparse: pruning %d layers to %s", len(chosen), pattern)
    return chosen
