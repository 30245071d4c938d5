"""The pruner: owns the targeted layers and their masks, updates them on schedule, keeps pruned weights at zero.

It knows nothing of ``Trainer``: :mod:`hf_sparse.callback` drives it. What it guarantees:

* after :meth:`Pruner.update` at an update step, every targeted weight is masked to the level the schedule gives;
* gradients are masked as they are accumulated (a post-accumulate-grad hook per weight), so gradient clipping and
  the optimizer never see a pruned position's gradient, and :meth:`Pruner.apply` after each optimizer step
  re-zeroes what momentum or weight decay moved;
* :meth:`state_dict` / :meth:`load_state_dict` restore masks, level and schedule position exactly.
"""

from __future__ import annotations

import json
import logging
from ast import literal_eval
from typing import Any

import torch
from torch import Tensor, nn

from .config import SparsityConfig
from .distributed import broadcast_masks, count_zeros, full_tensor, is_sharded, local_part
from .formats.bitpack import pack_bits, unpack_bits
from .masks import apply_mask, compute_mask, unstructured_mask, unstructured_threshold
from .modeling import TargetLayer, find_target_layers
from .patterns import Pattern, Unstructured
from .schedules import SchedulePlan
from .scoring import get_score

__all__ = ["Pruner"]

logger = logging.getLogger(__name__)


