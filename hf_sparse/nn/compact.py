"""The kernel state of a compact :class:`~hf_sparse.nn.SparseLinear` and the autograd function that runs on it.

A compact layer's Parameter ``weight`` holds only its kept values, in the on-disk order ``(R, 2G)`` (``G = K/M``
groups per row, 2 kept per group). On CUDA in bf16/fp16 with a pattern the kernels run (2:4, V:2:M) it computes
through one :class:`CompactKernel`, built once from the layer's position buffers (on first use, again after
``.to()``) and owned by the layer alone:

* ``packed``: the values in the kernels' fragment order (:mod:`hf_sparse.ops._layout`), with the metadata and block
  columns made once from the positions. The fragment order is a permutation of the dimensions of the zero-padded
  logical values (:mod:`.refresh` writes it). The metadata and columns are kept for good (the SDDMM weight gradient
  reads them); the values live in ``buf`` only while an inference plan reads them between calls.
* ``packed_t`` (2:4 layers whose transposed mask is 2:4 too: every 4 consecutive rows of a column keep at most 2, as
  in a transposable mask): ``W^T`` packed as 2:4, for the input gradient ``dX = dY W`` as an SpMM. Its metadata is
  made on the first call that trains and dropped again if the measured plans never use it.
* ``packed24`` (V:2:M layers, M >= 8): the 2:4 view's metadata. A V:2:M weight keeps at most 2 of every M columns of
  a row, so at most 2 of every 4 aligned ones: it is a 2:4 weight too, and the 2:4 kernel runs it at 2:4 speed (with
  more zeros than 2:4 needs), which on the H200 beats the V:2:M kernels at M = 8 and 16 from a few hundred tokens.
  In eager inference the layer holds no view at all: a ``"sparse24"`` forward makes values and metadata from the
  layer's own pack in one launch of the extension's ``view24`` (:meth:`CompactKernel._view_from_pack`), so the layer
  holds one copy of its values.
* the plans, per (token bucket, whether the call trains): the forward (``"sparse"``: SpMM on ``packed``;
  ``"sparse24"``: SpMM on the 2:4 view; ``"dense"``: cuBLAS on a transient dense weight made by one scatter to the
  kept positions), the input gradient (``"sparse"`` on ``packed_t``, else ``"dense"``), the weight gradient
  (``"gemm"``: ``dY^T X`` by cuBLAS, then one gather at the kept positions, cast included; ``"sddmm"``: the kept
  positions only, by the SDDMM kernel on the layer's own metadata, straight into ``weight``'s order in fp32). The
  extension's scatter and gather (``scatter_kept``, ``gather_kept``) read the positions in their on-disk form in place
  (:func:`positions`), so no kept index is held; the torch-op paths (CPU) use the layer's kept index. Each is
  measured once per bucket with :func:`hf_sparse.ops.dispatch.fastest` on the call's own input (under torch.compile on
  a stand-in of the bucket's size, while tracing); where nothing can be measured (CPU, CUDA-graph capture) the plan
  is :data:`DEFAULT_PLAN`.

**A call that trains makes the packs it computes on, inside the call, from the fp32 values** (the forward's pack or
2:4 view, and in the backward the transposed pack), cast to the compute dtype as they are written, and frees them
when it returns: the extension's ``pack_in_call`` (one launch each, in C++), or :meth:`CompactKernel._made` by torch
ops where the extension does not run. Between training calls a layer holds its values, their optimizer state and
the packs' metadata only; there is no second copy of the weights in the compute dtype to keep in step with the
optimizer. A pack argument whose values have no elements (``per_call``) is how the calls ask for this. Each slot
of a transposed pack or a view finds its source from the kept positions in their on-disk form (:mod:`.refresh`:
``TRANSPOSED``, ``VIEW24``), so no permutation is held.

Under ``torch.inference_mode()`` (no call has trained, every measured forward runs on ``packed`` or on a view made
from it per call, the values already in the compute dtype, no layout padding) the pack is the only copy of the
weights: :meth:`CompactKernel.adopt` makes ``layer.weight`` the pack's values (the same elements in the fragment
order) and empties the position buffers (the metadata and block columns hold them), so a loaded model takes the bytes
of its checkpoint tensors. Whatever reads the on-disk form (``state_dict``, ``compressed_tensors``, ``.to()``, a call
that trains, a new measurement) calls :meth:`SparseLinear.on_disk_form` first, which makes it again from the pack
(:meth:`CompactKernel.release`).

The pack inference holds (and the bias in the compute dtype, where it differs) is refreshed after each optimizer step
and on the first call after the weight changed otherwise: when its version counter, its address, the bias's version
or the count of optimizer steps (:mod:`.optimizer_steps`: fused optimizers do not bump versions) differ from the last
refresh. Where the extension runs, a refresh covers every stale compact layer on the device in one launch
(:func:`refresh_stale`; the entries of each layer come from :meth:`CompactKernel.refresh_entries`); elsewhere each
layer runs the same entries with torch ops. The optimizer-step refresh (:func:`refresh_all`, run by the hook of
:mod:`.optimizer_steps`) is what compiled code relies on: it does not check the weights on each call.

Per call, eager: one tuple compare (the refresh check), one plan lookup, a 2-D reshape of the input each way and the
kernel call; backward runs in :class:`_CompactLinearFn` (or the extension's C++ node) on the saved tensors with no
lookups. Under torch.compile the layer is one ``hf_sparse::compact_linear`` op, C++ on CUDA, and its backward one
``hf_sparse::compact_backward`` (:mod:`hf_sparse.nn.compiled`); the plan is measured while
torch.compile traces.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import is_sharded
from ..formats.bitpack import pack_bits, unpack_bits
from ..ops import dispatch
from ..ops._layout import (
    VALID_M,
    VALID_V,
    PackedWeight,
    logical_from_dense,
    logical_from_packed,
    packed_from_logical,
)
from ..ops.sddmm import sddmm_function
from ..ops.spmm import activate, kernel_activation, spmm_function
from ..patterns import NM, VNM, Pattern
from .optimizer_steps import after_optimizer_step, optimizer_steps, watch_optimizer_steps
from .refresh import (
    COPY,
    PACK,
    TRANSPOSED,
    VIEW24,
    RefreshEntry,
    _fill,
    _pieces,
    launch_refresh,
    run_refresh_entries,
)


class SparseLinear(Protocol):
    """What a :class:`CompactKernel` reads and writes of its layer, :class:`hf_sparse.nn.SparseLinear` (which
    imports this module, so the kernel names the layer by this protocol instead of importing it back)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    in_features: int
    out_features: int
    pattern: Pattern
    activation: str | None
    _kernel_vm: tuple[int, int] | None
    _kernel: CompactKernel | None
    _resident: CompactKernel | None
    _index: Tensor | None
    _dense_cache: tuple | None
    _compact_id: int
    _buffers: dict[str, Tensor | None]

    @property
    def logical_shape(self) -> tuple[int, int]: ...

    def _kept(self) -> Tensor: ...

    def on_disk_form(self) -> None: ...

    def position_keys(self) -> list[str]: ...

    def kernel_state(self, dtype: torch.dtype) -> CompactKernel: ...


