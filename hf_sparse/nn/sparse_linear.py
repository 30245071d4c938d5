"""``SparseLinear``: a linear layer that holds only the kept values of its pruned weight.

This is the module ``from_pretrained`` builds for every pruned layer of an hf_sparse checkpoint, and the one a pruned
``nn.Linear`` / GPT-2 ``Conv1D`` becomes once its mask is final (:meth:`SparseLinear.from_dense`). Its parameters and
buffers carry the on-disk names (``weight`` holds the kept values, ``weight_indices`` / ``weight_columns`` /
``weight_selectors`` / ``weight_bitmap`` the positions), so loading and saving are plain state-dict copies and a
save after a load writes the same bytes.

``weight`` is a trainable Parameter: its gradient, optimizer state, clipping and all-reduce see the kept values only,
and training can never revive a pruned position, because pruned positions are not represented at all.

Compute:

* On CUDA in bf16/fp16 (autocast's dtype, else the input's) with a pattern the kernels run (2:4, V:2:M, both
  dimensions multiples of 8), the layer runs on its own kernel state (:class:`~hf_sparse.nn.compact.CompactKernel`:
  the packed values, the transposed pack where the mask is transposable 2:4, the measured plan), in training and
  in inference alike. It keeps no dense copy of the weight. Under ``torch.inference_mode()`` the pack holds the values
  and positions in place of ``weight`` and the position buffers (``CompactKernel.adopt``);
  :meth:`SparseLinear.on_disk_form`, which saving, ``.to()``, training and every reader of the on-disk form call,
  brings that form back bit for bit.
* Elsewhere (CPU, fp32 without autocast, other patterns or shapes) it runs the reference: the dense weight rebuilt
  by one scatter of the values at :attr:`SparseLinear.kept_index`, then ``F.linear`` -- bit-exact with the masked
  dense layer. On CPU without gradients (a loaded model's inference) that dense weight is cached while the values
  stay the same; otherwise, and always on a GPU, it is rebuilt on every call and not kept.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..formats.compressed import compress, compressed_shapes, decompress, kept_index, mask_from_compressed, validate
from ..ops.spmm import activate
from ..patterns import Pattern, Unstructured, parse_pattern
from .compact import CompactKernel, kernel_pattern
from .compiled import compact_linear, register_compact_layer

__all__ = ["SparseLinear"]


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
        self._kernel: CompactKernel | None = None
        # the kernel state whose pack holds this layer's values and positions (inference; see CompactKernel.adopt),
        # or None while they are in the on-disk form
        self._resident: CompactKernel | None = None
        vm = kernel_pattern(self.pattern)
        self._kernel_vm = vm if vm is not None and in_features % 8 == 0 and out_features % 8 == 0 else None
        # an activation applied to the output, folded in from the parent module at load (hf_sparse.nn.fold): the
        # 2:4 kernel applies it in its epilogue instead of a separate pass over the output
        self.activation: str | None = None
        self._compact_id = register_compact_layer(self)  # what a compiled graph finds the layer by

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

    def _save_to_state_dict(self, *args, **kwargs):  # the on-disk form, also after inference moved it into the pack
        self.on_disk_form()
        super()._save_to_state_dict(*args, **kwargs)

    def on_disk_form(self) -> None:
        """Bring ``weight`` and the position buffers back to the on-disk form where inference had moved them into
        the kernel's pack (:meth:`CompactKernel.adopt`); a no-op otherwise. Every reader of the values or positions
        other than the kernels goes through here."""
        kernel = self._resident
        if kernel is not None:
            kernel.release(self)
            self._resident = None

    # ------------------------------------------------------------------ compressed tensors
    def compressed_tensors(self) -> dict[str, Tensor]:
        self.on_disk_form()
        out = {"weight": self.weight}
        out.update({key: self._buffers[key] for key in self.position_keys() if self._buffers[key] is not None})
        return out

    def position_keys(self) -> list[str]:
        """The names of the position buffers (``weight_indices``, ``weight_columns``, ``weight_selectors``,
        ``weight_bitmap``: the pattern's)."""
        return [key for key in self._buffers if key.startswith("weight_")]

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
        index = self._kept()
        w = self.weight
        return (
            torch.zeros(rows * cols, dtype=w.dtype, device=w.device)
            .index_put_((index,), w.reshape(-1))
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

    def kernel_state(self, dtype: torch.dtype) -> CompactKernel:
        """The layer's kernel state for compute dtype ``dtype`` (bf16/fp16): built from the position buffers on first
        use, rebuilt after ``.to()`` or when the dtype or the folded activation changes. Only for patterns and
        shapes the kernels run (2:4, V:2:M; both dimensions multiples of 8)."""
        k = self._kernel
        if k is None or k.dtype != dtype or k.activation != self.activation:
            self.on_disk_form()
            if self._kernel_vm is None:
                raise ValueError(
                    f"SparseLinear: no Sparse Tensor Core kernel runs pattern {self.pattern} at shape "
                    f"{self.logical_shape} (2:4 and V:2:M with both dimensions multiples of 8 only)"
                )
            k = self._kernel = _build_kernel(self, dtype)
        return k

    def _drop_derived(self) -> None:
        self.on_disk_form()
        self._dense_cache = None
        self._index = None
        self._kernel = None

    def _apply(self, fn, recurse=True):  # .to()/.half(): everything derived is rebuilt on the new device / dtype
        self._drop_derived()
        return super()._apply(fn, recurse)

    def _kernel_dtype(self, x: Tensor) -> torch.dtype | None:
        """The compute dtype when this call runs on the kernels (CUDA, bf16/fp16), else None."""
        if self._kernel_vm is None or not x.is_cuda:
            return None
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return dtype if dtype in (torch.bfloat16, torch.float16) else None

    def forward(self, x: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():  # (torch.compile traces compact_linear, which builds the kernel state)
            kernel = self._kernel
            if kernel is not None and self._resident is kernel and kernel.resident_calls:
                y = kernel.resident_forward(self, x)  # inference on the pack that holds the values: the short path
                if y is not None:
                    return y
        dtype = self._kernel_dtype(x)
        if dtype is None:
            y = F.linear(x, self._reference_weight(), self.bias)
            return y if self.activation is None else activate(y, self.activation)
        if torch.compiler.is_compiling():
            return compact_linear(self, x, dtype)
        return self.kernel_state(dtype)(self, x)

    def extra_repr(self) -> str:
        act = "" if self.activation is None else f", activation={self.activation}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.pattern}, "
            f"bias={self.bias is not None}{act}"
        )

    def to_dense_module(self) -> nn.Module:
        """A plain ``nn.Linear`` (or GPT-2 ``Conv1D``) holding the decompressed weight. Built on the meta device and
        filled, so that no random initialisation draws from the global RNG (a training run's dropout masks stay the
        same)."""
        with torch.no_grad():
            dense = decompress(self.compressed_tensors(), self.pattern, self.logical_shape)
        device, dtype = self.weight.device, self.weight.dtype
        with torch.device("meta"):
            if self.dense_class == "Conv1D":
                from transformers.pytorch_utils import Conv1D

                module = Conv1D(self.out_features, self.in_features)
            else:
                module = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        module = module.to_empty(device=device).to(dtype)
        with torch.no_grad():
            module.weight.copy_(dense.T if self.dense_class == "Conv1D" else dense)
            if self.bias is not None:
                module.bias.copy_(self.bias.detach())
            elif self.dense_class == "Conv1D":
                module.bias.zero_()
        return module


@torch.compiler.disable
def _build_kernel(layer: SparseLinear, dtype: torch.dtype) -> CompactKernel:
    """Built eagerly, also under torch.compile (once per layer: later calls find it built)."""
    return CompactKernel(layer, dtype)
