"""``SparsityCallback``: gradual pruning for any ``transformers.Trainer``.

Event by event:

* ``on_init_end`` (inside ``Trainer.__init__``, before the optimizer and any wrapper exist): find the targeted
  layers (a bad config fails here), let ``load_state_dict`` read checkpoints written before or after the compact
  switch (:func:`hf_sparse.compaction.install_load_hook`), and, when the masks are final from the start (a one-shot
  schedule at step 0), prune and make the layers compact now, so the optimizer, DDP and FSDP2 only ever see the
  kept values.
* ``on_train_begin``: bind the schedule to ``state.max_steps``, follow the Parameters a wrapper may have replaced
  (FSDP2), give activation-aware scores their calibration batches (see :func:`calibration_loader`) and, when
  resuming, restore the masks saved with the checkpoint (see :meth:`SparsityCallback.load_state`).
* ``on_step_begin``: update the masks if this optimizer step is an update step of the schedule; once they are
  final, make the layers compact and move their optimizer state (:func:`hf_sparse.compaction.make_compact`), unless
  a DDP/FSDP wrapper holds the Parameters: then the run stays on the masked dense path and says why once.
* during backward: each targeted weight's gradient is masked as it is accumulated (a hook installed by the
  pruner), so clipping and the optimizer see zeros at pruned positions.
* ``on_pre_optimizer_step``: hand the step's full gradient to gradient-based scores (OBS) in the steps before a
  mask update, and add the masked decay in dynamic mode.
* ``on_optimizer_step``: re-apply the masks, so pruned weights stay exactly ``+0.0`` under momentum and decay.
* ``on_step_begin`` / ``on_step_end`` once layers are compact (on CUDA, ``SparsityConfig.compact_fallback``): time a
  few real training steps on the compact layers and, unless the layers' own measurements already decide, a few on the
  masked dense ones; keep the faster and log one line saying so (:mod:`hf_sparse.compact_fallback`). Under
  ``torch_compile=True`` the compiled step is timed against the eager one instead.
* ``on_train_end``: torch.compile's stance back as it was, where the eager step won.
* ``on_log``: add overall sparsity, target and flip rate to the logs (per-layer sparsity after each mask update).
* ``on_save``: write the pruner state (bit-packed masks, level, schedule position, which layers are compact, where
  the compact/dense comparison stands) into the checkpoint folder.

``SparsityConfig(compact=False)`` keeps the dense masked layers to the end.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .calibration import CalibrationSource
from .compact_fallback import CompactFallback
from .compaction import install_load_hook, make_compact, why_not_compact_now
from .config import SparsityConfig
from .distributed import full_tensor
from .modeling import unwrap_model
from .ops._build import KernelUnavailableError, load_extension
from .pruner import Pruner

__all__ = ["PRUNER_STATE_NAME", "SparsityCallback", "calibration_loader"]

logger = logging.getLogger(__name__)

#: File written next to every Trainer checkpoint.
PRUNER_STATE_NAME = "hf_sparse_pruner.safetensors"


def calibration_loader(train_dataloader, num_batches: int, seed: int) -> Callable[[], Iterable]:
    """Calibration batches drawn from the training data: the ``num_batches`` first batches of a new loader over the
    train dataloader's dataset and collator (unused columns already removed by ``Trainer``), shuffled by a
    generator seeded with ``seed``, so every mask update sees the same batches. Iterating it does not touch the
    training loader's iteration, sampler state or RNG."""
    dataset, collate = train_dataloader.dataset, train_dataloader.collate_fn
    batch_size = getattr(train_dataloader, "batch_size", None)
    batch_size = batch_size or getattr(getattr(train_dataloader, "batch_sampler", None), "batch_size", None) or 8

    def batches() -> Iterable:
        shuffle = not isinstance(dataset, torch.utils.data.IterableDataset)
        generator = torch.Generator().manual_seed(seed)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=collate, generator=generator
        )
        for i, batch in enumerate(loader):
            if i >= num_batches:
                return
            yield batch

    return batches