__all__ = ["DEFAULT_PLAN", "CompactKernel", "kernel_pattern"]

# (forward, input gradient, weight gradient) where nothing was measured; the input gradient runs "sparse" where the
# layer has a transposed pack
DEFAULT_PLAN = ("sparse", "dense", "gemm")


def kernel_pattern(pattern: Pattern) -> tuple[int, int] | None:
    """``(v, m)`` of the kernel layout that runs ``pattern`` (2:4 -> ``(64, 4)``), or None if no kernel does."""
    if isinstance(pattern, NM) and (pattern.n, pattern.m) == (2, 4):
        return 64, 4
    if isinstance(pattern, VNM) and pattern.n == 2 and pattern.m in VALID_M:
        if pattern.m == 4:
            return 64, 4
        if pattern.v in VALID_V:
            return pattern.v, pattern.m
    return None


def _positions(layer: SparseLinear) -> tuple[Tensor | None, Tensor]:
    """``(columns, selectors)`` of the logical kernel form, from the layer's position buffers."""
    groups = layer.in_features // layer._kernel_vm[1]
    if isinstance(layer.pattern, NM):  # 2:4: the in-group offsets are the selectors
        return None, unpack_bits(layer.weight_indices, 2, 2 * groups).reshape(layer.out_features, groups, 2)
    selectors = unpack_bits(layer.weight_selectors, 2, 2 * groups).reshape(layer.out_features, groups, 2)
    return layer.weight_columns, selectors


def position_layout(pattern: Pattern) -> tuple[str, str | None, int]:
    """``(codes, columns, v)`` of a layer of ``pattern``: the names of the buffers that hold its kept positions in
    their on-disk form, as the extension's dense choices read them in place (no index is built): the 2-bit codes
    (2:4: ``weight_indices``; V:2:M: ``weight_selectors``), the block columns (V:2:M: ``weight_columns``, else None),
    and the pattern's V (1 for 2:4)."""
    if isinstance(pattern, NM):
        return "weight_indices", None, 1
    return "weight_selectors", "weight_columns", pattern.v


def positions(
    layer: SparseLinear, layout: tuple[str, str | None, int] | None = None
) -> tuple[Tensor, Tensor | None, int]:
    """``(sel, sel_columns, v)``: the layer's kept positions in their on-disk form (:func:`position_layout`; pass
    the ``layout`` a kernel holds where torch.compile traces the call: the graph then guards on the buffers it reads,
    not on the layer's pattern)."""
    codes, columns, v = layout or position_layout(layer.pattern)
    return getattr(layer, codes), None if columns is None else getattr(layer, columns), v


def token_bucket(tokens: int) -> int:
    """The token bucket of a call with ``tokens`` rows of input: the smallest power of two that holds them (1 for
    none). A plan is measured once per bucket (:meth:`CompactKernel.prepare`); the compiled path computes the same
    bound by comparisons (:func:`hf_sparse.nn.compiled.compact_linear`)."""
    return 1 << max(0, tokens - 1).bit_length()


