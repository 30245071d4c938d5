"""Dynamic masks (Hu et al., ICML 2024): a straight-through masked forward, masked decay, flip rate.

In dynamic mode the pruner keeps the dense master weight ``W`` (pruned positions are *not* zeroed) and makes the
layer compute with ``W ⊙ mask``. The forward is rewritten per module instance, as
``W − (W ⊙ ¬mask).detach()``: its value is ``W ⊙ mask`` (``+0.0`` at pruned positions) and its gradient with
respect to ``W`` is the identity, so every weight, pruned or not, receives the full gradient of the masked
network (straight-through estimator) and a pruned weight that grows can re-enter the mask at the next update.

Why a per-instance ``forward`` and not a parametrization or a forward pre-hook: a parametrization renames the
parameter in the ``state_dict`` (``parametrizations.weight.original``), which would break Trainer checkpoints
and the compressed format; a pre-hook cannot substitute a computed tensor for a registered ``Parameter``. The
instance ``forward`` leaves the parameter, its name and the optimizer untouched, is undone by deleting the
attribute, and is traced by ``torch.compile`` like the class's own forward. The mask lives on the module (in the
module's own weight orientation) and is updated in place, so a compiled graph sees the same tensor every step.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

__all__ = ["has_masked_forward", "masked_decay_", "remove_masked_forward", "set_masked_forward"]

_MASK_ATTR = "hf_sparse_forward_mask"


def _straight_through(weight: Tensor, mask: Tensor) -> Tensor:
    """Value ``weight ⊙ mask`` (``+0.0`` where pruned), gradient the identity."""
    return weight - weight.detach().masked_fill(mask, 0.0)


def _linear_forward(self: nn.Linear, input: Tensor) -> Tensor:
    return F.linear(input, _straight_through(self.weight, getattr(self, _MASK_ATTR)), self.bias)


def _conv1d_forward(self: Conv1D, x: Tensor) -> Tensor:
    size_out = x.size()[:-1] + (self.nf,)
    weight = _straight_through(self.weight, getattr(self, _MASK_ATTR))
    return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), weight).view(size_out)


def set_masked_forward(module: nn.Module, mask: Tensor) -> None:
    """Make ``module`` (``nn.Linear`` or ``Conv1D``) compute with ``weight ⊙ mask``; ``mask`` is logical
    ``(out, in)``. A second call updates the mask in place (same tensor, so compiled graphs stay valid)."""
    local = mask.T if isinstance(module, Conv1D) else mask
    current = getattr(module, _MASK_ATTR, None)
    if current is not None and current.shape == local.shape and current.device == local.device:
        current.copy_(local)
    else:
        setattr(module, _MASK_ATTR, local.contiguous().clone())
    if "forward" not in module.__dict__:
        forward = _conv1d_forward if isinstance(module, Conv1D) else _linear_forward
        module.forward = types.MethodType(forward, module)


def has_masked_forward(module: nn.Module) -> bool:
    return "forward" in module.__dict__ and hasattr(module, _MASK_ATTR)


def remove_masked_forward(module: nn.Module) -> None:
    """Back to the class's own (dense) forward."""
    module.__dict__.pop("forward", None)
    if hasattr(module, _MASK_ATTR):
        delattr(module, _MASK_ATTR)


@torch.no_grad()
def masked_decay_(grad: Tensor, weight: Tensor, mask: Tensor, decay: float) -> Tensor:
    """``grad += decay · (1 − mask) ⊙ weight`` in place (Hu et al.'s masked decay); returns ``grad``."""
    grad.add_(weight.masked_fill(mask, 0.0), alpha=decay)
    return grad
