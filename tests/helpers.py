"""Building pruned tiny models for the tests without running a Trainer."""

from __future__ import annotations

import torch

from hf_sparse import Pruner, SparsityConfig


def prune_now(model, pattern: str = "2:4", **kwargs) -> Pruner:
    """Prune ``model`` in place, one shot, with trained-looking (non-zero) weights; returns the pruner."""
    config = SparsityConfig(pattern=pattern, schedule="oneshot", start=0, end=0, **kwargs)
    pruner = Pruner(model, config)
    pruner.bind(1)
    pruner.update(0)
    return pruner


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out.start_logits
