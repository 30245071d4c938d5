"""The kernel state of a compact :class:`~hf_sparse.nn.SparseLinear` and the autograd function that runs on it.

A compact layer's Parameter ``weight`` holds only its kept values, in the on-disk order ``(R, 2G)`` (``G = K/M``
groups per row, 2 kept per group). On CUDA in bf16/fp16 with a pattern the kernels run (2:4, V:2:M) it computes
through one :class:`CompactKernel`, built once from the layer's position buffers (on first use, again after
``.to()``) and owned by the layer alone:

* ``packed``: the values in the kernels' fragment order (:mod:`hf_sparse.ops._layout`), with the metadata and block
  columns made once from the positions. The fragment order is a permutation of the dimensions of the zero-padded
  logical values, so a refresh is one strided copy of ``weight`` into the pack, the cast to the compute dtype
  included (up to six copies when R is not a multiple of 16 or G of 8). The padding is zeroed once and never written;
  no index is kept for it.
* ``packed_t`` (2:4 layers whose mask is transposable: every 4x4 block keeps 2 per row and 2 per column, so ``W^T``
  is 2:4 too): ``W^T`` packed as 2:4, for the input gradient ``dX = dY W`` as an SpMM. Its values are a fixed
  permutation of the forward pack's, ``perm_t`` (int32): one ``index_select`` per refresh. Built on the first call
  that trains; dropped again if the measured plans never use it.
* the plans, per (token bucket, whether the call trains): the forward (``"sparse"``: SpMM; ``"dense"``: cuBLAS on a
  transient dense weight made by one scatter at the kept index), the input gradient (``"sparse"`` on ``packed_t``,
  else ``"dense"``), the weight gradient (``"gemm"``: ``dY^T X`` by cuBLAS, then one gather at the kept index, then
  the cast to the weight's dtype; ``"sddmm"``: the kept positions only, by the SDDMM kernel, straight into
  ``weight``'s order in fp32). Each is measured once per bucket with :func:`hf_sparse.ops.dispatch.fastest` on the
  call's own input; where nothing can be measured (CPU, torch.compile tracing, CUDA-graph capture) the plan is
  :data:`DEFAULT_PLAN`.

The packs are refreshed on the first call after the weight changed: when its version counter, its address, the
bias's version or the count of optimizer steps (:mod:`.optimizer_steps`: fused optimizers do not bump versions)
differ from the last refresh. Under torch.compile the packs are computed inside the graph on every call instead (the
same copy and gather: Inductor fuses them), with no Python state read but the plans.

Per call, eager: one tuple compare (the refresh check), one plan lookup, a 2-D reshape of the input each way and the
kernel call; backward runs in :class:`_CompactLinearFn` on the saved tensors with no lookups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ..formats.bitpack import unpack_bits
from ..ops import dispatch
from ..ops._layout import logical_from_dense, packed_from_logical, values_to_kernel
from ..ops.sddmm import sddmm_function
from ..ops.spmm import activate, kernel_activation, spmm_function
from ..patterns import NM
from .optimizer_steps import optimizer_steps, watch_optimizer_steps

if TYPE_CHECKING:
    from .sparse_linear import SparseLinear

__all__ = ["DEFAULT_PLAN", "CompactKernel"]

# (forward, input gradient, weight gradient) where nothing was measured; the input gradient runs "sparse" where the
# layer has a transposed pack
DEFAULT_PLAN = ("sparse", "dense", "gemm")


def _pieces(rows: int, groups: int) -> list[tuple[tuple, int, int, tuple, int, int, tuple]]:
    """How the logical ``(rows, groups, 2)`` values map onto the pack seen as ``(mt, rh, g8, s, ch, t, 2)`` (row
    ``16 mt + 8 rh + g8``, group ``8 s + 4 ch + t``): ``(pack index, r0, r1, row split, g0, g1, group split)`` per
    block of rows and groups that is a strided slice of both; one block when ``rows % 16 == 0`` and ``groups % 8 ==
    0``."""
    row_parts = []
    full = rows // 16
    if full:
        row_parts.append(((slice(0, full), slice(None)), 0, 16 * full, (full, 2, 8)))
    if rows % 16:  # rows are a multiple of 8: the last 8 fill one half of a 16-row tile
        row_parts.append(((slice(full, full + 1), slice(0, 1)), 16 * full, rows, (1, 1, 8)))
    group_parts = []
    steps = groups // 8
    if steps:
        group_parts.append(((slice(0, steps), slice(None), slice(None)), 0, 8 * steps, (steps, 2, 4)))
    rest, g0 = groups % 8, 8 * steps
    if rest >= 4:
        group_parts.append(((slice(steps, steps + 1), slice(0, 1), slice(None)), g0, g0 + 4, (1, 1, 4)))
        g0 += 4
    if rest % 4:
        ch = int(rest >= 4)
        group_parts.append(
            ((slice(steps, steps + 1), slice(ch, ch + 1), slice(0, rest % 4)), g0, groups, (1, 1, rest % 4))
        )
    pieces = []
    for (mt, rh), r0, r1, rsplit in row_parts:
        for (s, ch, t), a, b, gsplit in group_parts:
            pieces.append(((mt, rh, slice(None), s, ch, t, slice(None)), r0, r1, rsplit, a, b, gsplit))
    return pieces


def _logical_view(values: Tensor) -> Tensor:
    """The fragment-ordered pack ``(Rp/16, S, 32, 8)`` seen as ``(mt, rh, g8, s, ch, t, 2)`` (a view)."""
    tiles, steps = values.shape[:2]
    return values.view(tiles, steps, 8, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 3, 6)


def _fill(values: Tensor, weight: Tensor, pieces: list, groups: int) -> None:
    """Write ``weight`` (R, 2G) into the pack ``values``, cast to its dtype; the padding is left as it is."""
    view = _logical_view(values)
    w3 = weight.view(weight.shape[0], groups, 2)
    for index, r0, r1, rsplit, g0, g1, gsplit in pieces:
        view[index].copy_(w3[r0:r1, g0:g1].view(*rsplit, *gsplit, 2))


def _positions(layer: SparseLinear) -> tuple[Tensor | None, Tensor]:
    """``(columns, selectors)`` of the logical kernel form, from the layer's position buffers."""
    groups = layer.in_features // layer._kernel_vm[1]
    if isinstance(layer.pattern, NM):  # 2:4: the in-group offsets are the selectors
        return None, unpack_bits(layer.weight_indices, 2, 2 * groups).reshape(layer.out_features, groups, 2)
    selectors = unpack_bits(layer.weight_selectors, 2, 2 * groups).reshape(layer.out_features, groups, 2)
    return layer.weight_columns, selectors