def _pack24(mask: Tensor, dtype: torch.dtype) -> PackedWeight:
    """The 2:4 pack (``v=64, m=4``, values zero) of a ``(R', K')`` matrix under ``mask`` (at most 2 kept in every
    aligned 4 columns of a row): its metadata, in the layout whose values :mod:`.refresh` writes."""
    rows, cols = mask.shape
    _, _, selectors, _ = logical_from_dense(mask, mask, 64, 4)
    values = torch.zeros(rows, cols // 2, dtype=dtype, device=mask.device)
    valid = torch.ones((), dtype=torch.bool, device=mask.device).expand(rows, cols // 2)
    return packed_from_logical(values, None, selectors, 64, 4, dtype)._replace(valid=valid)


_identity: dict[tuple[int, int, torch.device], Tensor] = {}  # the 2:4 layout's block columns, per shape and device


def _identity_columns(slabs: int, groups: int, device: torch.device) -> Tensor:
    """The block columns of a 2:4 pack with ``slabs`` row slabs and ``groups`` padded groups (0, 1, 2, 3 in every
    block): a constant the views made per call share (:meth:`CompactKernel._view`)."""
    key = (slabs, groups, device)
    if key not in _identity:
        with torch.inference_mode(False):
            _identity[key] = torch.arange(4, dtype=torch.uint8, device=device).repeat(slabs, groups, 1)
    return _identity[key]


def _spmm(x2, values, meta, columns, valid, bias, rows, cols, v, m, fn, code, after, activation) -> Tensor:
    """``act(x2 @ W^T + bias)``: the extension's function ``fn`` where it can take ``x2`` as it is, else the
    ``hf_sparse::spmm`` op (torch.compile, CPU, misaligned input)."""
    if fn is not None and x2.is_contiguous() and x2.data_ptr() % 16 == 0:
        y = fn(x2, values, meta, columns, bias, rows, cols, v, m, code)
        return y if after is None else activate(y, after)
    y = torch.ops.hf_sparse.spmm(x2.contiguous(), values, meta, columns, valid, bias, rows, cols, v, m)
    return y if activation is None else activate(y, activation)


def dense_at_index(weight: Tensor, index: Tensor, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    """A transient dense ``(rows, cols)`` weight in ``dtype``: zeros, then one scatter of the kept values."""
    dense = torch.zeros(rows * cols, dtype=dtype, device=weight.device)
    return dense.index_put_((index,), weight.reshape(-1).to(dtype)).view(rows, cols)


def _sddmm(dy2, x2, values, meta, columns, valid, rows, cols, v, m, fn) -> Tensor:
    if fn is not None and dy2.data_ptr() % 16 == 0 and x2.data_ptr() % 16 == 0:
        return fn(dy2, x2, meta, columns, rows, cols, m)
    return torch.ops.hf_sparse.sddmm(dy2, x2, values, meta, columns, valid, rows, cols, v, m)


def _weight_grad(choice, dy2, x2, weight, index, values, meta, columns, valid, rows, cols, v, m, fn) -> Tensor:
    """The gradient of the kept values, in ``weight``'s order and dtype, by torch ops (the reference of the
    extension's ``compact_backward``)."""
    if choice == "sddmm":
        g = _sddmm(dy2, x2, values, meta, columns, valid, rows, cols, v, m, fn)
    else:
        g = torch.mm(dy2.t(), x2).view(-1).index_select(0, index).view(weight.shape)
    return g if g.dtype == weight.dtype else g.to(weight.dtype)


class _CompactLinearFn(torch.autograd.Function):
    """``y = x2 W^T + b`` (``x2``: the 2-D input in the compute dtype) by ``kernel``'s Python compute
    (:meth:`CompactKernel.forward_compute`, :meth:`CompactKernel.backward_compute`) for ``plan``: eager training where
    the extension has no ``compact_linear`` node (CPU tests, the ops' references). The gradient of ``weight`` is that
    of the kept values only."""

    @staticmethod
    def forward(ctx, x2, weight, bias, kernel, layer, plan):
        ctx.save_for_backward(x2)
        ctx.kernel, ctx.layer, ctx.plan = kernel, layer, plan
        return kernel.forward_compute(layer, x2, plan, fuse=False)

    @staticmethod
    def backward(ctx, dy2):
        (x2,) = ctx.saved_tensors
        dx, dw, db = ctx.kernel.backward_compute(ctx.layer, dy2, x2, ctx.plan, *ctx.needs_input_grad[:3])
        return dx, dw, db, None, None, None


class CompactKernel:
    """What one compact layer computes on in compute dtype ``dtype`` (see the module docstring). Built from the
    layer's position buffers and current values; :meth:`__call__` is the layer's forward."""

    def __init__(self, layer: SparseLinear, dtype: torch.dtype) -> None:
        v, m = layer._kernel_vm
        rows, cols = layer.logical_shape
        weight = layer.weight.detach()
        device = weight.device
        self.dtype, self.rows, self.cols, self.v, self.m, self.device = dtype, rows, cols, v, m, device
        self.groups = cols // m
        self.activation = layer.activation
        self.layout = position_layout(layer.pattern)  # where its kept positions are: see positions
        columns, selectors = _positions(layer)
        base = packed_from_logical(weight, columns, selectors, v, m, dtype)  # metadata and block columns
        self.n, self.shape = base.values.numel(), base.values.shape
        valid = torch.ones((), dtype=torch.bool, device=device).expand(rows, 2 * self.groups)  # every slot is kept
        self.packed = base._replace(values=self._absent(), valid=valid)
        self.buf: Tensor | None = None  # the pack's values (flat); None while freed: see _ensure_pack
        # a pack's values with no elements: "made inside the call from the values" (the extension's pack_in_call)
        self.per_call = torch.empty(0, dtype=dtype, device=device)
        self.entries: tuple | None = None  # (storage key, the refresh's entries): see refresh_entries
        self.pieces = _pieces(rows, self.groups)
        self.transposable: bool | None = None  # decided on the first call that trains
        self.trained = False  # a call that trains has run
        self.packed_t: PackedWeight | None = None
        self.packed24: PackedWeight | None = None  # the 2:4 view (V:2:M layers), where it is kept between calls
        self.traced = False  # a plan was measured while torch.compile traced: the compiled graph reads packed24
        bias = layer.bias
        self.bias_lp = None if bias is None or bias.dtype == dtype else bias.detach().to(dtype)
        self.plans: dict[tuple[int, bool], tuple[str, str, str]] = {}
        # per training plan: the ms per call it surely saves against the masked dense layer (see training_saving_ms)
        self.savings: dict[tuple[int, bool], float] = {}
        self.stamp: tuple | None = None
        cuda = device.type == "cuda"
        self.fns = (spmm_function(m, device), None, sddmm_function(m, device)) if cuda else (None, None, None)
        self.fn24 = spmm_function(4, device) if cuda and m != 4 else None  # the 2:4 view's forward
        self.code, self.after = kernel_activation(self.activation, m, device) if cuda else (0, self.activation)
        self.code24, self.after24 = kernel_activation(self.activation, 4, device) if cuda else (0, self.activation)
        ext = _extension() if cuda else None
        self.native = getattr(ext, "compact_linear", None)  # forward and backward in C++, one autograd node
        self.native_forward = getattr(ext, "compact_forward", None)  # the same computations without autograd
        self.view24 = getattr(ext, "view24", None) if m != 4 else None  # a V:2:M pack's 2:4 view, made per call
        # the 2:4 SpMMs, by name, as one call that makes the view first (resident inference: _resident_call)
        self.spmm_view24 = {
            name: getattr(ext, f"{name}_view24")
            for name in ("spmm", "spmm_wgmma")
            if m != 4 and hasattr(ext, f"{name}_view24")
        }
        self.native_backward = getattr(ext, "compact_backward", None)
        self.refresher = ext if hasattr(ext, "refresh_packs") else None  # the batched refresh: see refresh_stale
        self.layer = weakref.ref(layer)
        self.resident_version = -1  # the weight's version when adopt made the pack its storage
        # while resident: per measured inference bucket, the extension function and its arguments before the bias
        # (resident_forward)
        self.resident_calls: dict[int, tuple] = {}
        _kernels.add(self)
        self._set_kernel_bits()
        watch_optimizer_steps()
        self._ensure_pack(layer)
        self.stamp = _stamp(layer.weight, bias)

    # ------------------------------------------------------------------ packs
    def _absent(self) -> Tensor:
        """What stands for ``packed.values`` while they are freed: zeros of the pack's shape that take no memory
        (the SDDMM reads the metadata and columns only)."""
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)

    def _ensure_pack(self, layer: SparseLinear) -> None:
        """Make ``buf`` (the pack's values) from the current values if it was freed."""
        if self.buf is None:
            with torch.inference_mode(False):  # a normal tensor: it may become the Parameter's storage (adopt)
                self.buf = torch.zeros(self.n, dtype=self.dtype, device=self.device)
            self.packed = self.packed._replace(values=self.buf.view(self.shape))
            with torch.no_grad():
                _fill(self.packed.values, layer.weight.detach(), self.pieces, self.groups)
            self.entries = None

    # ------------------------------------------------------------------ residency (inference)
    def adopt(self, layer: SparseLinear) -> bool:
        """Let the pack hold the layer's values and positions, so that a model run under ``torch.inference_mode()``
        keeps one copy of its weights (plain ``no_grad`` code may write the weights between calls, in their on-disk
        order, and keeps the on-disk form): ``layer.weight`` becomes the pack's values (same shape, dtype and element
        count, in the fragment order) and the position buffers become empty (the metadata and block columns encode
        them). Only where the pack is an exact permutation of the values in their own dtype: no layout padding, no 2:4
        view or bias cast, no call that trained, every measured forward on this pack, no process group or DataParallel
        replica (a wrapper may own the storage). :meth:`SparseLinear.on_disk_form` (every reader of the on-disk form
        calls it: saving, ``.to()``, training, a new measurement) undoes it with :meth:`release`. Returns whether the
        layer is resident."""
        weight = layer.weight
        if (
            self.trained
            or self.buf is None
            or self.packed24 is not None
            or self.bias_lp is not None
            or weight.dtype != self.dtype
            or self.n != weight.numel()
            or type(weight.data) is not Tensor
            or not isinstance(weight, torch.nn.Parameter)  # a DataParallel replica's broadcast copy
            or getattr(layer, "_is_replica", False)
            or any(
                p[0] != "sparse" and not (p[0] == "sparse24" and self._view_from_pack()) for p in self.plans.values()
            )
            or (torch.distributed.is_available() and torch.distributed.is_initialized())
        ):
            return False
        if self.stamp != _stamp(weight, layer.bias):
            self.refresh(layer)
        with torch.no_grad():
            weight.data = self.buf.view(weight.shape)
            for key in layer.position_keys():
                layer._buffers[key] = layer._buffers[key].new_empty(0)
        layer._index = layer._dense_cache = None
        layer._resident = self
        self.entries = None
        self.stamp = _stamp(weight, layer.bias)
        self.resident_version = weight._version
        self.resident_calls = {
            bucket: call
            for (bucket, trains), p in self.plans.items()
            if not trains and (call := self._resident_call(p[0])) is not None
        }
        return True

    def _resident_call(self, forward: str) -> tuple | None:
        """``(fn, arguments before the bias, arguments after it)``: the one extension call of a resident forward by
        ``forward`` (the activation fused), or None where that needs more than one call."""
        q = self.packed
        if forward == "sparse" and self.fns[0] is not None and self.after is None:
            return self.fns[0], (q.values, q.meta, q.columns), (self.rows, self.cols, self.v, self.m, self.code)
        fn = self.spmm_view24.get(getattr(self.fn24, "__name__", None))
        if forward == "sparse24" and fn is not None and self.after24 is None:
            return fn, (q.values, q.meta, q.columns, self._columns24()), (self.rows, self.cols, self.m, self.code24)
        return None

    def resident_forward(self, layer: SparseLinear, x: Tensor) -> Tensor | None:
        """The forward of a resident layer (:meth:`adopt`) in a token bucket it has measured, as one call into the
        extension: a loaded model's inference at few tokens (decoding) is bound by the host's time per layer call,
        and this path reads nothing it does not need. Every plan of a resident layer is the SpMM on its own pack, so
        it computes what :meth:`__call__` would. None where that general path must run: grad mode, autocast, another
        dtype or device, a bucket not measured yet, a misaligned input. Not for torch.compile to trace (the caller
        checks)."""
        if (
            torch.is_grad_enabled()
            or x.dtype != self.dtype
            or x.device != self.device
            or torch.is_autocast_enabled("cuda")
        ):
            return None
        cols = self.cols
        n = x.numel() // cols
        call = self.resident_calls.get(token_bucket(n))
        if call is None:
            return None
        x2 = x.reshape(n, cols)
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            return None
        if layer.weight._version != self.resident_version:
            self.check_resident(layer)  # raises: the weight was written while it held the pack
        fn, before, after = call
        return fn(x2, *before, layer.bias, *after).view(*x.shape[:-1], self.rows)

    def check_resident(self, layer: SparseLinear) -> None:
        """Raise if ``layer.weight`` was written in place while it held the pack's values: such a write assumed the
        on-disk order, and the values it left cannot be told apart from the pack's own."""
        if layer.weight._version != self.resident_version:
            raise RuntimeError(
                f"hf_sparse: the weight of a {type(layer).__name__} ({layer.out_features}x{layer.in_features}, "
                f"{layer.pattern}) was written in place while torch.inference_mode() inference held its values in "
                "the kernel's order, so its values are no longer known; reload the model. Write weights before "
                "inference, through load_state_dict, or after layer.on_disk_form() (model.state_dict() calls it)"
            )

    def release(self, layer: SparseLinear) -> None:
        """The inverse of :meth:`adopt`: new on-disk ``weight`` values and position buffers made from the pack (which
        stays, as a copy of the values, until the plans drop it)."""
        self.check_resident(layer)
        self.resident_calls = {}
        with torch.no_grad(), torch.inference_mode(False):
            values, columns, selectors = logical_from_packed(self.packed)
            layer.weight.data = values  # a new tensor: the pack keeps its storage
            pattern, rows, groups = layer.pattern, self.rows, self.groups
            if isinstance(pattern, NM):
                layer.weight_indices = pack_bits(selectors.reshape(rows, 2 * groups), 2)
            else:
                layer.weight_selectors = pack_bits(selectors.reshape(rows, 2 * groups), 2)
                slabs = pattern.v // 64 if self.m != 4 else 1
                layer.weight_columns = columns[::slabs][: rows // pattern.v]
        self.entries = None
        self.stamp = _stamp(layer.weight, layer.bias)

    def refresh(self, layer: SparseLinear) -> None:
        """Rebuild this layer's packs (and the bias cast) from its current values: with every other stale compact
        layer on the device in one launch where the extension runs (:func:`refresh_stale`), else by
        :meth:`refresh_one`."""
        if self.refresher is not None:
            refresh_stale(self.device)
        if self.stamp != _stamp(layer.weight, layer.bias):
            self.refresh_one(layer)

    def refresh_one(self, layer: SparseLinear) -> None:
        """:meth:`refresh` of this layer alone, by torch ops (the reference of :meth:`refresh_entries`)."""
        run_refresh_entries(self.refresh_entries(layer))
        self.stamp = _stamp(layer.weight, layer.bias)

    def refresh_entries(self, layer: SparseLinear) -> tuple[RefreshEntry, ...]:
        """The work of a refresh (cached until a pack or the weight's storage changes)."""
        weight, bias = layer.weight, layer.bias
        key = (weight.data_ptr(), None if bias is None else bias.data_ptr())
        if self.entries is not None and self.entries[0] == key:
            return self.entries[1]
        w = weight.detach()
        out = []
        if self.buf is not None:
            out.append(RefreshEntry(PACK, w, self.buf, self.rows, self.groups, self.shape[1]))
        if self.bias_lp is not None:
            out.append(RefreshEntry(COPY, bias.detach(), self.bias_lp))
        entries = tuple(out)
        self.entries = (key, entries, tuple(tuple(e.words(0)) for e in entries))
        return entries

    def pack_entry(self, layer: SparseLinear, kind: int, values: Tensor) -> RefreshEntry:
        """The entry that writes ``values`` (of the pack's shape) from the layer's values: the pack of ``kind``
        (``PACK``: the layer's own; ``TRANSPOSED``: ``packed_t``; ``VIEW24``: the 2:4 view), as the extension's
        ``pack_in_call`` writes it inside a training call."""
        w = layer.weight.detach()
        steps = values.shape[1]
        if kind == PACK:
            return RefreshEntry(PACK, w, values, self.rows, self.groups, steps)
        rows, cols = (self.cols, self.rows) if kind == TRANSPOSED else (self.rows, self.cols)
        sel, sel_columns, v = positions(layer, self.layout)
        return RefreshEntry(kind, w, values, rows, cols // 4, steps, sel, sel_columns, self.m, v)

    def _made(self, layer: SparseLinear, kind: int) -> PackedWeight:
        """The pack of ``kind`` (see :meth:`pack_entry`) with its values made now by torch ops: what the extension's
        ``pack_in_call`` makes inside a training call, for the paths that run without it (CPU, the ops'
        references)."""
        packed = {PACK: self.packed, TRANSPOSED: self.packed_t, VIEW24: self.packed24}[kind]
        tiles, steps = packed.meta.shape[:2]
        values = torch.zeros(tiles, steps, 32, 8, dtype=self.dtype, device=self.device)
        run_refresh_entries((self.pack_entry(layer, kind, values),))
        return packed._replace(values=values)

    @torch.compiler.disable  # once per layer, on its first call that trains
    def _ensure_transposed(self, layer: SparseLinear) -> None:
        """Decide transposability (once) and build ``packed_t`` where ``W^T`` is 2:4 too."""
        self.trained = True
        if self.transposable is not None:
            return
        self.transposable = False
        if self.m != 4:
            return
        with torch.no_grad():
            mask_t = layer.mask().t()
            if not bool((mask_t.reshape(self.cols, self.rows // 4, 4).sum(-1) <= 2).all()):
                return
            self.packed_t = _pack24(mask_t, self.dtype)._replace(values=self.per_call)  # values: made per call
        if self.fns[0] is not None:
            self.fns = (self.fns[0], spmm_function(4, self.device), self.fns[2])
            self._set_kernel_bits()
        self.transposable = True

    def _ensure_view24(self, layer: SparseLinear) -> None:
        """Make the 2:4 view's metadata (a V:2:M layer's ``"sparse24"`` forward from its values) if it is not
        there; its values are made per call."""
        if self.packed24 is None:
            with torch.no_grad():
                self.packed24 = _pack24(layer.mask(), self.dtype)._replace(values=self.per_call)

    def _view_from_pack(self) -> bool:
        """Whether an inference ``"sparse24"`` forward makes the 2:4 view from the layer's own pack (values and
        metadata, one launch of the extension's ``view24``) rather than from its values with the view's metadata
        held: in eager inference where the extension has ``view24``. The layer then holds one copy of its values
        (resident: its checkpoint's bytes). Compiled code reads the on-disk values (``native_arguments``)."""
        return self.view24 is not None and not self.traced

    def _source(self, layer: SparseLinear, forward: str, trains: bool) -> tuple[Tensor, PackedWeight]:
        """``(values, pack)``: the values a forward by ``forward`` runs its SpMM on and the pack whose metadata and
        columns it reads; values with no elements (``per_call``) mean "made in the call from the layer's values" (a
        call that trains, a view made from the values). No pack is built here: torch.compile traces this (through
        :meth:`native_arguments`), and each object it reads becomes a guard of the compiled code."""
        if forward == "sparse24":
            if not trains and self._view_from_pack():
                view = self._view()
                return view.values, view
            return self.per_call, self.packed24
        return (self.per_call if trains else self.packed.values), self.packed

    def _view(self) -> PackedWeight:
        """The 2:4 view for an inference ``"sparse24"`` forward, made now from the layer's own pack
        (:meth:`_view_from_pack`)."""
        q = self.packed
        values, meta = self.view24(q.values, q.meta, q.columns, self.rows, self.cols, self.m)
        valid = q.valid.as_strided((self.rows, self.cols // 2), (0, 0))  # every slot (a view: no launch)
        return q._replace(values=values, meta=meta, columns=self._columns24(), valid=valid, v=64, m=4)

    def _columns24(self) -> Tensor:
        """The block columns of the 2:4 view made per call (its tiles are the pack's, its groups of 4 padded to
        whole steps of 8)."""
        return _identity_columns(self.packed.values.shape[0] // 4, -(-self.cols // 32) * 8, self.device)

    def drop_transposed(self) -> None:
        """Free ``packed_t`` (no measured plan runs the input gradient on it)."""
        self.packed_t = None
        self.entries = None

    def _drop_unused(self, layer: SparseLinear, trains: bool) -> None:
        """After a measurement (of a call that ``trains`` or not): free what no measured plan reads (see the module
        docstring)."""
        if not any(p[0] == "sparse24" and (k[1] or not self._view_from_pack()) for k, p in self.plans.items()):
            self.packed24 = None
        if trains and self.packed_t is not None and all(p[1] != "sparse" for k, p in self.plans.items() if k[1]):
            self.drop_transposed()
        if not any(self._holds_pack(p, k[1]) for k, p in self.plans.items()):
            self._free_pack()
        self.entries = None
        if not self.uses_index():
            layer._index = None  # built for the measurement only

    def _holds_pack(self, plan: tuple, trains: bool) -> bool:
        """Whether calls by ``plan`` read the layer's own pack between calls: inference on it, or on the 2:4 view
        made from it. A call that trains makes what it reads."""
        return not trains and (plan[0] == "sparse" or (plan[0] == "sparse24" and self._view_from_pack()))

    def _free_pack(self) -> None:
        """Free the own pack's values (made again by :meth:`_ensure_pack` when inference needs them)."""
        if self.buf is not None:
            self.buf = None
            self.packed = self.packed._replace(values=self._absent())
            self.entries = None

    # ------------------------------------------------------------------ plans
    def _default(self) -> tuple[str, str, str]:
        return (DEFAULT_PLAN[0], "sparse" if self.packed_t is not None else "dense", DEFAULT_PLAN[2])

    def plan(self, layer: SparseLinear, key: tuple[int, bool], x2: Tensor, while_tracing: bool = False) -> tuple:
        """The plan for ``key`` ((token bucket, trains)): measured once on ``x2`` (in the compute dtype) where a
        measurement can run (``while_tracing``: see :func:`hf_sparse.ops.dispatch.can_measure`), else
        :data:`DEFAULT_PLAN` (stored, except while torch.compile traces)."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        if not (x2.is_cuda and dispatch.can_measure(while_tracing)):
            plan = self._default()
            if not torch.compiler.is_compiling():
                if self._holds_pack(plan, key[1]):
                    self._ensure_pack(layer)
                self.plans[key] = plan
            return plan
        if not key[1]:
            self._ensure_pack(layer)
        if self.m != 4 and (key[1] or not self._view_from_pack()):
            self._ensure_view24(layer)
        plan = self.plans[key] = self._measure(layer, key[1], x2)
        self._drop_unused(layer, key[1])
        return plan

    def _measure(self, layer: SparseLinear, trains: bool, x2: Tensor) -> tuple[str, str, str]:
        """Each choice ranked by its GPU time plus the host time it takes to issue above the lightest candidate's
        (:func:`hf_sparse.ops.dispatch.fastest` with ``host_too``): a layer's call is often host-bound (BERT-large's
        1024-wide layers on a slow host), and a choice with more launches (the GEMM weight gradient and its gather, a
        dense weight made for the call) must save that much GPU time to win."""
        fuse = not trains  # in training the activation runs after the layer (see __call__)

        def forward(choice):
            return lambda: self.forward_compute(layer, x2, (choice,), fuse)

        def backward(input_grad, weight_grad):
            return lambda: self.backward_compute(
                layer, dy2, x2, (None, input_grad, weight_grad), input_grad is not None, weight_grad is not None, False
            )

        forwards = {"sparse": forward("sparse"), "dense": forward("dense")}
        if self.m != 4 and (self.packed24 is not None or (not trains and self._view_from_pack())):
            forwards["sparse24"] = forward("sparse24")
        with torch.no_grad():
            parts = [dispatch.costs(forwards, host_too=True)]
            if trains:
                dy2 = torch.randn(x2.shape[0], self.rows, dtype=self.dtype, device=x2.device)
                inputs = {"dense": backward("dense", None)}
                if self.packed_t is not None:
                    inputs["sparse"] = backward("sparse", None)
                parts.append(dispatch.costs(inputs, host_too=True))
                parts.append(
                    dispatch.costs({"gemm": backward(None, "gemm"), "sddmm": backward(None, "sddmm")}, host_too=True)
                )
        plan = tuple(min(part, key=part.get) for part in parts) + DEFAULT_PLAN[len(parts) :]
        if trains:
            saving = self._saving_over_masked_dense(layer, plan, x2, dy2)
            if saving is not None:
                self.savings[(token_bucket(x2.shape[0]), trains)] = saving
        return plan

    def _saving_over_masked_dense(self, layer: SparseLinear, plan: tuple, x2: Tensor, dy2: Tensor) -> float | None:
        """What one training call by ``plan`` surely saves against the masked dense layer it replaced, in ms
        (:func:`sure_saving_ms` of one :func:`hf_sparse.ops.dispatch.measure` over both): that layer casts its fp32
        weight for autocast, runs the forward and both gradient GEMMs on the cast, casts the weight gradient back to
        fp32 and has the pruner mask it. The compact layer's own dense choices are no stand-in: they rebuild the
        weight from the kept values, a launch the masked dense layer does not pay. The bias gradient and the input's
        cast are the same for both and left out. None, unmeasured, where the measurement's transients (16 bytes per
        weight: the fp32 weight and gradient, their bf16 forms, the mask, the kept index) would not fit in the memory
        the device and the caching allocator have free: a run near its memory limit must not fail in its first step
        for a measurement (the compact fallback then decides by timing, where the dense state fits)."""
        rows, cols, dtype = self.rows, self.cols, self.dtype
        if dispatch.spare_bytes(self.device) < 16 * rows * cols:
            return None
        bias_c = self.bias_lp if self.bias_lp is not None else layer.bias
        master = dense_at_index(layer.weight.detach(), layer._kept(), rows, cols, torch.float32)
        pruned = ~layer.mask()

        def masked_dense():
            w = master.to(dtype)
            F.linear(x2, w, bias_c)
            torch.mm(dy2, w)
            torch.mm(dy2.t(), x2).float().masked_fill_(pruned, 0.0)

        def compact():
            self.forward_compute(layer, x2, plan, False)
            self.backward_compute(layer, dy2, x2, plan, True, True, False)

        measured = dispatch.measure({"masked dense": masked_dense, "compact": compact})
        return sure_saving_ms(measured["masked dense"], measured["compact"])

    # ------------------------------------------------------------------ compute
    def forward_compute(self, layer: SparseLinear, x2: Tensor, plan: tuple, fuse: bool) -> Tensor:
        """``x2 W^T + b`` by ``plan[0]`` (``x2``: 2-D, in the compute dtype). ``fuse``: an inference call (the layer's
        activation fused, on the packs it holds); else a training call (the activation runs after the layer,
        differentiated by autograd; the pack made in the call). No autograd."""
        rows, cols, dtype = self.rows, self.cols, self.dtype
        bias_c = self.bias_lp if self.bias_lp is not None else layer.bias
        act = self.activation if fuse else None
        if fuse and plan[0] == "sparse24" and self._view_from_pack():  # the view made and used in one extension call
            call = self._resident_call("sparse24")
            if call is not None and x2.is_contiguous() and x2.data_ptr() % 16 == 0:
                fn, before, after = call
                return fn(x2, *before, bias_c, *after)
        values, q = self._source(layer, plan[0], trains=not fuse)
        if self.native_forward is not None and act is None:  # one call into the extension
            view = plan[0] == "sparse24"
            sel, sel_columns, v_g = positions(layer, self.layout)
            return self.native_forward(
                x2, layer.weight.detach(), bias_c, values, q.meta, q.columns, sel, sel_columns, rows, cols,
                4 if view else self.m, v_g, self.m, int(plan[0] != "dense"),
                self.kernel_bits24 if view else self.kernel_bits,
            )  # fmt: skip
        if plan[0] == "dense":
            y = F.linear(x2, dense_at_index(layer.weight.detach(), layer._kept(), rows, cols, dtype), bias_c)
            return y if act is None else activate(y, act)
        if values.numel() == 0:  # made in the call
            q = self._made(layer, VIEW24 if plan[0] == "sparse24" else PACK)
            values = q.values
        if plan[0] == "sparse24":  # the 2:4 view
            fn, code, after, v, m = self.fn24, self.code24, self.after24, 64, 4
        else:
            fn, code, after, v, m = self.fns[0], self.code, self.after, self.v, self.m
        if not fuse:
            code, after = 0, None
        return _spmm(x2, values, q.meta, q.columns, q.valid, bias_c, rows, cols, v, m, fn, code, after, act)

    def backward_compute(
        self, layer: SparseLinear, dy2: Tensor, x2: Tensor, plan: tuple, need_dx: bool, need_dw: bool, need_db: bool
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dx2, dweight, dbias)`` of ``x2 W^T + b`` for the output gradient ``dy2`` (2-D), by ``plan[1]`` and
        ``plan[2]``; ``dx2`` in the compute dtype, ``dweight`` the gradient of the kept values in ``weight``'s order
        and dtype. No autograd."""
        rows, cols, dtype = self.rows, self.cols, self.dtype
        weight = layer.weight.detach()
        if self.native_backward is not None:  # one call into the extension
            t, p = self.packed_t, self.packed
            sparse_dx, sddmm = plan[1] == "sparse" and t is not None, plan[2] == "sddmm"
            sel, sel_columns, v_g = positions(layer, self.layout)
            dx, dw, db = self.native_backward(
                dy2, x2, weight, sel, sel_columns, *((None,) * 3 if t is None else t[:3]), p.meta, p.columns, rows,
                cols, v_g, self.m, sparse_dx << 1 | sddmm << 2, self.kernel_bits, need_dx, need_dw, need_db,
                torch.float32 if layer.bias is None else layer.bias.dtype,
            )  # fmt: skip
            return dx, dw, db
        dy2 = dy2.to(dtype).contiguous()
        dx = dw = db = None
        if need_dx:
            if plan[1] == "sparse" and self.packed_t is not None:
                t = self._made(layer, TRANSPOSED)
                dx = _spmm(
                    dy2, t.values, t.meta, t.columns, t.valid, None, cols, rows, 64, 4, self.fns[1], 0, None, None
                )
            else:
                dx = torch.mm(dy2, dense_at_index(weight, layer._kept(), rows, cols, dtype))
        if need_dw:
            p = self.packed
            index = layer._kept() if plan[2] == "gemm" else None
            dw = _weight_grad(
                plan[2], dy2, x2, weight, index, p.values, p.meta, p.columns, p.valid, rows, cols, self.v, self.m,
                self.fns[2],
            )  # fmt: skip
        if need_db:
            db = dy2.sum(0, dtype=torch.float32).to(layer.bias.dtype)
        return dx, dw, db

    def native_arguments(self, layer: SparseLinear, plan: tuple, trains: bool) -> tuple:
        """The arguments after ``x, weight, bias`` of the extension's ``compact_linear`` (eager training) and of the
        ``hf_sparse::compact_linear`` op (torch.compile) for ``plan`` in a call that ``trains`` or not: the bias in
        the compute dtype, the forward's pack (the 2:4 view for ``"sparse24"``; its values made in the call where
        they have no elements), the transposed pack (its values made in the backward; or Nones), the layer's own
        metadata and columns (the SDDMM's), the kept positions in their on-disk form (:func:`positions`: what the
        dense choices and the packs made in the call read), the sizes, the group size of the forward's pack, the
        layer's V and group size, the plan and kernel bits."""
        p, t = self.packed, self.packed_t
        view = plan[0] == "sparse24"
        values, q = self._source(layer, plan[0], trains)
        sel, sel_columns, v_g = positions(layer, self.layout)
        return (
            self.bias_lp if self.bias_lp is not None else layer.bias,
            values,
            q.meta,
            q.columns,
            None if t is None else self.per_call,  # the transposed pack's values are made in the backward
            None if t is None else t.meta,
            None if t is None else t.columns,
            p.meta,
            p.columns,
            sel,
            sel_columns,
            self.rows,
            self.cols,
            4 if view else self.m,
            v_g,
            self.m,
            _PLAN_BITS[plan],
            self.kernel_bits24 if view else self.kernel_bits,
        )

    def training_saving_ms(self) -> float | None:
        """What one training call of this layer surely saves against the masked dense layer it replaced, as measured when
        its plans were made (:meth:`_saving_over_masked_dense`), in ms, averaged over the token buckets measured;
        None where no training plan was measured (CPU, CUDA-graph capture)."""
        saved = [value for (_, trains), value in self.savings.items() if trains]
        return sum(saved) / len(saved) if saved else None

    def uses_index(self) -> bool:
        """Whether a measured plan reads the kept index: a dense forward or input gradient, or the GEMM weight
        gradient, computed by torch ops (where the extension is absent; the extension reads the positions in their
        on-disk form instead)."""
        return self.native is None and any(
            p[0] == "dense" or (trains and (p[1] == "dense" or p[2] == "gemm"))
            for (_, trains), p in self.plans.items()
        )

    def _set_kernel_bits(self) -> None:
        """The ``kernels`` bits of ``compact_linear`` for a forward on the layer's own pack and on its 2:4 view."""
        self.kernel_bits = _kernel_bits(self.fns)
        self.kernel_bits24 = _kernel_bits((self.fn24, *self.fns[1:]))

    # ------------------------------------------------------------------ the forward
    def prepare(
        self, layer: SparseLinear, x: Tensor, trains: bool, while_tracing: bool = False
    ) -> tuple[str, str, str]:
        """Bring the packs up to date with the values and return the plan for ``x`` (measured on the first call of
        its token bucket; ``while_tracing``: see :meth:`plan`)."""
        key = (token_bucket(x.numel() // self.cols), trains)
        plan = self.plans.get(key)
        if while_tracing and not self.traced:  # compiled code makes the 2:4 view from the values (native_arguments)
            self.traced = True
            if self.m != 4 and any(p[0] == "sparse24" for p in self.plans.values()):
                layer.on_disk_form()  # the view's metadata is made from the positions
                self._ensure_view24(layer)
        if layer._resident is self:  # the pack is the values: nothing to refresh
            self.check_resident(layer)
            if plan is not None and not trains:
                return plan
            layer.on_disk_form()  # training, or a measurement, reads the values in the on-disk form
        if trains:
            if not self.trained:
                self._ensure_transposed(layer)
            self._free_pack()  # a call that trains makes its packs; an earlier evaluation may have left one
        if _stamp(layer.weight, layer.bias) != self.stamp:
            self.refresh(layer)
        if plan is None:
            x2 = x.reshape(-1, self.cols)
            plan = self.plan(layer, key, x2 if x2.dtype == self.dtype else x2.to(self.dtype), while_tracing)
        elif self.buf is None and self._holds_pack(plan, trains):
            self._ensure_pack(layer)  # inference after a call that trained
        return plan

    def __call__(self, layer: SparseLinear, x: Tensor) -> Tensor:
        """The layer's eager forward (see the module docstring; under torch.compile :func:`compact_linear` runs)."""
        weight, bias = layer.weight, layer.bias
        trains = torch.is_grad_enabled() and (
            weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
        )
        plan = self.prepare(layer, x, trains)
        rows, cols = self.rows, self.cols
        if not trains:  # inference, evaluation: no autograd, the activation fused where the kernel has it
            if layer._resident is not self and plan[0] != "dense" and torch.is_inference_mode_enabled():
                self.adopt(layer)
            x2 = x.reshape(-1, cols)
            y = self.forward_compute(layer, x2 if x2.dtype == self.dtype else x2.to(self.dtype), plan, fuse=True)
            return y.view(*x.shape[:-1], rows)
        if self.native is not None:  # eager CUDA training: one C++ autograd node
            y = self.native(x, weight, bias, *self.native_arguments(layer, plan, True))
        else:
            x2 = x.reshape(-1, cols)
            x2 = x2 if x2.dtype == self.dtype else x2.to(self.dtype)
            y = _CompactLinearFn.apply(x2, weight, bias, self, layer, plan).view(*x.shape[:-1], rows)
        return y if self.activation is None else activate(y, self.activation)


#: a plan (forward, input gradient, weight gradient) as the ``plan`` bits of the extension's ``compact_linear``
_PLAN_BITS = {
    (f, i, w): (f != "dense") | (i == "sparse") << 1 | (w == "sddmm") << 2
    for f in ("sparse", "sparse24", "dense")
    for i in ("sparse", "dense")
    for w in ("gemm", "sddmm")
}


def sure_saving_ms(dense: tuple[float, float], compact: tuple[float, float]) -> float:
    """What the compact layer surely saves per training call, from ``(GPU ms, host ms)`` of the masked dense layer's
    work and of the compact layer's: the GPU time it saves, less any host time it adds. Host time it saves is not
    counted: a training step is host-bound only in places (BERT-large's forward on a slow host, while its backward
    and Trainer's synchronisation after it wait for the GPU), so a layer's lighter host side may buy nothing. The
    compact fallback skips timing the masked dense layers only on this sure part (:mod:`hf_sparse.compact_fallback`)."""
    return dense[0] - compact[0] + min(0.0, dense[1] - compact[1])


def _kernel_bits(fns: tuple) -> int:
    """The ``kernels`` bits of ``compact_linear``: which of the forward SpMM, the transposed SpMM and the SDDMM
    are the sparse-wgmma variants (the functions :func:`spmm_function` / :func:`sddmm_function` picked)."""
    names = [getattr(fn, "__name__", "") for fn in fns]
    return (names[0] == "spmm_wgmma") | (names[1] == "spmm_wgmma") << 1 | (names[2] == "sddmm_wgmma") << 2


def _extension():
    """The loaded extension, or None where it cannot load."""
    from ..ops._build import KernelUnavailableError, load_extension

    try:
        return load_extension()
    except KernelUnavailableError:
        return None


_kernels: weakref.WeakSet[CompactKernel] = weakref.WeakSet()  # every live kernel: what refresh_stale looks through


def refresh_stale(device: torch.device) -> None:
    """Refresh the packs of every compact layer on ``device`` whose values changed since its last refresh, in one
    launch of the extension (:func:`hf_sparse.nn.refresh.launch_refresh`); the hook after each optimizer step calls
    it, so one launch per step serves the whole model. A layer whose weight is an FSDP2 shard (a ``DTensor``, between
    the layer's forwards) is left for its own next call, when FSDP2 has gathered the whole weight."""
    groups, stale, ext = [], [], None
    steps = optimizer_steps()
    for k in list(_kernels):  # once per optimizer step over every layer: attribute reads kept to what decides
        if k.device != device or k.refresher is None:
            continue
        layer = k.layer()
        if layer is None or layer._kernel is not k or layer._resident is k:  # resident: its pack is its values
            continue
        params = layer._parameters  # the layer itself (a weakref to it, never a DataParallel replica): read directly
        weight, bias = params["weight"], params.get("bias")
        if is_sharded(weight):  # FSDP2 between its forwards: a shard; refreshed at the layer's own next call
            continue
        stamp = _stamp(weight, bias, steps)
        if stamp == k.stamp:
            continue
        entries = k.refresh_entries(layer)
        if entries:
            groups.append((k.entries[2], entries))
        stale.append((k, stamp))
        ext = k.refresher
    if groups:
        with torch.no_grad():
            launch_refresh(ext, groups, device)
    for k, stamp in stale:
        k.stamp = stamp


def _stamp(weight: Tensor, bias: Tensor | None, steps: int | None = None) -> tuple:
    """What the packs were made from: the weight's version and address, the bias's version, the optimizer steps
    (``steps``: :func:`optimizer_steps`, read once by a caller that stamps every layer)."""
    return (weight._version, weight.data_ptr(), None if bias is None else bias._version,
            optimizer_steps() if steps is None else steps)  # fmt: skip


def refresh_all() -> None:
    """Refresh the packs of every stale compact layer, one launch per device (after each optimizer step: see
    :func:`hf_sparse.nn.optimizer_steps.after_optimizer_step`)."""
    devices = {k.device for k in list(_kernels) if k.refresher is not None}
    for device in devices:
        refresh_stale(device)


after_optimizer_step(refresh_all)
