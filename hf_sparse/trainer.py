"""``SparseTrainer``: a ``transformers.Trainer`` that prunes while it trains and saves compressed checkpoints."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import Trainer

from .callback import SparsityCallback
from .config import SparsityConfig
from .modeling import unwrap_model
from .pruner import Pruner
from .serialization import save_pretrained

__all__ = ["SparseTrainer"]

logger = logging.getLogger(__name__)


class SparseTrainer(Trainer):
    """``Trainer`` plus gradual N:M / V:N:M pruning.

    Everything ``Trainer`` takes works unchanged; ``sparsity_config`` adds a :class:`SparsityCallback`. On top of
    the callback, this class:

    * logs sparsity metrics through ``Trainer.log`` so every reporting integration receives them;
    * writes ``save_model`` output in the compressed hf_sparse format (``quantization_config`` in ``config.json``),
      while the ``checkpoint-N`` folders written for resuming stay dense with the masks beside them, so
      ``train(resume_from_checkpoint=...)`` restores weights, optimizer and masks exactly;
    * restores the pruner state from the checkpoint it resumes from.

    ``sparsity_config=None`` trains like ``Trainer`` (useful to fine-tune a model loaded from an hf_sparse
    checkpoint: its :class:`~hf_sparse.nn.SparseLinear` layers keep their pattern by construction).
    """

    def __init__(self, *args: Any, sparsity_config: SparsityConfig | None = None, **kwargs: Any) -> None:
        callbacks = list(kwargs.pop("callbacks", None) or [])
        self.sparsity_callback: SparsityCallback | None = None
        if sparsity_config is not None:
            if not isinstance(sparsity_config, SparsityConfig):
                raise TypeError(f"sparsity_config must be a SparsityConfig, got {type(sparsity_config).__name__}")
            self.sparsity_callback = SparsityCallback(sparsity_config)
            self.sparsity_callback.adds_metrics_to_logs = False
            callbacks.append(self.sparsity_callback)
        super().__init__(*args, callbacks=callbacks, **kwargs)
        if self.sparsity_callback is not None:
            # find targets now, so a bad config fails before training starts
            self.sparsity_callback.pruner = Pruner(unwrap_model(self.model), sparsity_config)

    @property
    def pruner(self) -> Pruner | None:
        return self.sparsity_callback.pruner if self.sparsity_callback is not None else None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.sparsity_callback is not None and ("loss" in logs or "train_loss" in logs):
            logs = {**logs, **self.sparsity_callback.metrics_for_log()}
        super().log(logs, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        if self.sparsity_callback is not None and not self.sparsity_callback.load_state(resume_from_checkpoint):
            logger.warning("hf_sparse: %s has no pruner state", resume_from_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Compressed checkpoint (``quantization_config`` in ``config.json``) once the model has been pruned.

        Checkpoints that ``Trainer`` writes for resuming (``_internal_call``) stay dense.
        """
        pruner = self.pruner
        if _internal_call or pruner is None or pruner.current_pattern() is None:
            super().save_model(output_dir, _internal_call=_internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        save_pretrained(self.accelerator.unwrap_model(self.model, keep_torch_compile=False), output_dir, pruner)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        import torch
        from transformers.trainer import TRAINING_ARGS_NAME

        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        self.sparsity_callback.config.to_json_file(os.path.join(output_dir, "hf_sparse_config.json"))