class SparsityCallback(TrainerCallback):
    """Prunes the model a ``Trainer`` trains according to ``config``.

    Args:
        config: what to prune and when.
        resume_from: a checkpoint folder to restore the pruner state from; by default, when ``Trainer`` resumes,
            the state is read from ``output_dir/checkpoint-<global_step>``.
        calibration: batches for activation-aware scores (``"wanda"``, ``"sparsegpt"``): an iterable of dicts of
            tensors or a function returning one (at most ``config.calibration_batches`` of its batches are used);
            by default ``config.calibration_batches`` batches of the training data (:func:`calibration_loader`).
    """

    def __init__(
        self,
        config: SparsityConfig,
        resume_from: str | os.PathLike | None = None,
        calibration: CalibrationSource | None = None,
    ) -> None:
        if not isinstance(config, SparsityConfig):
            raise TypeError(f"SparsityCallback needs a SparsityConfig, got {type(config).__name__}")
        self.config = config
        self.pruner: Pruner | None = None
        self.resume_from = resume_from
        self.calibration = calibration
        self._pending_state: str | None = None
        self._log_per_layer = False
        self._compact_refused = False
        self._load_hook = None
        self.fallback = CompactFallback(config.compact_fallback, config.compact_fallback_steps)
        #: set by SparseTrainer, which merges metrics in Trainer.log itself
        self.adds_metrics_to_logs = True

    # ------------------------------------------------------------------ setup
    def setup(self, model, max_steps: int) -> Pruner:
        """Build the pruner for ``model`` (idempotent) and bind its schedule to ``max_steps``."""
        if self.pruner is None:
            self.pruner = Pruner(model, self.config)
        if max_steps <= 0:
            raise ValueError(
                f"SparsityCallback: this training run has {max_steps} optimizer steps, so no pruning schedule can run: "
                "set max_steps >= 1, or max_steps=-1 with num_train_epochs > 0 and a non-empty train dataset"
            )
        self.pruner.bind(max_steps)
        return self.pruner

    def load_state(self, checkpoint_dir: str | os.PathLike) -> bool:
        """Queue the pruner state of ``checkpoint_dir`` for restoring; returns whether it exists there."""
        path = os.path.join(checkpoint_dir, PRUNER_STATE_NAME)
        if not os.path.isfile(path):
            return False
        self._pending_state = path
        if self.pruner is not None and self.pruner.plan is not None:
            self._restore()
        return True

    def check_checkpoint(self, checkpoint_dir: str | os.PathLike) -> None:
        """Before a resume loads weights: refuse a checkpoint whose pruner state was saved with another ``pattern``,
        ``targets`` or ``ignore`` (its compact layers would not fit this model's), naming the fields."""
        path = os.path.join(checkpoint_dir, PRUNER_STATE_NAME)
        if self.pruner is None or not os.path.isfile(path):
            return
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            self.pruner.check_saved_config(fh.metadata() or {})

    def _restore(self) -> None:
        assert self.pruner is not None and self._pending_state is not None
        from safetensors import safe_open

        with safe_open(self._pending_state, framework="pt") as fh:
            meta = fh.metadata() or {}
        self.pruner.load_state_dict(load_file(self._pending_state), meta)
        if "compact_fallback" in meta:
            device = self.pruner.layers[0].module.weight.device if self.pruner.layers else None
            self.fallback.load_state_dict(json.loads(meta["compact_fallback"]), device)
        logger.info("hf_sparse: restored pruner state from %s", self._pending_state)
        self._pending_state = None

    # ------------------------------------------------------------------ compact layers
    def _make_compact(self, model, optimizer, step: int) -> None:
        """Make the pruned layers compact if the masks are final, or log once why not (see :mod:`hf_sparse.compaction`)."""
        pruner = self.pruner
        if not self.config.compact or not pruner.masks_final or not pruner.dense_layers or self._compact_refused:
            return
        if self.fallback.holds_dense(step):  # the masked dense layers are being timed, or measured faster
            return
        why = why_not_compact_now(model, optimizer)
        if why is not None:
            self._compact_refused = True
            logger.warning(
                "hf_sparse: masks are final at step %d but the layers stay dense and masked: %s. To train them "
                "compact, reach the final masks before training (schedule='oneshot', start=0)",
                step,
                why,
            )
            return
        done = make_compact(model, pruner, optimizer)
        if done:
            logger.info(
                "hf_sparse: %d layers are compact (%s), holding their kept values only",
                len(done),
                pruner.current_pattern(),
            )

    # ------------------------------------------------------------------ events
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model=None, **kwargs):
        """Inside ``Trainer.__init__``: targets, the checkpoint load hook, and compact layers when the masks are final
        from the start (pruned here from the initial weights, as the first step would)."""
        if model is None:
            return
        if self.pruner is None:
            self.pruner = Pruner(unwrap_model(model), self.config)
        if self._load_hook is None:
            self._load_hook = install_load_hook(model, self.pruner)
        if self.config.compact and self._calibrated_at_init() and self.pruner.prune_at_start():
            self._make_compact(model, None, 0)

    def _calibrated_at_init(self) -> bool:
        """Whether the score can prune inside ``Trainer.__init__``: activation-aware scores need calibration batches,
        which then exist only when given to the callback (the train dataloader comes at train start; without given
        batches the one-shot masks are made at step 0 and the layers turn compact there)."""
        if not self.pruner.scorer.needs_calibration:
            return True
        if self.calibration is None:
            return False
        self.pruner.set_calibration(self.calibration, self.config.calibration_batches)
        return True

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        model = kwargs["model"]
        self.setup(model, state.max_steps)
        self._load_kernels(model)
        self.pruner.rebind()  # the model is wrapped by now: FSDP2 has replaced the Parameters the hooks were on
        if self.pruner.scorer.needs_calibration:
            if self.calibration is not None:
                self.pruner.set_calibration(self.calibration, self.config.calibration_batches)
            elif kwargs.get("train_dataloader") is not None:
                loader = calibration_loader(kwargs["train_dataloader"], self.config.calibration_batches, args.seed)
                self.pruner.set_calibration(loader)
        if self.resume_from is not None:
            if not self.load_state(self.resume_from):
                raise FileNotFoundError(f"SparsityCallback: no {PRUNER_STATE_NAME} in {self.resume_from}")
        elif self._pending_state is None and state.global_step > 0:
            self.load_state(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
        if self._pending_state is not None:
            self._restore()
        elif state.global_step > 0 and self.pruner.last_update_step is None:
            self._rebuild_from_weights(state.global_step)
        if not self.pruner.masks_final:
            self.pruner.check_can_update()  # mask updates are ahead: fail now, not at the first one
        self._make_compact(model, kwargs.get("optimizer"), state.global_step)

    def _load_kernels(self, model) -> None:
        """On CUDA, load the kernels before the first step (building them on first use, ~1-2 minutes, cached): the
        mask selection of every pruning step and the compact layers then run on them, and the build does not land in
        the middle of training. Where they cannot be built, training goes on without them."""
        weight = next(unwrap_model(model).parameters(), None)
        if self.config.kernels == "auto" and weight is not None and weight.is_cuda:
            try:
                load_extension()
            except KernelUnavailableError as err:
                logger.info("hf_sparse: the CUDA kernels are unavailable: %s", err)

    def _rebuild_from_weights(self, step: int) -> None:
        """Resuming without a saved pruner state: masks are the non-zeros of the resumed weights, at the level the
        schedule gives. Exact unless a kept weight happens to be exactly zero."""
        pruner = self.pruner
        assert pruner is not None and pruner.plan is not None
        level = pruner.plan.level(step)
        if level is None or pruner.in_dense_phase(step):
            return
        if pruner.config.dynamic:  # the master weights are dense: their zeros say nothing, recompute the masks
            logger.warning(
                "hf_sparse: resuming at step %d without %s; recomputing dynamic masks", step, PRUNER_STATE_NAME
            )
            pruner.recompute(level)
            pruner.last_update_step = pruner.plan.last_update_step(step)
            return
        logger.warning(
            "hf_sparse: resuming at step %d without %s; rebuilding masks from the weights' non-zeros",
            step,
            PRUNER_STATE_NAME,
        )
        for layer in pruner.dense_layers:
            pruner.masks[layer.name] = (full_tensor(layer.weight.detach()) != 0).contiguous()
        pruner.level = level
        pruner.last_update_step = pruner.plan.last_update_step(step)
        pruner.apply()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.pruner is None:
            return
        model = kwargs.get("model")
        if self.pruner.update(state.global_step):
            self._log_per_layer = True
            if model is not None:
                self._make_compact(model, kwargs.get("optimizer"), state.global_step)
        if model is not None and self.config.compact:
            self.fallback.begin_step(
                state.global_step,
                state.max_steps,
                model,
                self.pruner,
                kwargs.get("optimizer"),
                args.torch_compile,
                passes=args.gradient_accumulation_steps,
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """Time compact against masked dense layers and keep the faster (:mod:`hf_sparse.compact_fallback`)."""
        model = kwargs.get("model")
        if self.pruner is not None and model is not None and self.config.compact:
            pause = control.should_save or control.should_evaluate or control.should_training_stop
            self.fallback.end_step(state.global_step, pause, model, self.pruner, kwargs.get("optimizer"))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """torch.compile's stance back as it was, where the eager step won (:mod:`hf_sparse.compact_fallback`)."""
        self.fallback.end_training()

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """The step's full gradient (accumulated, all-reduced under DDP, clipped): OBS statistics, masked decay."""
        if self.pruner is not None:
            self.pruner.before_optimizer_step(state.global_step)

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.pruner is not None:
            self.pruner.apply(kwargs.get("optimizer"))  # with the optimizer, settled layers need no masking

    def metrics_for_log(self) -> dict[str, float]:
        """Metrics to merge into the next log call (per-layer values only after a mask update)."""
        if self.pruner is None:
            return {}
        metrics = self.pruner.metrics(per_layer=self._log_per_layer)
        self._log_per_layer = False
        return metrics

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not self.adds_metrics_to_logs or logs is None or self.pruner is None:
            return
        if "loss" not in logs and "train_loss" not in logs:
            return  # only training logs, not evaluation ones
        metrics = self.metrics_for_log()
        logs.update(metrics)
        if state.log_history:
            state.log_history[-1].update(metrics)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.pruner is None or not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):
            logger.warning("hf_sparse: checkpoint folder %s not found; pruner state not saved", folder)
            return
        tensors, meta = self.pruner.state_dict()
        meta["compact_fallback"] = json.dumps(self.fallback.state_dict())
        tmp = os.path.join(folder, PRUNER_STATE_NAME + ".tmp")
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, os.path.join(folder, PRUNER_STATE_NAME))  # atomic: never a half-written state
        with open(os.path.join(folder, "hf_sparse_config.json"), "w") as fh:
            json.dump(self.config.to_dict(), fh, indent=2)
