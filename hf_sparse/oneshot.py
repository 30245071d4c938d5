"""``hf_sparse.oneshot``: prune a model once, now, from calibration data, without training.

The entry point for post-training sparsity (what ``llm-compressor``'s ``oneshot`` used to offer)::

    import hf_sparse
    from hf_sparse import SparsityConfig

    pruner = hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="sparsegpt"), calibration=dataloader)
    hf_sparse.save_pretrained(model, "out", pruner)          # the compressed checkpoint

``calibration`` is any iterable of batches (dicts of tensors, as a ``DataLoader`` with a Transformers collator
yields; labels are ignored); 8-16 batches of 8-16 sequences are typical. ``hf-sparse prune`` does the same from the
command line, reading the text from a CSV/TSV/JSON file.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .calibration import CalibrationSource
from .config import SparsityConfig
from .pruner import Pruner
from .scoring import get_score

__all__ = ["oneshot"]


def oneshot(
    model: nn.Module,
    config: SparsityConfig,
    calibration: CalibrationSource | None = None,
    *,
    max_batches: int | None = None,
    progress: bool = True,
) -> Pruner:
    """Prune ``model`` in place to ``config.pattern`` with ``config.score``; returns the :class:`Pruner` that holds
    the masks (for :func:`hf_sparse.save_pretrained`).

    The schedule fields of ``config`` are replaced by a one-shot schedule (the pruner's and the saved config say
    ``schedule="oneshot"``). ``"wanda"`` and ``"sparsegpt"`` need ``calibration`` (all its batches, or the first
    ``max_batches``); ``"magnitude"`` ignores it. ``"obs"`` needs training gradients and is refused: use it with
    :class:`~hf_sparse.SparseTrainer`. ``progress`` shows a bar over the blocks of the calibration pass. The
    returned pruner has no gradient hooks on the model: train the pruned model further with a
    :class:`~hf_sparse.SparsityCallback` of its own, or load the saved checkpoint (its layers keep their pattern).
    """
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"oneshot needs a SparsityConfig, got {type(config).__name__}")
    scorer = get_score(config.score)
    if scorer.needs_gradients:
        raise ValueError(
            f"score={config.score!r} ranks weights with training gradients, which one-shot pruning has none of; use "
            "'sparsegpt' or 'wanda' (calibration data), 'magnitude', or SparseTrainer for a gradual OBS run"
        )
    if config.dynamic:
        raise ValueError("oneshot: SparsityConfig.dynamic=True moves masks during training; one-shot has no training")
    if scorer.needs_calibration and calibration is None:
        raise ValueError(
            f"score={config.score!r} needs calibration batches: oneshot(model, config, calibration=dataloader), an "
            "iterable of dicts of tensors (input_ids, attention_mask, ...)"
        )
    oneshot_config = dataclasses.replace(config, schedule="oneshot", start=0, end=0)
    pruner = Pruner(model, oneshot_config)
    pruner.remove_hooks()  # no training follows: gradient masking hooks would outlive this call
    pruner.set_calibration(calibration, max_batches)
    pruner.calibration_progress = progress
    pruner.bind(1)
    pruner.update(0)
    pruner.set_calibration(None)  # do not keep the user's data alive through the pruner
    return pruner
