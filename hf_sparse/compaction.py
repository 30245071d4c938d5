"""Turning pruned layers compact inside training, once their masks are final.

A pruned layer trains as its dense ``nn.Linear`` / ``Conv1D`` while its mask can still change; once the mask is final
:func:`make_compact` replaces it by a compact :class:`~hf_sparse.nn.SparseLinear` (``weight`` = the kept values,
the positions as buffers: the on-disk tensors of the hf_sparse format) and, when an optimizer already exists, moves
the layer's optimizer state to the kept positions: every state tensor shaped like the dense weight (Adam's
``exp_avg`` / ``exp_avg_sq`` / ``max_exp_avg_sq``, SGD's ``momentum_buffer``) is gathered at the kept positions in
the logical ``(out, in)`` order of the values (transposed first for ``Conv1D``), scalar state such as ``step`` is
carried as it is, the new Parameter takes the old one's place in its param group, and the state is re-keyed. The
masked dense run never lets a pruned position touch a kept one (the gradient hook zeroes pruned gradients, and the
update of an elementwise optimizer reads only its own entry), so the run continues exactly as it would have.

:class:`~hf_sparse.SparsityCallback` calls it before the optimizer exists when the masks are final from the start
(a one-shot schedule at step 0), and right after the last mask update of a ramp otherwise. The layers of a model
under DDP or FSDP cannot change mid-run (the wrapper holds the Parameters):
:func:`why_not_compact_now` says so and the run continues on the masked dense path.

Checkpoints: :func:`install_load_hook` lets ``model.load_state_dict`` (``Trainer`` resuming, or loading the best
model) read a state dict whatever form each pruned layer has in it, by first turning the model's layer into that
form.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from .distributed import has_sharded_parameters, world_size
from .formats.compressed import mask_from_compressed
from .modeling import unwrap_model
from .nn.convert import compact_like, has_compressed_tensors, replace_submodule, to_compact, to_dense_module
from .pruner import Pruner

__all__ = ["install_load_hook", "make_compact", "make_dense", "move_optimizer_state", "why_not_compact_now"]

logger = logging.getLogger(__name__)


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer inside ``accelerate``'s ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


@torch.no_grad()
def move_optimizer_state(
    optimizer, old: nn.Parameter, new: nn.Parameter, kept_index: Tensor | None, transposed: bool = False
) -> bool:
    """Put ``new`` in ``old``'s place in ``optimizer`` (its param group and its state).

    ``kept_index``: flat indices into the logical ``(out, in)`` weight of ``new``'s elements, in their order; every state
    tensor shaped like ``old`` is gathered there (``transposed``: ``old`` stores ``(in, out)``, GPT-2 ``Conv1D``).
    ``None``: ``new`` has ``old``'s shape and takes its state as it is. Returns whether ``old`` was in ``optimizer``.
    """
    opt = _torch_optimizer(optimizer)
    found = False
    for group in opt.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            if param is old:
                params[i] = new
                found = True
    state = opt.state.pop(old, None)
    if state:
        moved = {}
        for key, value in state.items():
            if kept_index is not None and isinstance(value, Tensor) and value.shape == old.shape:
                logical = value.T if transposed else value
                value = logical.reshape(-1)[kept_index.to(value.device)].reshape(new.shape)
            moved[key] = value
        opt.state[new] = moved
    return found


def why_not_compact_now(model: nn.Module, optimizer=None) -> str | None:
    """Why the layers of ``model`` cannot be replaced now, with an optimizer already built (``None``: they can)."""
    if optimizer is None:
        return None
    if has_sharded_parameters(model):
        return "its Parameters are sharded by FSDP2"
    if world_size() > 1:
        return f"it trains in {world_size()} processes, whose DDP/FSDP wrapper holds the Parameters"
    return None  # DataParallel replicates the module at every forward: swapped layers are picked up


def make_compact(model: nn.Module, pruner: Pruner, optimizer=None) -> list[str]:
    """Replace every dense layer of ``pruner`` that has a mask by its compact layer, moving its optimizer state when
    ``optimizer`` is given (then the Parameters must not be held by a wrapper: see :func:`why_not_compact_now`).
    The masks must be final (:attr:`Pruner.masks_final`). Returns the names of the layers replaced."""
    if not pruner.masks_final:
        raise RuntimeError("make_compact: the masks are not final yet; layers turn compact at the final mask update")
    root = unwrap_model(model)
    pattern = pruner.current_pattern()
    done = []
    for layer in pruner.dense_layers:
        mask = pruner.masks[layer.name]
        if mask is None:
            continue
        old = layer.module
        new = to_compact(old, mask, pattern)
        replace_submodule(root, layer.name, new)
        if optimizer is not None:
            move_optimizer_state(optimizer, old.weight, new.weight, new.kept_index, layer.transposed)
            if old.bias is not None and new.bias is not old.bias:
                move_optimizer_state(optimizer, old.bias, new.bias, None)
        pruner.replace_module(layer.name, new, compact=True)
        done.append(layer.name)
    if done:
        logger.info("hf_sparse: %d layers are compact (%s), holding their kept values only", len(done), pattern)
    return done


def make_dense(model: nn.Module, pruner: Pruner, names=None) -> list[str]:
    """Replace compact layers of ``pruner`` (``names``, default all) by dense masked ones: to load a checkpoint
    written before the switch into a model trained after it. Optimizer state is not moved."""
    root = unwrap_model(model)
    done = []
    for layer in pruner.layers:
        if layer.compact and (names is None or layer.name in names):
            dense = to_dense_module(layer.module)
            replace_submodule(root, layer.name, dense)
            pruner.replace_module(layer.name, dense, compact=False)
            done.append(layer.name)
    return done


def install_load_hook(model: nn.Module, pruner: Pruner):
    """Let ``model.load_state_dict`` take a state dict in which each pruned layer is dense or compressed, whatever
    form the layer has in ``model`` now: before anything is copied, each layer whose form differs is replaced by an
    empty layer of the state dict's form (its masks come with the pruner state of the same checkpoint). Returns the
    hook's handle."""
    root = unwrap_model(model)

    def hook(module, state_dict, prefix, *args) -> None:
        compact_names = []
        for layer in pruner.layers:
            key = f"{prefix}{layer.name}."
            if f"{key}weight" not in state_dict:
                continue
            if has_compressed_tensors(state_dict, key) and not layer.compact:
                tensors = {k[len(key) :]: v for k, v in state_dict.items() if k.startswith(key)}
                new = compact_like(layer.module, pruner.pattern, tensors)
                replace_submodule(root, layer.name, new)
                pruner.replace_module(layer.name, new, compact=True)
                pruner.masks[layer.name] = mask_from_compressed(tensors, pruner.pattern, layer.shape).to(
                    new.weight.device
                )
                compact_names.append(layer.name)
            elif not has_compressed_tensors(state_dict, key) and layer.compact:
                make_dense(root, pruner, {layer.name})
        if compact_names:
            logger.info(
                "hf_sparse: loading %d compact layers from a checkpoint written after the switch", len(compact_names)
            )

    return root.register_load_state_dict_pre_hook(hook)
