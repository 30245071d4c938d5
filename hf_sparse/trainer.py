"""``SparseTrainer``: a ``transformers.Trainer`` that prunes while it trains and saves compressed checkpoints."""

from __future__ import annotations

import copy
import logging
import os
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from .callback import SparsityCallback
from .config import SparsityConfig
from .distributed import has_sharded_parameters, is_main_process
from .modeling import unwrap_model
from .pruner import Pruner
from .serialization import save_pretrained

__all__ = ["SparseTrainer"]

logger = logging.getLogger(__name__)


def _warn_teacher_at_step_0() -> None:
    warnings.warn(
        "hf_sparse: self-distillation teacher taken at step 0, before any fine-tuning; give the run a dense phase "
        "(SparsityConfig.start > 0) so the teacher has learnt the task",
        stacklevel=3,
    )


class _DenseTeacherSnapshot(TrainerCallback):
    """Self-distillation: at the step where pruning begins (before the sparsity callback prunes), a frozen copy of
    the model as it is then (the end of the dense phase) becomes the trainer's teacher."""

    def __init__(self, trainer: SparseTrainer) -> None:
        self.trainer = trainer
        self.warned = False
        self.taken_at_start = False

    def _take(self, model, step: int) -> None:
        teacher = copy.deepcopy(unwrap_model(model))
        self.trainer.teacher_model = teacher.eval().requires_grad_(False)
        logger.info("hf_sparse: step %d: dense model copied as the self-distillation teacher", step)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        """Masks final from the start are made inside ``Trainer.__init__`` (the compact switch): copy the model
        before the sparsity callback, which runs after this one, prunes it."""
        cfg = self.trainer.sparsity_callback.config
        if model is not None and not cfg.dynamic and cfg.start == 0 and (cfg.schedule == "oneshot" or cfg.end == 0):
            self._take(model, 0)
            self.taken_at_start = True

    def on_train_begin(self, args, state, control, **kwargs):
        if self.taken_at_start and state.global_step == 0:
            _warn_teacher_at_step_0()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        trainer, pruner = self.trainer, self.trainer.pruner
        if trainer.teacher_model is not None or pruner is None or pruner.plan is None or model is None:
            return
        if pruner.level is None and pruner.plan.level(state.global_step) is not None:
            self._take(model, state.global_step)
            if state.global_step == 0:
                _warn_teacher_at_step_0()
        elif pruner.level is not None and not self.warned:
            self.warned = True
            warnings.warn(
                "hf_sparse: self-distillation: training resumed after the dense phase, whose model (the teacher) is "
                "not saved in checkpoints; training goes on without distillation",
                stacklevel=2,
            )


