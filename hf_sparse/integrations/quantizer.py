"""Teaching Transformers the hf_sparse checkpoint format (``quant_method: "hf_sparse"``).

``import hf_sparse`` registers :class:`HfSparseConfig` and :class:`HfSparseQuantizer`, so that a plain
``AutoModelFor*.from_pretrained(dir)`` of an hf_sparse checkpoint:

1. reads ``quantization_config`` from ``config.json`` (rejecting a ``format_version`` it does not know);
2. swaps every listed layer for a :class:`~hf_sparse.nn.SparseLinear` while the model is still on the meta device,
   after checking that the checkpoint holds every compressed tensor with the right shape and dtype;
3. lets Transformers copy the tensors by name, then validates index ranges and ordering of every layer.

A checkpoint loads into another head or into the base model as a dense one does: layer names map across the
base-model prefix (``model.base_model_prefix``: ``bert``, ``transformer``, ``model``...) by Transformers' own rule,
so the compressed tensors land where Transformers puts the dense ones, and ``quantization_config`` is rewritten with
the loaded model's layer names (a save after the load is consistent). Compressed layers of a head the model does not
have are left out, and Transformers reports their tensors as unexpected.

Missing tensors are treated as Transformers treats them in a dense checkpoint where that is meaningful: a missing
bias is initialised by the model's own ``_init_weights`` as the dense layer's bias would be; a missing compressed
tensor (values or positions) cannot be, and raises :class:`CompressedFormatError` naming the tensor and the file.

Nothing named in a config file is imported or executed: layer names only select modules of the model already built.

Without ``import hf_sparse``, loading fails loudly rather than handing back random layers: each pruned layer's
``weight`` holds the kept values with a compressed shape, which Transformers reports as a size mismatch and refuses
(``ignore_mismatched_sizes=False`` is its default).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .._version import __version__
from ..formats.compressed import FORMAT_VERSION, QUANT_METHOD, CompressedFormatError, compressed_shapes
from ..formats.safetensors_header import read_safetensors_header
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


def _get_submodule_parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _model_layer_names(model: nn.Module, names) -> dict[str, str | None]:
    """Where each checkpoint layer of ``names`` lives in ``model``, or None where the model has no such layer.

    Transformers' base-model prefix rule for checkpoint keys (``rename_source_key`` in
    ``transformers.core_model_loading``), applied to the layer's ``weight``: strip ``base_model_prefix`` when the
    model has the stripped key (a task checkpoint into its base model), else add it when the model has the prefixed
    key (a base checkpoint into a task model), else keep the key. The compressed tensors then land in the same module
    as the dense ones.
    """
    keys = set(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "")
    found: dict[str, str | None] = {}
    for name in names:
        key = f"{name}.weight"
        if prefix and key.startswith(f"{prefix}.") and key[len(prefix) + 1 :] in keys:
            key = key[len(prefix) + 1 :]
        elif prefix and f"{prefix}.{key}" in keys:
            key = f"{prefix}.{key}"
        found[name] = key.removesuffix(".weight") if key in keys else None
    return found


def _dense_bias(owner: nn.Module, module: SparseLinear) -> torch.Tensor:
    """The bias ``owner._init_weights`` gives the dense layer ``module`` replaces (its class and shape, its weight on
    the meta device, never allocated), on the device and in the dtype of ``module.bias``."""
    with torch.device("meta"):
        if module.dense_class == "Conv1D":
            dense = Conv1D(module.out_features, module.in_features)
        else:
            dense = nn.Linear(module.in_features, module.out_features)
    dense.bias = nn.Parameter(torch.zeros_like(module.bias))
    with torch.no_grad():
        owner._init_weights(dense)
    return dense.bias.detach()


def _init_owner(model: nn.Module, name: str) -> nn.Module:
    """The innermost ``PreTrainedModel`` holding the layer ``name``: the one whose ``_init_weights`` Transformers
    applies to it."""
    owner, parts = model, name.split(".")
    for depth in range(1, len(parts)):
        sub = model.get_submodule(".".join(parts[:depth]))
        if isinstance(sub, PreTrainedModel):
            owner = sub
    return owner


def _is_loaded(tensor: torch.Tensor) -> bool:
    """Whether Transformers filled ``tensor`` from the checkpoint (it flags every tensor it loads); offloaded (meta)
    tensors are filled later and count as loaded."""
    return tensor.device.type == "meta" or getattr(tensor, "_is_hf_initialized", False)


@register_quantizer(QUANT_METHOD)
class HfSparseQuantizer(HfQuantizer):
    """Builds :class:`SparseLinear` modules for the layers an hf_sparse checkpoint lists, and serialises them."""

    requires_calibration = True  # the weights must already be compressed: there is no on-the-fly conversion

    def __init__(self, quantization_config: HfSparseConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.export_state_dict: dict[str, torch.Tensor] | None = None
        self.checkpoint_files: list[str] = []  # read at load: the files, where each tensor is, each layer's name
        self.tensor_files: dict[str, str] = {}
        self.source_names: dict[str, str] = {}  # loaded model's layer name -> the checkpoint's

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: the format loads on any device; CUDA kernels are optional."""

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files=None, **kwargs: Any
    ) -> nn.Module:
        config = self.quantization_config
        self.checkpoint_files = [str(path) for path in checkpoint_files or []]
        header: dict[str, Any] = {}
        for path in self.checkpoint_files:
            if path.endswith(".safetensors"):
                entries = read_safetensors_header(path)
                header.update(entries)
                self.tensor_files.update(dict.fromkeys(entries, path))
        targets = _model_layer_names(model, config.layers)
        layers: dict[str, dict[str, Any]] = {}
        for name, spec in config.layers.items():
            target = targets[name]
            if target is None:
                if f"{name}.weight" in header:  # a layer of a head this model lacks: unexpected keys, as if dense
                    logger.info(
                        "hf_sparse: %s is not part of %s; its tensors are not loaded", name, type(model).__name__
                    )
                    continue
                prefix = getattr(model, "base_model_prefix", "")
                raise CompressedFormatError(
                    f"quantization_config names layer {name!r}, which {type(model).__name__} does not have "
                    f"(with or without its base-model prefix {prefix!r}), and the checkpoint holds no tensors for it: "
                    "config.json does not match the weights; save the checkpoint again from the model that wrote it"
                )
            module = model.get_submodule(target)
            pattern = parse_pattern(spec["pattern"])
            rows, cols = (int(x) for x in spec["shape"])
            nnz = spec.get("nnz")
            if header:
                nnz = self._check_header(name, header, pattern, rows, cols, nnz)
            sparse = SparseLinear(
                cols,
                rows,
                pattern,
                bias=getattr(module, "bias", None) is not None,
                nnz=nnz,
                dense_class=spec.get("module", "Linear"),
                dtype=module.weight.dtype,
                device=module.weight.device,
            )
            parent, child = _get_submodule_parent(model, target)
            setattr(parent, child, sparse)
            layers[target] = spec
            self.source_names[target] = name
        if layers.keys() != config.layers.keys():  # the loaded model's names, so that saving it again is consistent
            config.layers = layers
            config.patterns = sorted({spec["pattern"] for spec in layers.values()})
        return model

    def _file_of(self, name: str) -> str:
        """The checkpoint file that holds layer ``name``'s tensors, else every file read."""
        for tensor, path in self.tensor_files.items():
            if tensor.startswith(f"{name}."):
                return path
        return ", ".join(self.checkpoint_files) or "the checkpoint"

    def _check_header(
        self, name: str, header: dict[str, Any], pattern, rows: int, cols: int, nnz: int | None
    ) -> int | None:
        """Every compressed tensor of ``name`` present, with the shape and dtype its pattern implies."""
        values = header.get(f"{name}.weight")
        if values is None:
            raise CompressedFormatError(f"{name}.weight: missing from {self._file_of(name)} (pattern {pattern})")
        if isinstance(pattern, Unstructured):
            nnz = int(values["shape"][0]) if len(values["shape"]) == 1 else -1
        for key, shape in compressed_shapes(pattern, rows, cols, nnz).items():
            entry = header.get(f"{name}.{key}")
            if entry is None:
                raise CompressedFormatError(f"{name}.{key}: missing from {self._file_of(name)} (pattern {pattern})")
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
                self._complete(model, name, module)
                module.validate(prefix=name)
        fold_activations(model)  # BERT-family GELU into the 2:4 kernel's epilogue (hf_sparse.nn.fold)
        return model

    def _complete(self, model: nn.Module, name: str, module: SparseLinear) -> None:
        """Raise for a compressed tensor the checkpoint lacked; initialise a missing bias as Transformers would."""
        source = self.source_names.get(name, name)
        for key, tensor in module.compressed_tensors().items():
            if not _is_loaded(tensor):
                raise CompressedFormatError(
                    f"{source}.{key}: missing from {self._file_of(source)}; compressed weights cannot be initialised. "
                    "Save the checkpoint again from the model that wrote it"
                )
        if module.bias is not None and not _is_loaded(module.bias):
            with torch.no_grad():
                module.bias.copy_(_dense_bias(_init_owner(model, name), module))

    def get_state_dict_and_metadata(self, model: nn.Module):
        """For saving: the compressed state dict prepared by :func:`hf_sparse.save_pretrained`, else the model's own."""
        # No metadata of our own (format_version is in config.json): safetensors writes the metadata map in an order
        # that changes from process to process, so any key beside Transformers' one "format" key would make two
        # saves of the same model differ byte-wise.
        return self.export_state_dict, {}

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