def _spmm(x2, values, meta, columns, valid, bias, rows, cols, v, m, fn, code, after, activation) -> Tensor:
    """``act(x2 @ W^T + bias)``: the extension's function ``fn`` where it can take ``x2`` as it is, else the
    ``hf_sparse::spmm`` op (torch.compile, CPU, misaligned input)."""
    if fn is not None and x2.is_contiguous() and x2.data_ptr() % 16 == 0:
        y = fn(x2, values, meta, columns, bias, rows, cols, m, code)
        return y if after is None else activate(y, after)
    y = torch.ops.hf_sparse.spmm(x2.contiguous(), values, meta, columns, valid, bias, rows, cols, v, m)
    return y if activation is None else activate(y, activation)


def _dense(weight: Tensor, index: Tensor, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    """A transient dense ``(rows, cols)`` weight in ``dtype``: zeros, then one scatter of the kept values."""
    dense = torch.zeros(rows * cols, dtype=dtype, device=weight.device)
    return dense.index_put_((index,), weight.reshape(-1).to(dtype)).view(rows, cols)


def _sddmm(dy2, x2, values, meta, columns, valid, rows, cols, v, m, fn) -> Tensor:
    if fn is not None and dy2.data_ptr() % 16 == 0 and x2.data_ptr() % 16 == 0:
        return fn(dy2, x2, meta, columns, rows, cols, m)
    return torch.ops.hf_sparse.sddmm(dy2, x2, values, meta, columns, valid, rows, cols, v, m)


def _weight_grad(choice, dy2, x2, weight, index, values, meta, columns, valid, rows, cols, v, m, fn) -> Tensor:
    """The gradient of the kept values, in ``weight``'s order and dtype."""
    if choice == "sddmm":
        g = _sddmm(dy2, x2, values, meta, columns, valid, rows, cols, v, m, fn)
    else:
        g = torch.mm(dy2.t(), x2).view(-1).index_select(0, index).view(weight.shape)
    return g if g.dtype == weight.dtype else g.to(weight.dtype)


class _CompactLinearFn(torch.autograd.Function):
    """``y = act(x W^T + b)`` with ``W`` given by its kept values ``weight`` and the packs made from them; the
    gradient of ``weight`` is that of the kept values only. ``spec``: (rows, cols, v, m, compute dtype, plan,
    (spmm function, transposed spmm function, sddmm function), fused activation code, activation after the kernel,
    activation), the functions None where the ops must be used."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, bias_c, values, meta, columns, valid, values_t, meta_t, columns_t, valid_t, index, spec
    ):
        rows, cols, v, m, dtype, plan, fns, code, after, activation = spec
        x2 = x.reshape(-1, cols)
        if x2.dtype != dtype:
            x2 = x2.to(dtype)
        if plan[0] == "sparse":
            y = _spmm(x2, values, meta, columns, valid, bias_c, rows, cols, v, m, fns[0], code, after, activation)
        else:
            y = F.linear(x2, _dense(weight, index, rows, cols, dtype), bias_c)
            if activation is not None:
                y = activate(y, activation)
        ctx.save_for_backward(x2, weight, index, values, meta, columns, valid, values_t, meta_t, columns_t, valid_t)
        ctx.spec = spec
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], rows)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, index, values, meta, columns, valid, values_t, meta_t, columns_t, valid_t = ctx.saved_tensors
        rows, cols, v, m, dtype, plan, fns, _, _, _ = ctx.spec
        dy2 = dy.reshape(-1, rows)
        if dy2.dtype != dtype:
            dy2 = dy2.to(dtype)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if plan[1] == "sparse":
                dx = _spmm(dy2, values_t, meta_t, columns_t, valid_t, None, cols, rows, 64, 4, fns[1], 0, None, None)
            else:
                dx = torch.mm(dy2, _dense(weight, index, rows, cols, dtype))
            if dx.dtype != ctx.x_dtype:
                dx = dx.to(ctx.x_dtype)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(plan[2], dy2, x2, weight, index, values, meta, columns, valid, rows, cols, v, m, fns[2])
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32)
            if db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None


class CompactKernel:
    """What one compact layer computes on in compute dtype ``dtype`` (see the module docstring). Built from the
    layer's position buffers and current values; :meth:`__call__` is the layer's forward."""

    def __init__(self, layer: SparseLinear, dtype: torch.dtype) -> None:
        v, m = layer._kernel_vm
        rows, cols = layer.logical_shape
        weight = layer.weight.detach()
        device = weight.device
        self.dtype, self.rows, self.cols, self.v, self.m = dtype, rows, cols, v, m
        self.groups = cols // m
        self.activation = layer.activation
        columns, selectors = _positions(layer)
        base = packed_from_logical(weight, columns, selectors, v, m, dtype)  # metadata and block columns
        n = base.values.numel()
        self.buf = torch.zeros(n + 1, dtype=dtype, device=device)  # the pack, then a zero: perm_t's padding source
        valid = torch.ones((), dtype=torch.bool, device=device).expand(rows, 2 * self.groups)  # every slot is kept
        self.packed = base._replace(values=self.buf[:n].view(base.values.shape), valid=valid)
        self.pieces = _pieces(rows, self.groups)
        self.transposable: bool | None = None  # decided on the first call that trains
        self.packed_t = None
        self.perm_t: Tensor | None = None
        bias = layer.bias
        self.bias_lp = None if bias is None or bias.dtype == dtype else bias.detach().to(dtype)
        self.plans: dict[tuple[int, bool], tuple[str, str, str]] = {}
        self.stamp: tuple | None = None
        cuda = device.type == "cuda"
        self.fns = (spmm_function(m, device), None, sddmm_function(m, device)) if cuda else (None, None, None)
        self.code, self.after = kernel_activation(self.activation, m, device) if cuda else (0, self.activation)
        watch_optimizer_steps()
        self.refresh(layer.weight, bias)

    # ------------------------------------------------------------------ packs
    def refresh(self, weight: Tensor, bias: Tensor | None) -> None:
        """Rebuild the packs (and the bias cast) from the current values: a strided copy, one gather, a copy."""
        with torch.no_grad():
            _fill(self.packed.values, weight.detach(), self.pieces, self.groups)
            if self.perm_t is not None:
                torch.index_select(self.buf, 0, self.perm_t, out=self.packed_t.values.view(-1))
            if self.bias_lp is not None:
                self.bias_lp.copy_(bias.detach())
        self.stamp = _stamp(weight, bias)

    def _functional_packs(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The packs and the bias cast made afresh from ``weight``, without touching the kernel state (the
        torch.compile path: Inductor fuses them into the graph)."""
        buf = torch.zeros_like(self.buf)
        values = buf[: self.buf.numel() - 1].view(self.packed.values.shape)
        _fill(values, weight, self.pieces, self.groups)
        values_t = None
        if self.perm_t is not None:
            values_t = torch.index_select(buf, 0, self.perm_t).view(self.packed_t.values.shape)
        bias_c = bias if bias is None or bias.dtype == self.dtype else bias.to(self.dtype)
        return values, values_t, bias_c

    @torch.compiler.disable  # once per layer, on its first call that trains
    def _ensure_transposed(self, layer: SparseLinear) -> None:
        """Decide transposability (once) and build ``packed_t`` / ``perm_t`` where the mask is transposable 2:4."""
        if self.transposable is not None:
            return
        self.transposable = False
        if self.m != 4:
            return
        rows, cols, dev = self.rows, self.cols, self.buf.device
        n, nnz = self.buf.numel() - 1, rows * 2 * self.groups
        with torch.no_grad():
            # the forward-pack position of every kept value (values_to_kernel of 1..nnz; 0 there is padding)
            order = values_to_kernel(torch.arange(1, nnz + 1, device=dev).view(rows, -1), torch.int64).view(-1)
            at = torch.nonzero(order).squeeze(1)
            pack_pos = torch.empty(nnz, dtype=torch.int64, device=dev)
            pack_pos[order[at] - 1] = at
            flat = layer._kept().long()
            where = torch.full((rows * cols,), n, dtype=torch.int64, device=dev)  # n: the zero after the pack
            where[flat] = pack_pos
            mask = torch.zeros(rows * cols, dtype=torch.bool, device=dev)
            mask[flat] = True
            mask_t = mask.view(rows, cols).t()
            if not bool((mask_t.reshape(cols, rows // 4, 4).sum(-1) == 2).all()):
                return
            index_t, _, selectors_t, _ = logical_from_dense(where.view(rows, cols).t(), mask_t, 64, 4)
            perm_t = values_to_kernel(index_t + 1, torch.int64).view(-1) - 1  # -1: the transposed pack's padding
            perm_t = torch.where(perm_t < 0, n, perm_t)
            self.perm_t = perm_t.to(torch.int32 if n < 2**31 else torch.int64)
            values_t = torch.zeros(cols, rows // 2, dtype=self.dtype, device=dev)
            base = packed_from_logical(values_t, None, selectors_t, 64, 4, self.dtype)
            valid_t = torch.ones((), dtype=torch.bool, device=dev).expand(cols, rows // 2)
            self.packed_t = base._replace(valid=valid_t)
            torch.index_select(self.buf, 0, self.perm_t, out=self.packed_t.values.view(-1))
        if self.fns[0] is not None:
            self.fns = (self.fns[0], spmm_function(4, dev), self.fns[2])
        self.transposable = True

    def drop_transposed(self) -> None:
        """Free ``packed_t`` and ``perm_t`` (no measured plan runs the input gradient on them)."""
        self.packed_t = self.perm_t = None

    # ------------------------------------------------------------------ plans
    def plan(self, layer: SparseLinear, key: tuple[int, bool], x2: Tensor, bias_c: Tensor | None) -> tuple:
        """The plan for ``key`` ((token bucket, trains)): measured once on ``x2`` (in the compute dtype) where a
        measurement can run, else :data:`DEFAULT_PLAN` (stored, except while torch.compile traces)."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        default = (DEFAULT_PLAN[0], "sparse" if self.packed_t is not None else "dense", DEFAULT_PLAN[2])
        if not (x2.is_cuda and dispatch.can_measure()):
            if not torch.compiler.is_compiling():
                self.plans[key] = default
            return default
        plan = self._measure(layer, key[1], x2, bias_c)
        self.plans[key] = plan
        if not self.uses_index():
            layer._index = None  # built for the measurement only
        if key[1] and self.packed_t is not None and all(p[1] != "sparse" for k, p in self.plans.items() if k[1]):
            self.drop_transposed()
        return plan

    def _measure(self, layer: SparseLinear, trains: bool, x2: Tensor, bias_c: Tensor | None) -> tuple[str, str, str]:
        rows, cols, v, m, dtype = self.rows, self.cols, self.v, self.m, self.dtype
        p, fns, weight = self.packed, self.fns, layer.weight.detach()
        index = layer._kept()
        act = self.activation

        def sparse():
            return _spmm(
                x2, p.values, p.meta, p.columns, p.valid, bias_c, rows, cols, v, m, fns[0], self.code, self.after, act
            )

        def dense():
            y = F.linear(x2, _dense(weight, index, rows, cols, dtype), bias_c)
            return y if act is None else activate(y, act)

        with torch.no_grad():
            forward = dispatch.fastest({"sparse": sparse, "dense": dense}, host_too=not trains)
            if not trains:
                return forward, "dense", DEFAULT_PLAN[2]
            dy2 = torch.randn(x2.shape[0], rows, dtype=dtype, device=x2.device)
            inputs = {"dense": lambda: torch.mm(dy2, _dense(weight, index, rows, cols, dtype))}
            t = self.packed_t
            if t is not None:
                inputs["sparse"] = lambda: _spmm(
                    dy2, t.values, t.meta, t.columns, t.valid, None, cols, rows, 64, 4, fns[1], 0, None, None
                )
            input_grad = dispatch.fastest(inputs) if len(inputs) > 1 else "dense"

            def grad(choice):
                return lambda: _weight_grad(
                    choice, dy2, x2, weight, index, p.values, p.meta, p.columns, p.valid, rows, cols, v, m, fns[2]
                )

            weight_grad = dispatch.fastest({"gemm": grad("gemm"), "sddmm": grad("sddmm")})
        return forward, input_grad, weight_grad

    def uses_index(self) -> bool:
        """Whether a measured plan reads the kept index (a dense forward or input gradient, the GEMM weight
        gradient)."""
        return any(
            p[0] == "dense" or (trains and (p[1] == "dense" or p[2] == "gemm"))
            for (_, trains), p in self.plans.items()
        )

    # ------------------------------------------------------------------ the forward
    def __call__(self, layer: SparseLinear, x: Tensor) -> Tensor:
        weight, bias = layer.weight, layer.bias
        trains = torch.is_grad_enabled() and (
            weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if trains and self.transposable is None:
            self._ensure_transposed(layer)
        if torch.compiler.is_compiling():  # the ops, and packs made inside the graph
            fns = (None, None, None)
            values, values_t, bias_c = self._functional_packs(weight, bias)
        else:
            fns = self.fns
            if _stamp(weight, bias) != self.stamp:
                self.refresh(weight, bias)
            values = self.packed.values
            values_t = None if self.packed_t is None else self.packed_t.values
            bias_c = self.bias_lp if self.bias_lp is not None else bias
        dtype, rows, cols = self.dtype, self.rows, self.cols
        tokens = x.numel() // cols
        key = (1 << max(0, tokens - 1).bit_length(), trains)
        plan = self.plans.get(key)
        if plan is None:
            x2 = x.reshape(-1, cols)
            plan = self.plan(layer, key, x2 if x2.dtype == dtype else x2.to(dtype), bias_c)
        p, t = self.packed, self.packed_t
        index = layer._kept() if plan[0] == "dense" or (trains and (plan[1] == "dense" or plan[2] == "gemm")) else None
        if not trains:  # inference, evaluation: no autograd function
            x2 = x.reshape(-1, cols)
            if x2.dtype != dtype:
                x2 = x2.to(dtype)
            if plan[0] == "sparse":
                y = _spmm(
                    x2,
                    values,
                    p.meta,
                    p.columns,
                    p.valid,
                    bias_c,
                    rows,
                    cols,
                    self.v,
                    self.m,
                    fns[0],
                    self.code,
                    self.after,
                    self.activation,
                )
            else:
                y = F.linear(x2, _dense(weight, index, rows, cols, dtype), bias_c)
                if self.activation is not None:
                    y = activate(y, self.activation)
            return y.view(*x.shape[:-1], rows)
        spec = (rows, cols, self.v, self.m, dtype, plan, fns, self.code, self.after, self.activation)
        return _CompactLinearFn.apply(
            x,
            weight,
            bias,
            bias_c,
            values,
            p.meta,
            p.columns,
            p.valid,
            values_t,
            None if t is None else t.meta,
            None if t is None else t.columns,
            None if t is None else t.valid,
            index,
            spec,
        )


def _stamp(weight: Tensor, bias: Tensor | None) -> tuple:
    """What the packs were made from: the weight's version and address, the bias's version, the optimizer steps."""
    return (weight._version, weight.data_ptr(), None if bias is None else bias._version, optimizer_steps())
