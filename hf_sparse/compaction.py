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

:func:`make_dense` is the exact inverse, for a run that measures the masked dense layers faster
(:mod:`hf_sparse.compact_fallback`): each compact layer becomes its dense layer again and its optimizer state is
scattered back to the dense positions, ``+0.0`` at pruned ones.

Checkpoints: :func:`install_load_hook` lets ``model.load_state_dict`` (``Trainer`` resuming, or loading the best
model) read a state dict whatever form each pruned layer has in it, by first turning the model's layer into that
form.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from .distributed import has_sharded_parameters, world_size
from .modeling import unwrap_model
from .nn.convert import compact_like, has_compressed_tensors, replace_submodule, to_compact, to_dense_module
from .ops import dispatch
from .pruner import Pruner

__all__ = [
    "OPTIMIZER_SCRATCH_ELEMENTS",
    "gather_kept",
    "install_load_hook",
    "make_compact",
    "make_dense",
    "measured_saving_ms",
    "move_optimizer_state",
    "optimizer_saving_ms",
    "scatter_kept",
    "why_not_compact_now",
]

logger = logging.getLogger(__name__)


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer inside ``accelerate``'s ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def gather_kept(value: Tensor, kept_index: Tensor, transposed: bool = False) -> Tensor:
    """The entries of a dense-weight-shaped tensor at ``kept_index`` (flat indices into the logical ``(out, in)``
    weight), flat, in the index's order. ``transposed``: ``value`` is stored ``(in, out)`` (GPT-2 ``Conv1D``)."""
    logical = value.T if transposed else value
    return logical.reshape(-1)[kept_index.to(value.device)]


def scatter_kept(values: Tensor, kept_index: Tensor, shape: tuple[int, int], transposed: bool = False) -> Tensor:
    """The inverse of :func:`gather_kept`: a dense tensor of the stored ``shape`` holding ``values`` at
    ``kept_index`` and ``+0.0`` everywhere else (contiguous, also when ``transposed``)."""
    rows, cols = shape[::-1] if transposed else shape
    flat = values.new_zeros(rows * cols).index_put_((kept_index.to(values.device),), values.reshape(-1))
    logical = flat.view(rows, cols)
    return logical.T.contiguous() if transposed else logical


def _gather_state(value: Tensor, index: Tensor, shape: torch.Size, transposed: bool) -> Tensor:
    return gather_kept(value, index, transposed).view(shape)


