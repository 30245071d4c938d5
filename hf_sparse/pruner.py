"""The pruner: owns the targeted layers and their masks, updates them on schedule, keeps pruned weights at zero.
Once a layer is compact (:mod:`hf_sparse.compaction`) its positions are its mask, and the pruner keeps no copy.

It knows nothing of ``Trainer``: :mod:`hf_sparse.callback` drives it. What it guarantees:

* after :meth:`Pruner.update` at an update step, every targeted weight is masked to the level the schedule gives;
* gradients are masked as they are accumulated (a post-accumulate-grad hook per weight), so gradient clipping and
  the optimizer never see a pruned position's gradient, and :meth:`Pruner.apply` after each optimizer step
  re-zeroes what momentum or weight decay moved (once the masks are final, with Adam, AdamW or SGD, it zeroes the
  optimizer state at pruned positions once instead, after which nothing moves them);
* :meth:`state_dict` / :meth:`load_state_dict` restore masks, level and schedule position exactly.

Activation-aware scores (Wanda, SparseGPT: ``needs_calibration``) read the layers' inputs: :meth:`set_calibration`
says where the batches come from (``hf_sparse.oneshot``'s argument, or the training data through the callback),
and :meth:`recompute` then prunes each layer inside a block-by-block calibration pass
(:mod:`hf_sparse.calibration`), so every layer is scored on the inputs the already-pruned layers give it.

With ``SparsityConfig.dynamic`` the last two change on purpose (see :mod:`hf_sparse.dynamic`): gradients are not
masked, pruned weights are not zeroed, the layers compute with ``W ⊙ mask`` instead, and masks keep being
recomputed after the ramp until ``dense_finetune_start`` drops them. :attr:`Pruner.masks_final` says whether
the masks can still move.
"""

from __future__ import annotations

import json
import logging
import warnings
from ast import literal_eval
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from .calibration import CalibrationSource, prepare_batches, run_calibration
from .config import SparsityConfig
from .distributed import _broadcast_, broadcast_masks, count_zeros, full_tensor, is_sharded, local_part, world_size
from .dynamic import masked_decay_, remove_masked_forward, set_masked_forward
from .formats.bitpack import pack_bits, unpack_bits
from .masks import apply_mask, apply_masks, compute_mask, unstructured_mask, unstructured_threshold
from .modeling import TargetLayer, find_target_layers, unwrap_model
from .patterns import Pattern, Unstructured
from .schedules import SchedulePlan, _resolve_step
from .scoring import get_score

__all__ = ["Pruner"]

logger = logging.getLogger(__name__)


def _storage_of(t: Tensor) -> tuple[int, int]:
    """Which tensor ``t`` is, for telling a resumed optimizer's new state from the state that was zeroed: the object
    and its (local, for a sharded DTensor) storage address."""
    return id(t), (t.to_local() if is_sharded(t) else t).data_ptr()


# Optimizers whose update of an entry reads only that entry's weight, gradient and state, and leaves it at zero when
# all three are zero (weight decay included). Exact types: a subclass may change the update.
_ELEMENTWISE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

# SparsityConfig fields a resumed run must share with the saved pruner state: they decide which layers are masked
# and the masks' shape, so masks saved under other values do not fit.
_RESUME_FIELDS = ("pattern", "targets", "ignore")


class LayerMasks(MutableMapping):
    """A pruner's masks by layer name (``None``: no mask yet). A dense layer's mask is the pruner's; a compact layer's
    is its positions, which the layer owns: reading it decodes them (a new bool tensor each time), and it cannot be
    assigned. So a model whose layers turned compact holds no bool mask beside its positions."""

    def __init__(self, pruner: Pruner) -> None:
        self._pruner = pruner

    def __getitem__(self, name: str) -> Tensor | None:
        layer = self._pruner.layer_named(name)
        return layer.module.mask() if layer.compact else self._pruner._masks[name]

    def __setitem__(self, name: str, mask: Tensor | None) -> None:
        if self._pruner.layer_named(name).compact:
            raise ValueError(
                f"Pruner: {name} is compact, so its mask is its positions and cannot be set; make it dense first "
                "(hf_sparse.compaction.make_dense)"
            )
        self._pruner._masks[name] = mask

    def __delitem__(self, name: str) -> None:
        raise TypeError("Pruner masks cannot be deleted: assign None for a layer without a mask")

    def __iter__(self) -> Iterator[str]:
        return iter(self._pruner._masks)

    def __len__(self) -> int:
        return len(self._pruner._masks)


