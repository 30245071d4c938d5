"""Saving pruned models in the compressed format (``format_version`` 1, ``docs/format.md``).

A pruned layer is written the same whichever form it has in training: a dense masked layer is compressed here, a
compact one (:mod:`hf_sparse.compaction`) already holds the on-disk tensors and is written as it is, so both give the
same bytes. The quantizer that writes the state dict and ``quantization_config`` is looked up through the
Transformers registry (``quant_method: "hf_sparse"``): this module does not import :mod:`hf_sparse.integrations`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.quantizers.auto import AutoHfQuantizer

from .distributed import gather_full_state_dict, has_sharded_parameters, is_main_process
from .formats.compressed import QUANT_METHOD, compress
from .modeling import unwrap_model
from .patterns import Unstructured
from .pruner import Pruner

__all__ = ["compressed_state_dict", "save_pretrained"]

logger = logging.getLogger(__name__)


def compressed_state_dict(
    model: nn.Module, pruner: Pruner, state_dict: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The model's state dict with every pruned layer's ``weight`` replaced by its compressed tensors.

    Returns ``(state_dict, layers)`` where ``layers`` is the ``quantization_config.layers`` entry. Raises if a
    weight is non-zero where its mask says pruned (the masks were not applied): nothing is written then.
    ``state_dict`` (full, unsharded tensors, e.g. gathered from an FSDP2 model) replaces ``model.state_dict()``.
    """
    pattern = pruner.current_pattern()
    if pattern is None:
        raise ValueError("compressed_state_dict: the pruner has not pruned yet (no masks); save the model dense")
    transposable = pruner.config.transposable and pruner.is_final
    state = dict(state_dict if state_dict is not None else unwrap_model(model).state_dict())
    layers: dict[str, dict[str, Any]] = {}
    for layer in pruner.layers:
        spec: dict[str, Any] = {
            "pattern": str(pattern),
            "shape": list(layer.shape),
            "module": "Conv1D" if layer.transposed else "Linear",
        }
        if transposable:
            spec["transposable"] = True
        layers[layer.name] = spec
        if layer.compact:  # its tensors are the on-disk tensors already
            if isinstance(pattern, Unstructured):
                spec["nnz"] = int(state[f"{layer.name}.weight"].numel())
            continue
        stored = state[f"{layer.name}.weight"].detach()
        weight = stored.T if layer.transposed else stored
        mask = pruner.masks[layer.name].to(weight.device)
        if pruner.config.dynamic:  # dynamic masks: the master is dense, the layer computes W ⊙ mask
            weight = weight.masked_fill(~mask, 0.0)
        stray = int(weight.masked_select(~mask).ne(0).sum())
        if stray:
            raise ValueError(f"{layer.name}: {stray} weights are non-zero at pruned positions; call pruner.apply()")
        tensors = compress(weight, mask, pattern)
        del state[f"{layer.name}.weight"]
        for key, value in tensors.items():
            state[f"{layer.name}.{key}"] = value.contiguous()
        if isinstance(pattern, Unstructured):
            spec["nnz"] = int(tensors["weight"].shape[0])
    return state, layers


@contextlib.contextmanager
def _attached_quantizer(model: nn.Module, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily give ``model`` the hf_sparse quantizer (built from ``config``, the ``quantization_config`` dict)
    that ``save_pretrained`` consults for the state dict to write and for ``config.json``, then restore both."""
    quantizer = AutoHfQuantizer.from_config(config)
    config = quantizer.quantization_config
    quantizer.export_state_dict = state
    missing = object()
    old_quantizer = getattr(model, "hf_quantizer", missing)
    old_config = getattr(model.config, "quantization_config", missing)
    model.hf_quantizer = quantizer
    model.config.quantization_config = config
    try:
        yield
    finally:
        if old_quantizer is missing:
            del model.hf_quantizer
        else:
            model.hf_quantizer = old_quantizer
        if old_config is missing:
            del model.config.quantization_config
        else:
            model.config.quantization_config = old_config


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, pruner: Pruner, **kwargs: Any) -> None:
    """``model.save_pretrained`` with the pruned layers compressed and ``quantization_config`` in ``config.json``.

    The compressed state dict is built completely before anything is written, so a layer that cannot be
    compressed raises with the directory untouched. Extra ``kwargs`` go to ``save_pretrained``; a ``state_dict``
    there must hold full tensors and is compressed instead of the model's own.

    With FSDP2 (``DTensor`` parameters) every rank must call this: the full weights are gathered to rank 0, which
    alone writes, so the files are the same as a single-process run's. DDP needs no gather: call it on the main
    process only (``Trainer.save_model`` does).
    """
    model = unwrap_model(model)
    full_state = kwargs.pop("state_dict", None)
    if has_sharded_parameters(model):  # FSDP2: every rank joins the gather, rank 0 alone writes
        full_state = gather_full_state_dict(model) if full_state is None else full_state
        if not is_main_process():
            return
    if pruner.current_pattern() is None:
        warnings.warn("hf_sparse: nothing pruned yet; saving a dense checkpoint", stacklevel=2)
        model.save_pretrained(save_directory, state_dict=full_state, **kwargs)
        return
    state, layers = compressed_state_dict(model, pruner, full_state)
    config = {"quant_method": QUANT_METHOD, "layers": layers, "sparsity_config": pruner.config.to_dict()}
    with _attached_quantizer(model, config, state):
        model.save_pretrained(save_directory, **kwargs)