class SparseTrainer(Trainer):
    """``Trainer`` plus gradual N:M / V:N:M pruning.

    Everything ``Trainer`` takes works unchanged; ``sparsity_config`` adds a :class:`SparsityCallback`. On top of
    the callback, this class:

    * logs sparsity metrics through ``Trainer.log`` so every reporting integration receives them;
    * writes ``save_model`` output in the compressed hf_sparse format (``quantization_config`` in ``config.json``),
      while the ``checkpoint-N`` folders written for resuming hold the model as it trains (dense masked layers,
      or compact ones after the switch) with the masks beside them, so ``train(resume_from_checkpoint=...)``
      restores weights, optimizer and masks exactly;
    * restores the pruner state from the checkpoint it resumes from, and from the best checkpoint with
      ``load_best_model_at_end``.

    The callback makes the pruned layers compact once their masks are final (:mod:`hf_sparse.compaction`;
    ``SparsityConfig(compact=False)`` turns this off).

    ``sparsity_config=None`` trains like ``Trainer`` (useful to fine-tune a model loaded from an hf_sparse
    checkpoint: its :class:`~hf_sparse.nn.SparseLinear` layers keep their pattern by construction).

    Distillation: with ``teacher_model`` (a dense model already fine-tuned on the task, same head and tokenizer)
    the training loss becomes ``(1 - distill_alpha) * task_loss + distill_alpha * kd_loss`` (see
    :mod:`hf_sparse.distillation`). The teacher is frozen, kept in eval mode and moved to the training device; it
    runs under the same autocast as the student and only on training batches (evaluation reports the task loss).

    Self-distillation: with ``self_distillation=True`` (and no ``teacher_model``) the teacher is the model itself as
    it is when pruning begins: at the first pruning step a frozen copy is taken (one more copy of the model in
    memory), so a run with a dense phase (``SparsityConfig.start > 0``) distils the pruned model from its own dense
    phase, with no separate teacher run. Before that step the loss is the task loss.
    """

    def __init__(
        self,
        *args: Any,
        sparsity_config: SparsityConfig | None = None,
        teacher_model: torch.nn.Module | None = None,
        self_distillation: bool = False,
        distill_alpha: float = 0.5,
        distill_temperature: float = 2.0,
        **kwargs: Any,
    ) -> None:
        if self_distillation and teacher_model is not None:
            raise ValueError("give teacher_model or self_distillation=True, not both: self-distillation makes its own")
        if self_distillation and sparsity_config is None:
            raise ValueError("self_distillation=True needs a sparsity_config: the teacher is the model before pruning")
        if teacher_model is not None or self_distillation:
            if not 0.0 <= distill_alpha <= 1.0:
                raise ValueError(
                    f"distill_alpha must be in [0, 1] (weight of the distillation loss), got {distill_alpha}"
                )
            if distill_temperature <= 0:
                raise ValueError(f"distill_temperature must be > 0, got {distill_temperature}")
        if teacher_model is not None:
            teacher_model.eval().requires_grad_(False)
        self.teacher_model = teacher_model
        self.distill_alpha = distill_alpha
        self.distill_temperature = distill_temperature
        callbacks = list(kwargs.pop("callbacks", None) or [])
        self.sparsity_callback: SparsityCallback | None = None
        if sparsity_config is not None:
            if not isinstance(sparsity_config, SparsityConfig):
                raise TypeError(f"sparsity_config must be a SparsityConfig, got {type(sparsity_config).__name__}")
            self.sparsity_callback = SparsityCallback(sparsity_config)
            self.sparsity_callback.adds_metrics_to_logs = False
            if self_distillation:
                callbacks.append(_DenseTeacherSnapshot(self))  # before the sparsity callback prunes
            callbacks.append(self.sparsity_callback)
        self._counted_parameters: tuple[tuple, int] | None = None  # see floating_point_ops
        super().__init__(*args, callbacks=callbacks, **kwargs)  # the callback's on_init_end finds the targets

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``Trainer.compute_loss``, mixed with the distillation loss on training batches when a teacher is set."""
        if self.teacher_model is None or not model.training:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        from .distillation import distillation_loss

        teacher_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "start_positions", "end_positions")}
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        teacher = self.teacher_model
        device = next(model.parameters()).device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        with torch.no_grad():
            teacher_outputs = teacher(**teacher_inputs)
        kd = distillation_loss(outputs, teacher_outputs, self.distill_temperature)
        if self._task_loss_scaled_for_ga(num_items_in_batch):
            # Trainer will not divide this loss by the accumulation steps: do it for the per-batch-mean KD term
            kd = kd / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        loss = (1.0 - self.distill_alpha) * loss + self.distill_alpha * kd
        return (loss, outputs) if return_outputs else loss

    def _task_loss_scaled_for_ga(self, num_items_in_batch) -> bool:
        """The rule ``Trainer.training_step`` applies to decide whether the loss is already normalised over the
        whole accumulated batch."""
        declared = getattr(self, "loss_is_scaled_for_ga", None)  # a class attribute since transformers 5.2x
        if declared is not None:
            return bool(declared)
        return (
            self.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or self.compute_loss_func is not None

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """``Trainer.floating_point_ops`` (6 x input tokens x non-embedding parameters, summed into ``total_flos``),
        with the parameter count kept between steps. ``Trainer`` counts on every step by walking every module and
        parameter of the model, about a millisecond of host time per step for BERT-large's 24 layers; the step waits
        for it, since it runs after ``Trainer``'s check of the loss has synchronised with the GPU. The count is made
        again when the model object changes or the pruner switches a layer between its compact and dense forms (a
        compact layer's parameter holds its kept values only)."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        pruner = self.pruner
        key = (id(self.model), None if pruner is None else (id(pruner), pruner.module_version))
        if self._counted_parameters is None or self._counted_parameters[0] != key:
            self._counted_parameters = (key, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self._counted_parameters[1]

    @property
    def pruner(self) -> Pruner | None:
        return self.sparsity_callback.pruner if self.sparsity_callback is not None else None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.sparsity_callback is not None and ("loss" in logs or "train_loss" in logs):
            logs = {**logs, **self.sparsity_callback.metrics_for_log()}
        super().log(logs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any):
        """``Trainer.train``; torch.compile's stance comes back as it was also where training stops on an exception
        (``on_train_end`` does not run then): the compiled-or-eager comparison may have set it aside."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.sparsity_callback is not None:
                self.sparsity_callback.fallback.end_training()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.sparsity_callback is not None:
            self.sparsity_callback.check_checkpoint(resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        if self.sparsity_callback is not None and not self.sparsity_callback.load_state(resume_from_checkpoint):
            logger.warning("hf_sparse: %s has no pruner state", resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """The best checkpoint may predate the final masks: restore the masks saved with it too."""
        super()._load_best_model()
        best = self.state.best_model_checkpoint
        if self.sparsity_callback is not None and best and not self.sparsity_callback.load_state(best):
            logger.warning("hf_sparse: best checkpoint %s has no pruner state; keeping the final masks", best)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Compressed checkpoint (``quantization_config`` in ``config.json``) once the model has been pruned, and
        a model card that says what the checkpoint holds (the pattern reached; dense when nothing was pruned).

        Checkpoints that ``Trainer`` writes for resuming (``_internal_call``) stay dense. Under FSDP2 call it on
        every rank (as with ``Trainer.save_model``): the full weights are gathered and the main process writes.
        """
        pruner = self.pruner
        if _internal_call or pruner is None or pruner.current_pattern() is None:
            super().save_model(output_dir, _internal_call=_internal_call)
            if not _internal_call and pruner is not None and self.args.should_save:
                self._write_model_card(output_dir if output_dir is not None else self.args.output_dir)  # "dense"
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        writer = self.args.should_save
        if has_sharded_parameters(model):
            writer = writer and is_main_process()  # the gather leaves the full weights on rank 0 only
            if writer:
                os.makedirs(output_dir, exist_ok=True)
            save_pretrained(model, output_dir, pruner)  # FSDP2: every rank joins the gather, rank 0 writes
        elif writer:
            os.makedirs(output_dir, exist_ok=True)
            save_pretrained(model, output_dir, pruner)
        if not writer:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        from transformers.trainer import TRAINING_ARGS_NAME

        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        self.sparsity_callback.config.to_json_file(os.path.join(output_dir, "hf_sparse_config.json"))
        self._write_model_card(output_dir)

    def _write_model_card(self, output_dir: str) -> None:
        """README.md (+ the sparsity/metric plot when matplotlib is installed) rendered from model_cards/."""
        from .hub import model_card_kwargs_from_trainer, write_model_card

        try:
            write_model_card(output_dir, **model_card_kwargs_from_trainer(self))
        except Exception as err:  # the weights are already saved: a card problem must not lose them
            warnings.warn(f"hf_sparse: model card not written to {output_dir}: {err}", stacklevel=3)

    def _compressed_model_bytes(self) -> int:
        """Bytes of the model's tensors once the pruned layers are compressed, computed from shapes alone (the
        upload compresses the model once; the card must not do it a second time)."""
        from .formats.compressed import compressed_nbytes
        from .patterns import Unstructured

        pattern = self.pruner.current_pattern()
        total = sum(t.numel() * t.element_size() for t in unwrap_model(self.model).state_dict().values())
        for layer in self.pruner.dense_layers:  # compact layers hold the compressed tensors already
            weight = layer.weight
            nnz = int(self.pruner.masks[layer.name].sum()) if isinstance(pattern, Unstructured) else None
            total += compressed_nbytes(pattern, *layer.shape, weight.element_size(), nnz)
            total -= weight.numel() * weight.element_size()
        return total

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ):
        """Upload the compressed model, ``config.json`` with its ``quantization_config``, the tokenizer and a
        generated model card in one commit to ``args.hub_model_id`` (or the output folder's name).

        Without a sparsity config this is ``Trainer.push_to_hub``. Extra ``kwargs`` (``task``, ``dataset``,
        ``dataset_id``, ``speedup``, ``base_model``) go into the card.
        """
        if self.pruner is None or self.pruner.current_pattern() is None:
            return super().push_to_hub(commit_message, blocking, token, revision, private, **kwargs)
        import tempfile
        from pathlib import Path

        from .hub import (
            PLOT_FILENAME,
            dense_weight_bytes,
            model_card_kwargs_from_trainer,
            push_to_hub,
            render_model_card,
            save_training_plot,
        )

        if has_sharded_parameters(self.model):
            raise NotImplementedError(
                "SparseTrainer.push_to_hub does not gather FSDP2-sharded weights: call trainer.save_model(folder) on "
                "every rank, then upload that folder from the main process (huggingface_hub.upload_folder)"
            )
        if not self.is_world_process_zero():
            return None
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        card_keys = ("task", "dataset", "dataset_id", "speedup", "base_model")
        card_kwargs = model_card_kwargs_from_trainer(self, **{k: kwargs.pop(k) for k in card_keys if k in kwargs})
        history = card_kwargs.pop("history")
        card_kwargs["checkpoint_bytes"] = self._compressed_model_bytes()
        card_kwargs["dense_bytes"] = card_kwargs.get("dense_bytes") or dense_weight_bytes(self.model)
        with tempfile.TemporaryDirectory(prefix="hf_sparse_plot_") as tmp:
            plot = save_training_plot(history, Path(tmp) / PLOT_FILENAME) if history else None
            card = render_model_card(
                **card_kwargs, history=history, plot_filename=plot.name if plot else None, repo_id=repo_id
            )
            return push_to_hub(
                self.model,
                repo_id,
                tokenizer=self.processing_class,
                pruner=self.pruner,
                card=card,
                extra_files={PLOT_FILENAME: plot} if plot else None,
                token=token if token is not None else self.args.hub_token,
                private=private if private is not None else self.args.hub_private_repo,
                commit_message=commit_message,
                revision=revision,
            )