class Pruner:
    """Masks for the layers of ``model`` that ``config`` targets.

    Call :meth:`bind` with the run's total optimizer steps before :meth:`update`.
    """

    def __init__(self, model: nn.Module, config: SparsityConfig) -> None:
        self.config = config
        self.pattern: Pattern = config.parsed_pattern
        self.layers: list[TargetLayer] = find_target_layers(model, config, self.pattern)
        #: the masks of the dense layers (a compact layer's entry is unused: its positions are its mask)
        self._masks: dict[str, Tensor | None] = {layer.name: None for layer in self.layers}
        self.scorer = get_score(config.score, config)
        self.model = unwrap_model(model)
        self.calibration: CalibrationSource | None = None
        self.calibration_max_batches: int | None = None
        #: show a progress bar over the blocks of a calibration pass (hf_sparse.oneshot turns it on)
        self.calibration_progress = False
        self.plan: SchedulePlan | None = None
        self.dense_start_step: int | None = None
        self.level: int | float | None = None
        self.last_update_step: int | None = None
        self.flip_rate: float | None = None
        self._hooks: list[Any] = []
        self._hooked_params: list[Tensor] = []
        self._sharded_zeros: dict[str, tuple[int, int]] | None = None
        # layer -> (mask, stamp) under which its optimizer state was zeroed at pruned positions (see apply)
        self._zeroed_state: dict[str, tuple[Tensor, tuple]] = {}
        self.saved_compact: set[str] = set()
        #: how many times a targeted layer changed form (compact <-> dense, :meth:`replace_module`): what a count of
        #: the model's parameters kept between steps compares to know it still holds
        self.module_version = 0
        self._install_grad_hooks()

    # ------------------------------------------------------------------ schedule
    def bind(self, total_steps: int) -> SchedulePlan:
        cfg = self.config
        self.plan = SchedulePlan.build(self.pattern, cfg.schedule, cfg.start, cfg.end, cfg.update_every, total_steps)
        self._bind_dense_phase(total_steps)
        self._warn_if_unfinished(total_steps)
        return self.plan

    def _warn_if_unfinished(self, total_steps: int) -> None:
        """One warning when the schedule cannot reach the pattern within the run's optimizer steps (masks update
        at the start of a step, and the last step is ``total_steps - 1``): the saved model then holds a lower
        sparsity than the config names, or none at all."""
        plan, cfg = self.plan, self.config
        assert plan is not None
        last = total_steps - 1
        if plan.end_step <= last:
            return
        level = plan.level(last)
        if cfg.schedule == "oneshot":
            when = f"prunes to {self.pattern} at step {plan.start_step} (SparsityConfig.start={cfg.start!r})"
            change = f"Set start to a step below {total_steps} (or a fraction of the run below 1)"
        else:
            when = (
                f"starts at step {plan.start_step} (SparsityConfig.start={cfg.start!r}) and reaches {self.pattern} "
                f"at step {plan.end_step} (end={cfg.end!r})"
            )
            change = (
                f"Set start and end to steps below {total_steps} (or fractions of the run, e.g. start=0.1, end=0.6)"
            )
        if level is None:
            outcome = "no layer will be pruned and the saved model will be dense"
        else:
            outcome = f"the masks stop at {plan.pattern_at(level)} and the saved model holds that, not {self.pattern}"
        warnings.warn(
            f"hf_sparse: the sparsity schedule {when}, but this run's {total_steps} optimizer steps end at step "
            f"{last}: {outcome}. {change}, or train for at least {plan.end_step + 1} steps",
            stacklevel=3,
        )

    def update(self, step: int) -> bool:
        """Recompute masks if ``step`` is an update step not yet done; returns whether masks changed."""
        if self.plan is None:
            raise RuntimeError("Pruner.update() before Pruner.bind(total_steps)")
        if self.in_dense_phase(step):
            return self._drop_masks(step)
        if not self.is_update_step(step) or step == self.last_update_step:
            return False
        level = self.plan.quantise(self.plan.target_sparsity(step))
        self.last_update_step = step
        if level is None:
            return False
        self.recompute(level)
        return True

    def prune_at_start(self) -> bool:
        """If the masks are final from step 0 whatever the run's length (``start=0`` with a one-shot schedule or
        ``end=0``) and static: compute them now from the current weights, as the update at step 0 would, and return
        True (a later :meth:`bind` keeps them). Otherwise change nothing and return False."""
        cfg = self.config
        if cfg.dynamic or cfg.start != 0 or not (cfg.schedule == "oneshot" or cfg.end == 0):
            return False
        if self.plan is None:
            self.bind(1)  # start and end are step 0 for any number of steps
        self.update(0)
        return self.masks_final

    @property
    def is_final(self) -> bool:
        """True once the masks are at the final pattern (and, with a static schedule, will not change)."""
        return (
            self.plan is not None
            and self.level is not None
            and self.plan.quantise(self.pattern.sparsity) == self.level
        )

    @property
    def masks_final(self) -> bool:
        """True when the masks are at the final pattern and will never change again: from then on a layer can be
        made compact (:mod:`hf_sparse.compaction`). Never true in dynamic mode, where masks move until the run ends or
        the dense phase drops them."""
        return self.is_final and not self.config.dynamic

    # ------------------------------------------------------------------ dynamic masks
    def _bind_dense_phase(self, total_steps: int) -> None:
        start = self.config.dense_finetune_start
        self.dense_start_step = None if start is None else _resolve_step(start, total_steps)
        assert self.plan is not None
        if self.dense_start_step is not None and self.dense_start_step <= self.plan.end_step:
            raise ValueError(
                f"SparsityConfig.dense_finetune_start={start!r} is step {self.dense_start_step}, not after the end "
                f"of the ramp (step {self.plan.end_step}) of this {total_steps}-step run; move it later"
            )

    def in_dense_phase(self, step: int) -> bool:
        """True from ``dense_finetune_start`` on: no masks, the model trains dense."""
        return self.dense_start_step is not None and step >= self.dense_start_step

    def is_update_step(self, step: int) -> bool:
        """The schedule's update steps, plus, in dynamic mode, every ``update_every`` steps after ``end`` until the
        dense phase."""
        assert self.plan is not None
        if self.in_dense_phase(step):
            return False
        if self.plan.is_update_step(step):
            return True
        end = self.plan.end_step
        return self.config.dynamic and step > end and (step - end) % self.config.update_every == 0

    def _drop_masks(self, step: int) -> bool:
        """Enter the dense phase: forget the masks, restore the layers' dense forward. Returns whether it changed."""
        if self.level is None and all(mask is None for mask in self._masks.values()):
            return False
        for layer in self.dense_layers:
            self._masks[layer.name] = None
            remove_masked_forward(layer.module)
        self.level = None
        self.last_update_step = step
        logger.info("hf_sparse: step %d: dense fine-tuning phase, masks dropped", step)
        return True

    def _collects_gradients(self, step: int) -> bool:
        """Whether the gradient of optimizer step ``step`` is one of the ``gradient_window`` before an update that
        will build masks (updates happen at the start of a step, so step ``step``'s gradient serves ``> step``)."""
        assert self.plan is not None
        window = self.scorer.gradient_window
        if window is None:
            return True
        plan = self.plan
        return any(
            self.is_update_step(u) and plan.quantise(plan.target_sparsity(u)) is not None
            for u in range(step + 1, step + window + 1)
        )

    @torch.no_grad()
    def before_optimizer_step(self, step: int) -> None:
        """Called with the full gradient of optimizer step ``step`` (accumulated, all-reduced, clipped), before the
        optimizer uses it: gradient-based scores observe it, and dynamic mode adds the masked decay."""
        if self.plan is None:
            return
        if self.scorer.needs_gradients and self._collects_gradients(step):
            for layer in self.dense_layers:
                grad = layer.module.weight.grad
                if grad is not None:
                    self.scorer.observe_gradient(layer.name, layer.weight, grad.T if layer.transposed else grad)
        decay = self.config.masked_decay
        if decay and self.config.dynamic:
            for layer in self.dense_layers:
                grad, mask = layer.module.weight.grad, self._masks[layer.name]
                if grad is not None and mask is not None:
                    local_grad, local_mask = local_part(grad, mask, layer.transposed)
                    local_weight, _ = local_part(layer.module.weight, mask, layer.transposed)
                    masked_decay_(local_grad, local_weight, local_mask, decay)

    def _sync_forward_masks(self) -> None:
        """Dynamic mode: the layers compute with the current masks (dense where there is none yet)."""
        for layer in self.dense_layers:
            mask = self._masks[layer.name]
            if mask is None:
                remove_masked_forward(layer.module)
            else:
                set_masked_forward(layer.module, mask)

    def effective_weight(self, layer: TargetLayer) -> Tensor:
        """What the layer computes with: the weight, masked in dynamic mode (where the master is dense)."""
        weight = layer.weight.detach()
        mask = self.masks[layer.name]
        if self.config.dynamic and mask is not None:
            return weight.masked_fill(~mask, 0.0)
        return weight

    def pattern_for_level(self, level: int | float) -> Pattern:
        assert self.plan is not None
        return self.plan.pattern_at(level)

    # ------------------------------------------------------------------ masks
    def set_calibration(self, source: CalibrationSource | None, max_batches: int | None = None) -> None:
        """Where activation-aware scores (``needs_calibration``) get their batches at each mask update: an iterable
        of dicts of tensors, or a function returning one; at most ``max_batches`` of them (``None``: all)."""
        self.calibration = source
        self.calibration_max_batches = max_batches

    def check_can_update(self) -> None:
        """Raise what a mask update with this score cannot do here, with what to do instead. A training run calls it
        before its first step, so a run that could not prune stops at once, not at its first mask update.

        Activation-aware scores need calibration batches (:meth:`set_calibration`); they and the scores that move
        the kept weights (SparseGPT, OBS) need the full weights, which FSDP2-sharded layers do not hold."""
        if (self.scorer.provides_prune or self.scorer.needs_calibration) and self.is_sharded:
            raise NotImplementedError(
                f"score={self.config.score!r} needs the full weights (and, activation-aware, calibration passes "
                "layer by layer), which hf_sparse does not do on FSDP2-sharded weights yet; train with DDP or one "
                "process, or use score='magnitude'"
            )
        if self.scorer.needs_calibration and self.calibration is None:
            raise RuntimeError(
                f"score={self.config.score!r} needs calibration batches: pass them to hf_sparse.oneshot(model, config, "
                "calibration), train with SparsityCallback / SparseTrainer (which draw them from the training data), "
                "call pruner.set_calibration(batches), or use score='magnitude'"
            )

    @torch.no_grad()
    def recompute(self, level: int | float) -> None:
        """New masks at ``level`` from the current weights' scores, applied at once."""
        assert self.plan is not None
        if len(self.dense_layers) < len(self.layers):
            raise RuntimeError("Pruner.recompute: compact layers keep their final masks; masks cannot change now")
        self.check_can_update()
        pattern = self.pattern_for_level(level)
        final = self.plan.quantise(self.pattern.sparsity) == level
        transposable = self.config.transposable and final
        global_threshold = isinstance(pattern, Unstructured) and self.config.global_unstructured
        direct = self.scorer.provides_prune and not transposable and not global_threshold
        threshold = None
        if global_threshold:
            scores = [self.scorer.score(layer.name, full_tensor(layer.weight)) for layer in self.layers]
            threshold = unstructured_threshold(scores, pattern.sparsity)
            del scores
        counts = [0, 0]  # flipped, compared

        def prune(layer: TargetLayer) -> None:
            flips, total = self._prune_layer(layer, pattern, direct, transposable, threshold)
            counts[0] += flips
            counts[1] += total
            self.scorer.release(layer.name)

        if self.scorer.needs_calibration:
            self._calibrated(prune)
        else:
            for layer in self.layers:
                prune(layer)
        self._refresh_sharded_zeros()
        self.scorer.reset()
        if self.config.dynamic:
            self._sync_forward_masks()
        self.flip_rate = counts[0] / counts[1] if counts[1] else None
        self.level = level
        logger.info("hf_sparse: masks updated to %s (flip rate %s)", pattern, self.flip_rate)

    def _calibrated(self, prune) -> None:
        """Run the calibration batches block by block (:mod:`hf_sparse.calibration`), pruning each layer once the
        score has seen its inputs."""
        batches = prepare_batches(self.model, self.calibration, self.calibration_max_batches)
        scorer = self.scorer
        run_calibration(
            self.model,
            self.layers,
            batches,
            observe=scorer.observe_input,
            share=scorer.share_statistics,
            prune=prune,
            progress=self.calibration_progress,
        )

    def _prune_layer(
        self, layer: TargetLayer, pattern: Pattern, direct: bool, transposable: bool, threshold: float | None
    ) -> tuple[int, int]:
        """New mask (and, for scores that move weights, new weights) of one layer; returns ``(flipped, compared)``."""
        previous = self.masks[layer.name]
        new_weight = None
        if direct:
            # nested ramp levels: a weight pruned earlier stays pruned (dynamic masks may move freely)
            allowed = None if self.config.dynamic else previous
            mask, new_weight = self.scorer.prune(layer.name, layer.weight, pattern, allowed)
        else:
            score = self.scorer.score(layer.name, full_tensor(layer.weight))
            if threshold is not None:
                mask = unstructured_mask(score, pattern.sparsity, threshold)
            else:
                mask = compute_mask(score, pattern, transposable=transposable)
            del score
            if self.scorer.provides_prune:
                new_weight = self.scorer.compensate(layer.name, layer.weight, mask.to(layer.weight.device))
        mask = mask.to(layer.weight.device).contiguous()
        broadcast_masks({layer.name: mask})  # rank 0's mask on every rank (a no-op in one process)
        if new_weight is not None and world_size() > 1:
            new_weight = new_weight.to(layer.weight.device).contiguous()
            _broadcast_(new_weight)  # and rank 0's compensated weights
        self.masks[layer.name] = mask
        self._write_weight(layer, mask, new_weight)
        if previous is None:
            return 0, 0
        return int((previous != mask).sum()), mask.numel()

    @torch.no_grad()
    def _write_weight(self, layer: TargetLayer, mask: Tensor, new_weight: Tensor | None) -> None:
        """Store a score's updated weights (kept positions only in dynamic mode) and, static, zero the pruned."""
        weight = layer.weight
        if new_weight is not None:
            new_weight = new_weight.to(device=weight.device, dtype=weight.dtype)
            if self.config.dynamic:
                weight.copy_(torch.where(mask, new_weight, weight))
            else:
                weight.copy_(new_weight)
        if not self.config.dynamic:
            self._apply_layer_mask(layer, mask)

    @torch.no_grad()
    def apply(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Zero every pruned weight (``+0.0``); call after each optimizer step. Dynamic mode: nothing to do.

        ``optimizer``: the optimizer that just stepped (``accelerate``'s wrapper too). Once the masks are final and
        it is a plain ``torch.optim`` Adam, AdamW or SGD, each layer's optimizer state is zeroed at its pruned
        positions once; from then on its pruned weights stay exactly zero by themselves (zero gradient from the
        hook, zero weight, zero state, and an update that reads only its own entry), so the
        masking pass leaves that layer out (~0.7 ms of GPU time per BERT-large step, run J of ``benchmarks/RESULTS.md``).
        A new mask, new state tensors (a resumed optimizer) or another optimizer make the layer masked and its state
        zeroed again.
        """
        if self.config.dynamic:
            return
        settled = self._settled_layers(optimizer)
        apply_masks(  # one fused launch on CUDA where it can (masks.apply_masks)
            local_part(layer.module.weight, mask, layer.transposed)
            for layer in self.dense_layers
            if (mask := self._masks[layer.name]) is not None and layer.name not in settled
        )
        self._refresh_sharded_zeros()

    def _settled_layers(self, optimizer: torch.optim.Optimizer | None) -> set[str]:
        """Names of the layers whose pruned weights stay zero without masking (see :meth:`apply`), after zeroing the
        optimizer state at pruned positions of those that just qualified (they are masked this once more)."""
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        if opt is None or type(opt) not in _ELEMENTWISE_OPTIMIZERS or not self.masks_final or not self._hooks:
            self._zeroed_state.clear()
            return set()
        settled, state_pairs = set(), []
        for layer in self.dense_layers:
            mask, param = self._masks[layer.name], layer.module.weight
            state = opt.state.get(param)
            if mask is None or not state:  # no state yet: the optimizer has not stepped this weight
                continue
            tensors = [t for t in state.values() if isinstance(t, Tensor) and t.shape == param.shape]
            stamp = (mask._version, id(opt), tuple(_storage_of(t) for t in tensors))
            done = self._zeroed_state.get(layer.name)
            if done is not None and done[0] is mask and done[1] == stamp:
                settled.add(layer.name)
                continue
            state_pairs += [local_part(t, mask, layer.transposed) for t in tensors]
            self._zeroed_state[layer.name] = (mask, stamp)
        apply_masks(state_pairs)
        return settled

    def _install_grad_hooks(self) -> None:
        dense = self.dense_layers
        for layer in dense:
            param = layer.module.weight
            self._hooks.append(param.register_post_accumulate_grad_hook(self._make_grad_hook(layer)))
        self._hooked_params = [layer.module.weight for layer in dense]

    @property
    def masks(self) -> LayerMasks:
        """The masks by layer name (see :class:`LayerMasks`)."""
        return LayerMasks(self)

    def dense_masks(self) -> dict[str, Tensor | None]:
        """The masks of the layers that are still dense (the ones the pruner masks), by name."""
        return {layer.name: self._masks[layer.name] for layer in self.dense_layers}

    def layer_named(self, name: str) -> TargetLayer:
        """The targeted layer called ``name`` (KeyError if there is none)."""
        layer = next((layer for layer in self.layers if layer.name == name), None)
        if layer is None:
            raise KeyError(f"Pruner: no targeted layer {name!r}")
        return layer

    @property
    def dense_layers(self) -> list[TargetLayer]:
        """The targeted layers that still hold a dense weight (the pruner masks them); the others are compact."""
        return [layer for layer in self.layers if not layer.compact]

    @property
    def compact_layers(self) -> list[TargetLayer]:
        """The targeted layers that are compact: their weight holds the kept values, their positions are their mask."""
        return [layer for layer in self.layers if layer.compact]

    def replace_module(self, name: str, module: nn.Module, *, compact: bool) -> None:
        """Record that layer ``name`` is now ``module``: compact (its ``weight`` holds the kept values of its mask, in
        the order of the mask's ``True`` entries; its positions are its mask from now on, and the pruner drops its
        own copy and no longer masks it) or dense again (the pruner masks it with the positions it had)."""
        layer = self.layer_named(name)
        if compact:
            self._masks[name] = None
        elif layer.compact:
            self._masks[name] = layer.module.mask().to(module.weight.device)
        layer.module, layer.compact = module, compact
        self.module_version += 1
        self._zeroed_state.pop(name, None)
        self.remove_hooks()
        self._install_grad_hooks()
        self._sharded_zeros = None

    def _make_grad_hook(self, layer: TargetLayer):
        name, transposed = layer.name, layer.transposed

        def hook(param: nn.Parameter) -> None:
            if param.grad is None:
                return
            mask = self._masks[name]
            if mask is not None and not self.config.dynamic:  # dynamic: straight-through, all weights learn
                apply_mask(*local_part(param.grad, mask, transposed))

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._hooked_params = []

    # ------------------------------------------------------------------ distributed (DDP, FSDP2)
    def rebind(self) -> None:
        """Follow the modules' current weight Parameters after a wrapper replaced them; call on every rank.

        FSDP2's ``fully_shard`` registers new (``DTensor``) Parameters on the same modules, so hooks installed
        before wrapping would sit on Parameters that never receive a gradient again. DDP keeps the Parameters, and
        then this only re-applies the masks.
        """
        if [id(layer.module.weight) for layer in self.dense_layers] != [id(p) for p in self._hooked_params]:
            self.remove_hooks()
            self._install_grad_hooks()
        self._sharded_zeros = None
        self.apply()

    def _apply_layer_mask(self, layer: TargetLayer, mask: Tensor) -> None:
        """Zero what this rank holds of the layer's pruned weights (its shard under FSDP2, all of it otherwise)."""
        apply_mask(*local_part(layer.module.weight, mask, layer.transposed))

    @property
    def is_sharded(self) -> bool:
        """Whether the targeted weights are ``DTensor`` shards (FSDP2)."""
        return any(is_sharded(layer.module.weight) for layer in self.layers)

    def _refresh_sharded_zeros(self) -> None:
        """Sharded weights: count zeros over the full weights now (one all-reduce, every rank calls it), so that
        metrics and reports read later, maybe on rank 0 alone, never need a collective."""
        self._sharded_zeros = self._count_layer_zeros() if self.is_sharded else None

    def _count_layer_zeros(self) -> dict[str, tuple[int, int]]:
        weights = [layer.module.weight for layer in self.layers]
        zeros = count_zeros(weights)
        return {layer.name: self._zeros_of(layer, z) for layer, z in zip(self.layers, zeros, strict=True)}

    def _zeros_of(self, layer: TargetLayer, zeros: int) -> tuple[int, int]:
        """(zeros, numel) of the layer's logical weight, given the zeros counted in its ``weight`` Parameter: for a
        compact layer that holds the kept values, the pruned positions are zeros too."""
        rows, cols = layer.shape
        if not layer.compact:
            return zeros, rows * cols
        return zeros + rows * cols - layer.module.weight.numel(), rows * cols

    # ------------------------------------------------------------------ reporting
    def _layer_zeros(self) -> dict[str, tuple[int, int]]:
        """Per layer: (exact zeros in the weight the layer computes with, number of weights): what is on the
        weights, not the masks (dynamic mode: the masked weights).

        Sharded (FSDP2) weights are counted in full when the masks were last applied (see :meth:`apply`).
        """
        if self.is_sharded:
            if self._sharded_zeros is None:
                self._sharded_zeros = self._count_layer_zeros()  # a collective: before any apply only
            return dict(self._sharded_zeros)
        return {
            layer.name: self._zeros_of(
                layer, int(((layer.module.weight if layer.compact else self.effective_weight(layer)) == 0).sum())
            )
            for layer in self.layers
        }

    def layer_sparsity(self) -> dict[str, float]:
        """Fraction of exact zeros in each targeted weight."""
        return {name: zeros / numel for name, (zeros, numel) in self._layer_zeros().items()}

    def metrics(self, per_layer: bool = False) -> dict[str, float]:
        """Logged through ``Trainer.log``: overall sparsity of the targeted layers, level, flip rate."""
        counts = self._layer_zeros()
        zeros = sum(z for z, _ in counts.values())
        numel = sum(n for _, n in counts.values())
        out: dict[str, float] = {"sparsity": zeros / numel if numel else 0.0}
        if self.level is not None:
            pattern = self.pattern_for_level(self.level)
            out["sparsity_target"] = pattern.sparsity
        if self.flip_rate is not None:
            out["sparsity_flip_rate"] = self.flip_rate
        if per_layer:
            out.update({f"sparsity/{name}": z / n for name, (z, n) in counts.items()})
        return out

    def sparsity_report(self) -> dict[str, dict[str, Any]]:
        """Per layer: the pattern in force, measured sparsity and logical shape."""
        pattern = str(self.pattern_for_level(self.level)) if self.level is not None else "dense"
        if self.config.transposable and self.is_final:
            pattern += " (transposable)"
        sparsity = self.layer_sparsity()
        return {
            layer.name: {"pattern": pattern, "sparsity": sparsity[layer.name], "shape": list(layer.shape)}
            for layer in self.layers
        }

    def current_pattern(self) -> Pattern | None:
        """The pattern the masks are at now (an intermediate ramp level before the end), ``None`` if dense."""
        return None if self.level is None else self.pattern_for_level(self.level)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """``(tensors, metadata)``: masks bit-packed per row, plus level and schedule position as strings."""
        tensors: dict[str, Tensor] = {}
        for name, mask in self.masks.items():
            if mask is not None:
                tensors[f"mask.{name}"] = pack_bits(mask.cpu(), 1)
        meta = {
            "config": self.config.to_json_string(),
            "level": repr(self.level),
            "last_update_step": repr(self.last_update_step),
            "flip_rate": repr(self.flip_rate),
            "compact": json.dumps([layer.name for layer in self.compact_layers]),
        }
        return tensors, meta

    def check_saved_config(self, meta: dict[str, str]) -> None:
        """Refuse a saved pruner state (its metadata ``meta``) whose ``pattern``, ``targets`` or ``ignore`` differ
        from this run's: its masks and compact layers would not fit (checked again before a resume loads weights)."""
        saved = json.loads(meta.get("config", "{}"))
        current = json.loads(self.config.to_json_string())
        changed = [key for key in _RESUME_FIELDS if saved.get(key) != current[key]]
        if changed:
            was = ", ".join(f"{key}={saved.get(key)!r}" for key in changed)
            now = ", ".join(f"{key}={current[key]!r}" for key in changed)
            raise ValueError(
                f"pruner state was saved with {was} but this run uses {now}: these decide which layers are pruned "
                "and how, so the saved masks do not fit this run. Resume with the SparsityConfig the checkpoint "
                "was trained with, or start a new run from the checkpoint's weights without resuming"
            )

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
        """Restore masks (checked against each layer's shape) and schedule position, then re-apply the masks."""
        self.check_saved_config(meta)
        saved_layers = {key.removeprefix("mask.") for key in tensors if key.startswith("mask.")}
        foreign = sorted(saved_layers - {layer.name for layer in self.layers})
        if foreign:
            raise ValueError(
                f"pruner state holds masks for {len(foreign)} layer(s) this run does not prune ({', '.join(foreign)}); "
                "resume the model and SparsityConfig the checkpoint was trained with"
            )
        for layer in self.layers:
            key = f"mask.{layer.name}"
            if layer.compact:  # its positions came with the model's weights, which a resume loads first
                continue
            if key not in tensors:
                self._masks[layer.name] = None
                continue
            rows, cols = layer.shape
            packed = tensors[key]
            if packed.shape[0] != rows:
                raise ValueError(f"pruner state: {key} has {packed.shape[0]} rows, layer {layer.name} has {rows}")
            self._masks[layer.name] = unpack_bits(packed, 1, cols).bool().to(layer.module.weight.device)
        self.level = literal_eval(meta["level"])
        self.last_update_step = literal_eval(meta["last_update_step"])
        self.flip_rate = literal_eval(meta["flip_rate"])
        #: the layers that were compact when the state was saved (read by hf_sparse.compaction on resume)
        self.saved_compact = set(json.loads(meta.get("compact", "[]")))
        self.scorer.reset()  # gradient statistics are not checkpointed (see ObsScore)
        if self.config.dynamic:
            self._sync_forward_masks()
        self.apply()