@torch.no_grad()
def move_optimizer_state(
    optimizer, old: nn.Parameter, new: nn.Parameter, convert: Callable[[Tensor], Tensor] | None = None
) -> bool:
    """Put ``new`` in ``old``'s place in ``optimizer`` (its param group and its state).

    Every state tensor shaped like ``old`` goes through ``convert`` (``None``: ``new`` has ``old``'s shape and takes
    its state as it is); scalar state such as ``step`` is carried as it is. Returns whether ``old`` was in
    ``optimizer``.
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
        opt.state[new] = {
            key: convert(value)
            if convert is not None and isinstance(value, Tensor) and value.shape == old.shape
            else value
            for key, value in state.items()
        }
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
            gather = partial(_gather_state, index=new.kept_index, shape=new.weight.shape, transposed=layer.transposed)
            move_optimizer_state(optimizer, old.weight, new.weight, gather)
        pruner.replace_module(layer.name, new, compact=True)
        done.append(layer.name)
    return done


def measured_saving_ms(pruner: Pruner) -> float | None:
    """What the compact layers of ``pruner`` save per forward and backward pass against masked dense layers, as their
    kernel plans measured it (:meth:`hf_sparse.nn.compact.CompactKernel.training_saving_ms`), in ms; None unless
    every compact layer has measured a training plan."""
    total, layers = 0.0, pruner.compact_layers
    for layer in layers:
        kernel = getattr(layer.module, "_kernel", None)
        saved = None if kernel is None else kernel.training_saving_ms()
        if saved is None:
            return None
        total += saved
    return total if layers else None


#: Elements of the scratch parameter on which :func:`optimizer_saving_ms` times the optimizer (at most; 24 bytes each):
#: enough for a step of ~0.5 ms, far above the timing's jitter.
OPTIMIZER_SCRATCH_ELEMENTS = 1 << 26


def optimizer_saving_ms(pruner: Pruner, optimizer) -> float | None:
    """The GPU time one step of ``optimizer`` saves on the compact layers of ``pruner``, which hold their kept values
    only, against the masked dense layers, whose whole weights it updates, in ms: the work the layers' own
    measurements (:func:`measured_saving_ms`) leave out, and what makes a pattern whose layers compute no faster than
    masked dense ones (64:2:8 on a Llama-style model) train faster than them.

    An elementwise optimizer's step costs GPU time in proportion to the elements it updates (a fused or multi-tensor
    step updates every parameter in a few launches), so this measures that cost per element once: a fresh optimizer
    of the same class and hyperparameters as the param group of the first compact weight steps a scratch parameter
    of ``n`` and of ``n / 2`` elements (:func:`hf_sparse.ops.dispatch.measure`, GPU time), and the difference over
    ``n / 2`` elements, times the elements the compact layers do not hold, is the saving. Timing each layer's size
    instead would count a small step's fixed cost and jitter once per layer. None where it cannot be measured: no
    optimizer or compact layer, not on CUDA, an optimizer that cannot be rebuilt so, or too little free memory for a
    scratch parameter of a million elements."""
    opt = _torch_optimizer(optimizer)
    layers = pruner.compact_layers
    if opt is None or not layers:
        return None
    weight = layers[0].module.weight
    if weight.device.type != "cuda":
        return None
    group = next((g for g in opt.param_groups if any(p is weight for p in g["params"])), None)
    if group is None:
        return None
    hyper = {key: value for key, value in group.items() if key != "params"}
    device = weight.device
    skipped = sum(layer.shape[0] * layer.shape[1] - layer.module.weight.numel() for layer in layers)
    n = (
        min(OPTIMIZER_SCRATCH_ELEMENTS, dispatch.spare_bytes(device) // 48) // 2 * 2
    )  # both scratch steps: 24 bytes per element of n
    if n < 1 << 20:
        return None

    def stepper(numel: int) -> Callable[[], object]:
        param = nn.Parameter(torch.zeros(numel, dtype=weight.dtype, device=device))
        param.grad = torch.randn_like(param)
        return type(opt)([{"params": [param], **hyper}]).step

    try:
        measured = dispatch.measure({"whole": stepper(n), "half": stepper(n // 2)})
    except Exception:  # noqa: BLE001 - any optimizer the Trainer was given: a measurement must not end the run
        return None
    if len(measured) < 2:
        return None
    per_element = max(0.0, measured["whole"][0] - measured["half"][0]) / (n // 2)
    return per_element * skipped


def make_dense(model: nn.Module, pruner: Pruner, names=None, optimizer=None) -> list[str]:
    """The inverse of :func:`make_compact`: replace compact layers of ``pruner`` (``names``, default all) by their
    dense ``nn.Linear`` / ``Conv1D`` (the decompressed weight, the same bias Parameter), masked by the pruner again.

    With ``optimizer``, each layer's state moves with it: every state tensor shaped like the kept values is
    scattered back to the dense positions, ``+0.0`` at pruned ones (in the stored layout: transposed for
    ``Conv1D``), which is the state the masked dense run holds there. Without it (loading a checkpoint written
    before the switch, before the optimizer exists) no state moves. Returns the names of the layers replaced."""
    root = unwrap_model(model)
    done = []
    for layer in pruner.layers:
        if not layer.compact or (names is not None and layer.name not in names):
            continue
        old = layer.module
        dense = to_dense_module(old)
        if old.bias is not None:
            dense.bias = old.bias  # one Parameter for the bias in both forms: its optimizer state stays
        replace_submodule(root, layer.name, dense)
        if optimizer is not None:
            scatter = partial(
                scatter_kept, kept_index=old.kept_index, shape=dense.weight.shape, transposed=layer.transposed
            )
            move_optimizer_state(optimizer, old.weight, dense.weight, scatter)
        pruner.replace_module(layer.name, dense, compact=False)
        done.append(layer.name)
    return done


def install_load_hook(model: nn.Module, pruner: Pruner):
    """Let ``model.load_state_dict`` take a state dict in which each pruned layer is dense or compressed, whatever
    form the layer has in ``model`` now: before anything is copied, each layer whose form differs is replaced by an
    empty layer of the state dict's form (a compact layer's positions, which are its mask, come with the state dict; a
    dense layer's mask with the pruner state of the same checkpoint). Returns the hook's handle."""
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
                compact_names.append(layer.name)
            elif not has_compressed_tensors(state_dict, key) and layer.compact:
                make_dense(root, pruner, {layer.name})
        if compact_names:
            logger.info(
                "hf_sparse: loading %d compact layers from a checkpoint written after the switch", len(compact_names)
            )

    return root.register_load_state_dict_pre_hook(hook)
