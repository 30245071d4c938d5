"""Swapping layers of a model in place: dense ``nn.Linear`` / GPT-2 ``Conv1D`` and compact :class:`SparseLinear`.

:func:`to_compact` and :func:`to_dense_module` turn one layer into the other (the compact layer's tensors are the
on-disk tensors of the hf_sparse format); :func:`to_dense` turns a whole loaded model back into a plain dense one.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..formats.compressed import POSITION_KEYS
from ..modeling import unwrap_model
from ..patterns import Pattern, Unstructured
from .fold import unfold_activation
from .sparse_linear import SparseLinear

__all__ = [
    "compact_like",
    "has_compressed_tensors",
    "replace_submodule",
    "to_compact",
    "to_dense",
    "to_dense_module",
]


def replace_submodule(root: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Put ``module`` at ``root.<name>``; returns the module it replaces."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old


def to_compact(module: nn.Module, mask: Tensor, pattern: Pattern) -> SparseLinear:
    """The compact layer of a dense ``nn.Linear`` / ``Conv1D`` and its logical ``(out, in)`` bool ``mask``: its
    ``weight`` holds the kept values in the source dtype (the fp32 master in mixed precision), trainable as the
    dense weight was; the bias is carried over."""
    compact = SparseLinear.from_dense(module, mask, pattern)
    compact.weight.requires_grad_(module.weight.requires_grad)
    return compact.train(module.training)


def compact_like(module: nn.Module, pattern: Pattern, tensors: dict[str, Tensor]) -> SparseLinear:
    """An empty compact layer for ``module`` (dense, same device and dtype) shaped to receive ``tensors``: the
    compressed tensors of one layer as a state dict holds them (keys without the layer's prefix)."""
    weight = module.weight
    rows, cols = weight.shape[::-1] if _stores_transposed(module) else weight.shape
    nnz = int(tensors["weight"].numel()) if isinstance(pattern, Unstructured) else None
    return SparseLinear(
        cols,
        rows,
        pattern,
        bias=getattr(module, "bias", None) is not None,
        nnz=nnz,
        dense_class="Conv1D" if _stores_transposed(module) else "Linear",
        dtype=weight.dtype,
        device=weight.device,
    ).train(module.training)


def has_compressed_tensors(state_dict: dict[str, Tensor], prefix: str) -> bool:
    """Whether ``state_dict`` holds the layer at ``prefix`` (``"encoder.layer.0.output.dense."``) compressed."""
    return any(prefix + key in state_dict for key in POSITION_KEYS)


def to_dense_module(module: SparseLinear) -> nn.Module:
    """A plain ``nn.Linear`` (or ``Conv1D``) with the decompressed weight, trainable as the compact one was."""
    dense = module.to_dense_module()
    dense.weight.requires_grad_(module.weight.requires_grad)
    return dense.train(module.training)


def _stores_transposed(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def to_dense(model: nn.Module) -> nn.Module:
    """Replace every :class:`SparseLinear` by a plain ``nn.Linear`` (GPT-2: ``Conv1D``) in place; returns ``model``.

    The result has no ``quantization_config`` and saves as an ordinary Transformers checkpoint, for tools that do
    not know the hf_sparse format.
    """
    root = unwrap_model(model)
    for name, module in list(root.named_modules()):
        if isinstance(module, SparseLinear):
            parent_name, _, _ = name.rpartition(".")
            unfold_activation(root.get_submodule(parent_name) if parent_name else root, module)  # a folded GELU
            replace_submodule(root, name, module.to_dense_module())
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(root, attr):
            delattr(root, attr)
    config = getattr(root, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    if hasattr(root, "is_quantized"):
        root.is_quantized = False
    return model
