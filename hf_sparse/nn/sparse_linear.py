"""``SparseLinear``: a linear layer whose weight lives in the compressed hf_sparse format.

This is the module ``from_pretrained`` builds for every pruned layer of an hf_sparse checkpoint. Its parameters and
buffers carry the on-disk names (``weight`` holds the kept values, ``weight_indices`` / ``weight_columns`` /
``weight_selectors`` / ``weight_bitmap`` the positions), so loading and saving are plain state-dict copies and a
save after a load writes the same bytes.

``weight`` is a trainable Parameter: fine-tuning a loaded model updates the kept values and can never revive a
pruned one, because pruned positions are not represented at all.

The forward pass runs on the dense weight rebuilt from the compressed tensors (cached while the values do not
change) with ``F.linear``, which is bit-exact with the model that was saved. For inference on CUDA in bf16/fp16
(the weight's dtype, or autocast's) with a pattern the kernels run (2:4, V:2:M), the layer instead builds the kernel
layout once from its compressed tensors (:func:`hf_sparse.ops.pack_from_logical`; rebuilt only if the values
change) and goes through the dispatcher (:mod:`hf_sparse.ops.dispatch`), which uses the sparse kernel, cuSPARSELt or
dense cuBLAS, whichever it measured fastest for the shape. Training a loaded model (gradients on ``weight``) keeps
the dense path.

Once the dispatcher has measured a token bucket, the layer keeps the choice resolved
(:func:`hf_sparse.ops.dispatch.resolved_forward`) and later calls go straight to it: inference is often limited by
the host's time to issue the kernels, not by the GPU (``benchmarks/RESULTS.md``), and the per-call lookups of the
general path cost a host-bound forward as much as the kernel saves. The resolved route is dropped when the values,
the bias or the ``HF_SPARSE_*`` variables change.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..formats.bitpack import unpack_bits
from ..formats.compressed import compress, compressed_shapes, decompress, kept_index, mask_from_compressed, validate
from ..ops import PackedWeight, dispatch, pack_from_logical
from ..ops.spmm import activate
from ..patterns import NM, Pattern, Unstructured, parse_pattern
from .kernel_path import kernel_pattern

__all__ = ["SparseLinear"]

_ROUTE_ENV = ("HF_SPARSE_BACKEND", "HF_SPARSE_SPMM_KERNEL")  # what the dispatcher and the kernel choice read


class SparseLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` (``out_features x in_features``) stored compressed under ``pattern``.

    Args:
        in_features, out_features: as ``nn.Linear``.
        pattern: the pattern the weight follows (``"2:4"``, ``"64:2:8"``, ``"unstructured:0.9"`` or an object).
        bias: whether the layer has a bias.
        nnz: number of kept weights (unstructured patterns only: it fixes the values' length).
        dense_class: what :func:`hf_sparse.to_dense` turns it back into: ``"Linear"``, or ``"Conv1D"`` for GPT-2
            layers whose dense weight is stored transposed.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        pattern: str | Pattern,
        bias: bool = True,
        *,
        nnz: int | None = None,
        dense_class: Literal["Linear", "Conv1D"] = "Linear",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.pattern = parse_pattern(pattern)
        self.dense_class = dense_class
        if isinstance(self.pattern, Unstructured) and nnz is None:
            raise ValueError("SparseLinear: an unstructured pattern needs nnz (the number of kept weights)")
        shapes = compressed_shapes(self.pattern, out_features, in_features, nnz)
        self.weight = nn.Parameter(torch.empty(shapes.pop("weight"), dtype=dtype, device=device))
        for key, shape in shapes.items():
            self.register_buffer(key, torch.zeros(shape, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self._dense_cache: tuple[tuple, Tensor] | None = None
        self._index: Tensor | None = None  # kept_index, int32 where R*K fits (see kept_index)
        self._packed_cache: tuple[tuple, PackedWeight] | None = None
        # (token bucket, dtype) -> (stamp, the measured backend as a function of x): see forward
        self._routes: dict[tuple, tuple[tuple, Callable[[Tensor], Tensor]]] = {}
        vm = kernel_pattern(self.pattern)
        self._kernel_vm = vm if vm is not None and in_features % 8 == 0 and out_features % 8 == 0 else None
        # an activation applied to the output, folded in from the parent module at load (hf_sparse.nn.fold): the
        # 2:4 kernel applies it in its epilogue instead of a separate pass over the output
        self.activation: str | None = None

    @classmethod
    def from_dense(
        cls, module: nn.Module, mask: Tensor, pattern: str | Pattern, *, dtype: torch.dtype | None = None
    ) -> SparseLinear:
        """The compact layer of an ``nn.Linear`` or GPT-2 ``Conv1D`` whose mask is final.

        ``mask``: bool, in the logical ``(out, in)`` shape (also for ``Conv1D``, whose weight is stored ``(in, out)``),
        following ``pattern``. ``weight`` becomes the kept values in the on-disk order
        (:func:`hf_sparse.formats.compressed.compress`), in ``dtype`` (default: the dense weight's, e.g. the fp32
        master under mixed precision); the positions become the on-disk buffers; ``bias`` is the module's own
        Parameter. Same device and ``requires_grad`` as the dense weight.
        """
        pattern = parse_pattern(pattern)
        conv1d = type(module).__name__ == "Conv1D"
        dense = module.weight.detach()
        if conv1d:
            dense = dense.t()
        rows, cols = dense.shape
        if tuple(mask.shape) != (rows, cols):
            raise ValueError(
                f"SparseLinear.from_dense: mask shape {tuple(mask.shape)} != the logical (out, in) weight shape "
                f"{(rows, cols)} of the {type(module).__name__}; pass the mask in (out, in) layout"
            )
        fit = pattern.fit_error(rows, cols)
        if fit:
            raise ValueError(f"SparseLinear.from_dense: pattern {pattern} cannot tile shape ({rows}, {cols}): {fit}")
        tensors = compress(dense, mask.to(dense.device), pattern)
        values = tensors.pop("weight")
        nnz = values.numel() if isinstance(pattern, Unstructured) else None
        bias = getattr(module, "bias", None)
        layer = cls(
            cols,
            rows,
            pattern,
            bias=False,
            nnz=nnz,
            dense_class="Conv1D" if conv1d else "Linear",
            dtype=dtype or dense.dtype,
            device=dense.device,
        )
        with torch.no_grad():
            layer.weight.copy_(values)
            for key, value in tensors.items():
                getattr(layer, key).copy_(value)
        layer.weight.requires_grad_(module.weight.requires_grad)
        layer.bias = bias
        return layer

    @property
    def kept_index(self) -> Tensor:
        """Flat index (int64, ``(nnz,)``) into the logical ``(out * in)`` weight of each element of ``weight``, in
        ``weight``'s order. Built from the position buffers on first use and kept by the layer (int32 where
        ``out * in < 2**31``: half the bytes; this property returns it as int64), rebuilt after ``.to()``; not in
        the state dict."""
        return self._kept().long()

    def _kept(self) -> Tensor:
        """The cached kept index (int32 where it fits) on the weight's device."""
        index = self._index
        if index is None:
            with torch.no_grad():
                index = kept_index(self.compressed_tensors(), self.pattern, self.logical_shape)
                rows, cols = self.logical_shape
                index = index.to(device=self.weight.device, dtype=torch.int32 if rows * cols < 2**31 else torch.int64)
            self._index = index
        return index

    def _load_from_state_dict(self, *args, **kwargs):  # new positions: what was derived from them is stale
        self._drop_derived()
        super()._load_from_state_dict(*args, **kwargs)

    # ------------------------------------------------------------------ compressed tensors
    def compressed_tensors(self) -> dict[str, Tensor]:
        out = {"weight": self.weight}
        out.update({key: buf for key, buf in self._buffers.items() if key.startswith("weight_") and buf is not None})
        return out

    def validate(self, prefix: str = "") -> None:
        """Check the tensors against the pattern; raises :class:`CompressedFormatError` naming the bad tensor."""
        validate(self.compressed_tensors(), self.pattern, self.logical_shape, prefix)

    @property
    def logical_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def mask(self) -> Tensor:
        return mask_from_compressed(self.compressed_tensors(), self.pattern, self.logical_shape)

    def dense_weight(self) -> Tensor:
        """The ``(out, in)`` dense weight (``+0.0`` at pruned positions), differentiable with respect to the kept
        values: one scatter of ``weight`` at :attr:`kept_index`."""
        rows, cols = self.logical_shape
        w = self.weight
        return (
            torch.zeros(rows * cols, dtype=w.dtype, device=w.device)
            .index_put_((self._kept(),), w.reshape(-1))
            .view(rows, cols)
        )

    def _reference_weight(self) -> Tensor:
        """:meth:`dense_weight` for the reference forward: on CPU, without gradients, cached while the values stay
        the same (a loaded model's inference); rebuilt on every call otherwise (no dense copy is kept on a GPU)."""
        w = self.weight
        if w.is_cuda or (torch.is_grad_enabled() and w.requires_grad) or torch.compiler.is_compiling():
            return self.dense_weight()
        key = (w._version, w.data_ptr(), w.dtype, w.device)
        if self._dense_cache is None or self._dense_cache[0] != key:
            with torch.no_grad():
                self._dense_cache = (key, self.dense_weight())
        return self._dense_cache[1]

    def packed_weight(self, dtype: torch.dtype) -> PackedWeight:
        """The weight in the kernels' layout (``dtype`` bf16/fp16), built from the compressed tensors and cached
        while the values do not change. Only for patterns the kernels run (2:4, V:2:M)."""
        if self._kernel_vm is None:
            raise ValueError(f"SparseLinear: no Sparse Tensor Core kernel runs pattern {self.pattern} at this shape")
        key = (self.weight._version, self.weight.data_ptr(), dtype, self.weight.device)
        if self._packed_cache is None or self._packed_cache[0] != key:
            v, m = self._kernel_vm
            rows, groups = self.out_features, self.in_features // m
            with torch.no_grad():
                values = self.weight.detach()
                if isinstance(self.pattern, NM):  # 2:4: the in-group offsets are the selectors
                    selectors = unpack_bits(self.weight_indices, 2, 2 * groups)
                    columns = None
                else:
                    selectors = unpack_bits(self.weight_selectors, 2, 2 * groups)
                    columns = self.weight_columns
                selectors = selectors.reshape(rows, groups, 2).to(values.device)
                packed = pack_from_logical(values, columns, selectors, v, m, dtype)
            self._packed_cache = (key, packed)
        return self._packed_cache[1]

    def _drop_derived(self) -> None:
        self._dense_cache = None
        self._index = None
        self._packed_cache = None
        self._routes.clear()

    def _apply(self, fn, recurse=True):  # .to()/.half(): everything derived is rebuilt on the new device / dtype
        self._drop_derived()
        return super()._apply(fn, recurse)

    def _kernel_dtype(self, x: Tensor) -> torch.dtype | None:
        """The compute dtype when this call can use the kernels (CUDA inference in bf16/fp16), else None."""
        if self._kernel_vm is None or not x.is_cuda or (torch.is_grad_enabled() and self.weight.requires_grad):
            return None
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        else:
            dtype = x.dtype
        return dtype if dtype in (torch.bfloat16, torch.float16) else None

    def _stamp(self) -> tuple:
        """What a resolved route depends on besides the call shape: the values (weight and bias versions and the
        weight's address) and the environment variables that pick backends and kernels."""
        w, b = self.weight, self.bias
        stamp = (w._version, w.data_ptr(), None if b is None else b._version, self.activation)
        return stamp + tuple(map(os.environ.get, _ROUTE_ENV))

    def forward(self, x: Tensor) -> Tensor:
        dtype = self._kernel_dtype(x)
        if dtype is None:
            y = F.linear(x, self._reference_weight(), self.bias)
            return y if self.activation is None else activate(y, self.activation)
        tokens = x.numel() // self.in_features
        route_key = (1 << max(0, tokens - 1).bit_length(), dtype)
        stamp = self._stamp()
        route = self._routes.get(route_key)
        if route is not None and route[0] == stamp:  # inference's hot path: one dict lookup, then the backend
            return route[1](x if x.dtype == dtype else x.to(dtype))
        dense = self._reference_weight()
        packed = self.packed_weight(dtype)
        xc = x if x.dtype == dtype else x.to(dtype)
        y = dispatch.linear_forward(xc, dense, packed, self.bias, activation=self.activation)
        if dispatch.backend_mode() == "auto":
            run = dispatch.resolved_forward(packed, dense, self.bias, tokens, x.device, self.activation)
            if run is not None:
                self._routes[route_key] = (stamp, run)
        return y

    def extra_repr(self) -> str:
        act = "" if self.activation is None else f", activation={self.activation}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.pattern}, "
            f"bias={self.bias is not None}{act}"
        )

    def to_dense_module(self) -> nn.Module:
        """A plain ``nn.Linear`` (or GPT-2 ``Conv1D``) holding the decompressed weight."""
        with torch.no_grad():
            dense = decompress(self.compressed_tensors(), self.pattern, self.logical_shape)
        device, dtype = self.weight.device, self.weight.dtype
        if self.dense_class == "Conv1D":
            from transformers.pytorch_utils import Conv1D

            module = Conv1D(self.out_features, self.in_features).to(device=device, dtype=dtype)
            module.weight.data.copy_(dense.T)
        else:
            module = nn.Linear(
                self.in_features, self.out_features, bias=self.bias is not None, device=device, dtype=dtype
            )
            module.weight.data.copy_(dense)
        if self.bias is not None:
            module.bias.data.copy_(self.bias.detach())
        elif self.dense_class == "Conv1D":
            module.bias.data.zero_()
        return module
