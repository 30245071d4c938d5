"""Teaching Transformers the hf_sparse checkpoint format (``quant_method: "hf_sparse"``).

``import hf_sparse`` registers :class:`HfSparseConfig` and :class:`HfSparseQuantizer`, so that a plain
``AutoModelFor*.from_pretrained(dir)`` of an hf_sparse checkpoint:

1. reads ``quantization_config`` from ``config.json`` (rejecting a ``format_version`` it does not know);
2. swaps every listed layer for a :class:`~hf_sparse.nn.SparseLinear` while the model is still on the meta device,
   after checking that the checkpoint holds every compressed tensor with the right shape and dtype;
3. lets Transformers copy the tensors by name, then validates index ranges and ordering of every layer.

Nothing named in a config file is imported or executed: layer names only select modules of the model already built.

Without ``import hf_sparse``, loading fails loudly rather than handing back random layers: each pruned layer's
``weight`` holds the kept values with a compressed shape, which Transformers reports as a size mismatch and refuses
(``ignore_mismatched_sizes=False`` is its default).
"""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .._version import __version__
from ..formats.compressed import FORMAT_VERSION, QUANT_METHOD, CompressedFormatError, compressed_shapes
from ..nn.convert import to_dense
from ..nn.fold import fold_activations
from ..nn.sparse_linear import SparseLinear
from ..patterns import Unstructured, parse_pattern

__all__ = ["QUANT_METHOD", "HfSparseConfig", "HfSparseQuantizer"]

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"U8": torch.uint8}


@register_quantization_config(QUANT_METHOD)
class HfSparseConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of an hf_sparse checkpoint.

    Args:
        layers: ``{module name: {"pattern": str, "shape": [out, in], "module": "Linear" | "Conv1D", "nnz": int?}}``.
        format_version: the on-disk format (``docs/format.md``); loading refuses versions it does not know.
        hf_sparse_version: the library version that wrote the checkpoint.
        sparsity_config: the :class:`~hf_sparse.SparsityConfig` of the run that produced it (informational).
    """

    def __init__(
        self,
        layers: dict[str, dict[str, Any]] | None = None,
        format_version: int = FORMAT_VERSION,
        hf_sparse_version: str = __version__,
        patterns: list[str] | None = None,
        sparsity_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        if format_version != FORMAT_VERSION:
            raise ValueError(
                f"hf_sparse checkpoint has format_version={format_version!r} (written by hf_sparse "
                f"{hf_sparse_version}); this hf_sparse {__version__} reads format_version {FORMAT_VERSION}. "
                "Upgrade hf_sparse to load it, or convert it to dense with the version that wrote it "
                "(hf_sparse.to_dense(model) then save_pretrained)."
            )
        self.format_version = format_version
        self.hf_sparse_version = hf_sparse_version
        self.layers = dict(layers or {})
        for name, spec in self.layers.items():
            try:
                parse_pattern(spec["pattern"])
                rows, cols = (int(x) for x in spec["shape"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"quantization_config.layers[{name!r}] = {spec!r} is malformed: {err}") from None
        self.patterns = sorted({spec["pattern"] for spec in self.layers.values()}) if patterns is None else patterns
        self.sparsity_config = sparsity_config
        unknown = sorted(k for k in kwargs if k != "quant_method")
        if unknown:
            logger.warning("hf_sparse: ignoring unknown quantization_config keys %s; upgrade hf_sparse", unknown)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "format_version": self.format_version,
            "hf_sparse_version": self.hf_sparse_version,
            "patterns": list(self.patterns),
            "layers": {name: dict(spec) for name, spec in self.layers.items()},
            "sparsity_config": self.sparsity_config,
        }


def _read_safetensors_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor names, dtypes and shapes, without reading any data."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))


def _get_submodule_parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


@register_quantizer(QUANT_METHOD)
class HfSparseQuantizer(HfQuantizer):
    """Builds :class:`SparseLinear` modules for the layers an hf_sparse checkpoint lists, and serialises them."""

    requires_calibration = True  # the weights must already be compressed: there is no on-the-fly conversion

    def __init__(self, quantization_config: HfSparseConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.export_state_dict: dict[str, torch.Tensor] | None = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: the format loads on any device; CUDA kernels are optional."""

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files=None, **kwargs: Any
    ) -> nn.Module:
        layers = self.quantization_config.layers
        header: dict[str, Any] = {}
        for path in checkpoint_files or []:
            if str(path).endswith(".safetensors"):
                header.update(_read_safetensors_header(str(path)))
        for name, spec in layers.items():
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise CompressedFormatError(
                    f"quantization_config names layer {name!r}, which {type(model).__name__} does not have"
                ) from None
            pattern = parse_pattern(spec["pattern"])
            rows, cols = (int(x) for x in spec["shape"])
            has_bias = getattr(module, "bias", None) is not None
            nnz = spec.get("nnz")
            if header:
                nnz = self._check_header(name, header, pattern, rows, cols, nnz)
            sparse = SparseLinear(
                cols,
                rows,
                pattern,
                bias=has_bias,
                nnz=nnz,
                dense_class=spec.get("module", "Linear"),
                dtype=module.weight.dtype,
                device=module.weight.device,
            )
            parent, child = _get_submodule_parent(model, name)
            setattr(parent, child, sparse)
        return model

    @staticmethod
    def _check_header(name: str, header: dict[str, Any], pattern, rows: int, cols: int, nnz: int | None) -> int | None:
        """Every compressed tensor of ``name`` present, with the shape and dtype its pattern implies."""
        values = header.get(f"{name}.weight")
        if values is None:
            raise CompressedFormatError(f"{name}.weight: missing from the checkpoint")
        if isinstance(pattern, Unstructured):
            nnz = int(values["shape"][0]) if len(values["shape"]) == 1 else -1
        for key, shape in compressed_shapes(pattern, rows, cols, nnz).items():
            entry = header.get(f"{name}.{key}")
            if entry is None:
                raise CompressedFormatError(f"{name}.{key}: missing from the checkpoint (pattern {pattern})")
            if tuple(entry["shape"]) != tuple(shape):
                raise CompressedFormatError(
                    f"{name}.{key}: shape {tuple(entry['shape'])} in the checkpoint, expected {tuple(shape)} for "
                    f"pattern {pattern} on a ({rows}, {cols}) weight"
                )
            if key != "weight" and entry["dtype"] != "U8":
                raise CompressedFormatError(f"{name}.{key}: dtype {entry['dtype']} in the checkpoint, expected U8")
        return nnz

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for name, module in model.named_modules():
            if isinstance(module, SparseLinear):
                module.validate(prefix=name)
        fold_activations(model)  # BERT-family GELU into the 2:4 kernel's epilogue (hf_sparse.nn.fold)
        return model

    def get_state_dict_and_metadata(self, model: nn.Module):
        """For saving: the compressed state dict prepared by :func:`hf_sparse.save_pretrained`, else the model's own."""
        metadata = {"hf_sparse_format_version": str(FORMAT_VERSION)}
        return self.export_state_dict, metadata

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def _dequantize(self, model: nn.Module, dtype=None) -> nn.Module:
        return to_dense(model)