class Pruner:
    """Masks for the layers of ``model`` that ``config`` targets.

    Call :meth:`bind` with the run's total optimizer steps before :meth:`update`.
    """

    def __init__(self, model: nn.Module, config: SparsityConfig) -> None:
        self.config = config
        self.pattern: Pattern = config.parsed_pattern
        self.layers: list[TargetLayer] = find_target_layers(model, config, self.pattern)
        self.masks: dict[str, Tensor | None] = {layer.name: None for layer in self.layers}
        self.scorer = get_score(config.score)
        self.plan: SchedulePlan | None = None
        self.level: int | float | None = None
        self.last_update_step: int | None = None
        self.flip_rate: float | None = None
        self._hooks: list[Any] = []
        self._hooked_params: list[Tensor] = []
        self._sharded_zeros: dict[str, tuple[int, int]] | None = None
        self._install_grad_hooks()

    # ------------------------------------------------------------------ schedule
    def bind(self, total_steps: int) -> SchedulePlan:
        cfg = self.config
        self.plan = SchedulePlan.build(self.pattern, cfg.schedule, cfg.start, cfg.end, cfg.update_every, total_steps)
        return self.plan

    def update(self, step: int) -> bool:
        """Recompute masks if ``step`` is an update step not yet done; returns whether masks changed."""
        if self.plan is None:
            raise RuntimeError("Pruner.update() before Pruner.bind(total_steps)")
        if not self.plan.is_update_step(step) or step == self.last_update_step:
            return False
        level = self.plan.quantise(self.plan.target_sparsity(step))
        self.last_update_step = step
        if level is None:
            return False
        self.recompute(level)
        return True

    @property
    def is_final(self) -> bool:
        """True once the masks are at the final pattern (and, with a static schedule, will not change)."""
        return (
            self.plan is not None
            and self.level is not None
            and self.plan.quantise(self.pattern.sparsity) == self.level
        )

    def pattern_for_level(self, level: int | float) -> Pattern:
        assert self.plan is not None
        return self.plan.pattern_at(level)

    # ------------------------------------------------------------------ masks
    @torch.no_grad()
    def recompute(self, level: int | float) -> None:
        """New masks at ``level`` from the current weights' scores, applied at once."""
        assert self.plan is not None
        pattern = self.pattern_for_level(level)
        final = self.plan.quantise(self.pattern.sparsity) == level
        transposable = self.config.transposable and final
        scores = {layer.name: self.scorer.score(layer.name, full_tensor(layer.weight)) for layer in self.layers}
        threshold = None
        if isinstance(pattern, Unstructured) and self.config.global_unstructured:
            threshold = unstructured_threshold(list(scores.values()), pattern.sparsity)
        flips = total = 0
        for layer in self.layers:
            score = scores.pop(layer.name)
            if threshold is not None:
                mask = unstructured_mask(score, pattern.sparsity, threshold)
            else:
                mask = compute_mask(score, pattern, transposable=transposable)
            mask = mask.to(layer.weight.device).contiguous()
            broadcast_masks({layer.name: mask})  # rank 0's mask on every rank (a no-op in one process)
            previous = self.masks[layer.name]
            if previous is not None:
                flips += int((previous != mask).sum())
                total += mask.numel()
            self.masks[layer.name] = mask
            self._apply_layer_mask(layer, mask)
        self._refresh_sharded_zeros()
        self.flip_rate = flips / total if total else None
        self.level = level
        logger.info("hf_sparse: masks updated to %s (flip rate %s)", pattern, self.flip_rate)

    @torch.no_grad()
    def apply(self) -> None:
        """Zero every pruned weight (``+0.0``); call after each optimizer step."""
        for layer in self.layers:
            mask = self.masks[layer.name]
            if mask is not None:
                self._apply_layer_mask(layer, mask)
        self._refresh_sharded_zeros()

    def _install_grad_hooks(self) -> None:
        for layer in self.layers:
            param = layer.module.weight
            self._hooks.append(param.register_post_accumulate_grad_hook(self._make_grad_hook(layer)))
        self._hooked_params = [layer.module.weight for layer in self.layers]

    def _make_grad_hook(self, layer: TargetLayer):
        name, transposed = layer.name, layer.transposed

        def hook(param: nn.Parameter) -> None:
            if param.grad is None:
                return
            grad = param.grad.T if transposed else param.grad
            if self.scorer.needs_gradients:
                self.scorer.observe_gradient(name, layer.weight, grad)
            mask = self.masks[name]
            if mask is not None:
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
        if [id(layer.module.weight) for layer in self.layers] != [id(p) for p in self._hooked_params]:
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
        return {layer.name: (z, w.numel()) for layer, z, w in zip(self.layers, zeros, weights, strict=True)}

    # ------------------------------------------------------------------ reporting
    def _layer_zeros(self) -> dict[str, tuple[int, int]]:
        """Per layer: (exact zeros in the weight, number of weights): what is on the weights, not the masks.

        Sharded (FSDP2) weights are counted in full when the masks were last applied (see :meth:`apply`).
        """
        if self.is_sharded:
            if self._sharded_zeros is None:
                self._sharded_zeros = self._count_layer_zeros()  # a collective: before any apply only
            return dict(self._sharded_zeros)
        return {layer.name: (int((layer.weight == 0).sum()), layer.weight.numel()) for layer in self.layers}

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
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
        """Restore masks (checked against each layer's shape) and schedule position, then re-apply the masks."""
        saved = json.loads(meta.get("config", "{}"))
        if saved.get("pattern") != self.config.pattern:
            raise ValueError(
                f"pruner state was saved for pattern {saved.get('pattern')!r} but this run uses "
                f"{self.config.pattern!r}; resume with the same SparsityConfig"
            )
        for layer in self.layers:
            key = f"mask.{layer.name}"
            if key not in tensors:
                self.masks[layer.name] = None
                continue
            rows, cols = layer.shape
            packed = tensors[key]
            if packed.shape[0] != rows:
                raise ValueError(f"pruner state: {key} has {packed.shape[0]} rows, layer {layer.name} has {rows}")
            self.masks[layer.name] = unpack_bits(packed, 1, cols).bool().to(layer.weight.device)
        self.level = literal_eval(meta["level"])
        self.last_update_step = literal_eval(meta["last_update_step"])
        self.flip_rate = literal_eval(meta["flip_rate"])
        self.apply()
