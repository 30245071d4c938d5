"""Fold a loaded model's GELU into the sparse layer before it, so the 2:4 kernel applies it in its epilogue.

HF's BERT-family intermediate layer is ``act(dense(x))`` with ``act`` the exact GELU: a separate pass over the
(tokens x 4 hidden) output, ~0.8 ms of a BERT-large forward at 8192 tokens on an H200, about as much as the 2:4 kernel
saves on that layer. :func:`fold_activations` sets ``dense.activation = "gelu"`` on the :class:`SparseLinear` and
puts an ``nn.Identity`` in place of the activation module, which the layer keeps (outside its registered children)
so that :func:`unfold_activation` can put it back (``hf_sparse.to_dense`` does). The result is the same function:
the dense path of ``SparseLinear`` runs ``F.gelu(F.linear(...))``, the ops GELU after the product, and the fused
kernel the same exact (erf) GELU in fp32 before rounding to bf16/fp16. The layer's measured plan still times the
fused kernel against dense cuBLAS + GELU and keeps the faster.

Only modules whose class is one of :data:`FOLDABLE` and whose ``forward`` is that of ``BertIntermediate``
(``dense``, then ``intermediate_act_fn``) are folded, and only an exact ``GELUActivation``: a tanh-approximate or
Python GELU would not be the same function.
"""

from __future__ import annotations

import inspect
import logging

import torch.nn.functional as F
from torch import nn

from .sparse_linear import SparseLinear

__all__ = ["FOLDABLE", "fold_activations", "unfold_activation"]

logger = logging.getLogger(__name__)

FOLDABLE = frozenset(
    {
        "BertIntermediate",
        "RobertaIntermediate",
        "XLMRobertaIntermediate",
        "ElectraIntermediate",
        "CamembertIntermediate",
    }
)
_ACT_ATTR = "intermediate_act_fn"
_FOLDED = "_hf_sparse_folded_activation"  # in SparseLinear.__dict__: (parent module's attribute, the module)
_forward_ok: dict[type, bool] = {}


def _is_exact_gelu(act: object) -> bool:
    try:
        from transformers.activations import GELUActivation
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return type(act) is GELUActivation and getattr(act, "act", None) is F.gelu


def _forward_is_dense_then_act(cls: type) -> bool:
    """Whether ``cls.forward`` is ``BertIntermediate``'s (source compared once per class)."""
    ok = _forward_ok.get(cls)
    if ok is None:
        from transformers.models.bert.modeling_bert import BertIntermediate

        try:
            ok = inspect.getsource(cls.forward) == inspect.getsource(BertIntermediate.forward)
        except (OSError, TypeError):
            ok = False
        _forward_ok[cls] = ok
    return ok


def fold_activations(model: nn.Module) -> list[str]:
    """Fold every foldable GELU of ``model`` into its :class:`SparseLinear`; returns the folded modules' names."""
    folded = []
    for name, module in model.named_modules():
        dense, act = getattr(module, "dense", None), getattr(module, _ACT_ATTR, None)
        if (
            type(module).__name__ in FOLDABLE
            and isinstance(dense, SparseLinear)
            and dense._kernel_vm is not None  # a pattern and shape the kernels run: otherwise nothing to gain
            and dense.activation is None
            and _is_exact_gelu(act)
            and _forward_is_dense_then_act(type(module))
        ):
            dense.activation = "gelu"
            dense.__dict__[_FOLDED] = act
            setattr(module, _ACT_ATTR, nn.Identity())
            folded.append(name)
    if folded:
        logger.info("hf_sparse: GELU folded into the sparse layer of %d module(s)", len(folded))
    return folded


def unfold_activation(parent: nn.Module, layer: SparseLinear) -> None:
    """Undo :func:`fold_activations` for ``layer`` (a child of ``parent``): the activation module goes back."""
    act = layer.__dict__.pop(_FOLDED, None)
    if act is not None:
        setattr(parent, _ACT_ATTR, act)
        layer.activation = None
