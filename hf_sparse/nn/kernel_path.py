"""Run pruned ``nn.Linear`` / GPT-2 ``Conv1D`` layers on the Sparse Tensor Core kernels once their masks are final.

:func:`enable_kernel_path` swaps the ``forward`` of each kernel-ready layer a :class:`~hf_sparse.pruner.Pruner`
owns for one that calls :func:`~hf_sparse.nn.sparse_matmul.sparse_linear`. Nothing else about the module changes:
the dense masked master ``weight`` stays the same Parameter (the optimizer's, DDP's, the checkpoint's), no
parameter, buffer or state-dict key is added, and :func:`disable_kernel_path` restores the class's own forward.

Per layer, the kernel path keeps low-precision shadows of the master, rebuilt lazily on the first forward after the
master's version changes or any ``torch.optim`` optimizer steps (i.e. once per optimizer step, whatever the gradient
accumulation; fused optimizers such as ``AdamW(fused=True)`` write the parameters without bumping their version
counter, so the step itself is counted through a global optimizer post-step hook):

* ``lp``: the master cast to the compute dtype. This is the cast autocast would do anyway; the dispatcher's dense
  choices use it in the forward and the input gradient, so it replaces autocast's cast rather than adding one. Once
  the dispatcher has measured a call shape and no dense choice remains in it (e.g. transposable 2:4 with the
  forward and the input gradient on our kernel), the cast is skipped: the repack reads the fp32 master directly.
* ``packed`` (and ``packed_t`` for transposable 2:4): the kernel layout. Built in full (mask included) once per
  mask; after that each step only re-gathers the kept values (:func:`hf_sparse.ops.repack`). The first layer to
  find its packs stale after a step repacks every layer of its :func:`enable_kernel_path` call that ran on the
  kernels since the last such batch, in one call (:func:`hf_sparse.ops.repack_many`, a launch per 40 weights): one or two launches per
  layer and step cost more host time than the repacks take on the GPU (``benchmarks/RESULTS.md``).

A layer is kernel-ready when it is on a CUDA device, its pattern is 2:4 or V:2:M with V in {64, 128} and M in
{4 … 128}, and both dimensions are multiples of 8. The compute dtype is autocast's when autocast is on, else the
weight's own if it is bf16/fp16; an fp32 forward without autocast keeps the dense path (Sparse Tensor Cores have
no fp32 mode).

Never slower than the masked dense path it replaces, by construction: the dispatcher (:mod:`hf_sparse.ops.dispatch`)
measures once per shape which backend is fastest for the forward, the weight gradient and (transposable 2:4) the
input gradient. When it picks dense cuBLAS for all of them, this layer goes back to its own dense forward for that
token count (one dict lookup per call decides), so neither the repack nor the extra Python of the autograd function
is paid. (On the H200, training BERT-large at transposable 2:4 with 8192 tokens per step, the dispatcher put the
forward and input gradient of every layer on our 2:4 kernel, repack included, and kept dense cuBLAS for the weight
gradient: ``benchmarks/RESULTS.md``.)

The weight gradient of the kernel path is zero at pruned positions by construction, so the pruner's gradient hook
does not mask it again (:func:`needs_grad_mask`): a pass over the gradient and ~70 us of host time per layer and step
on the H200's host (``benchmarks/RESULTS.md``). A call that takes the dense route leaves a dense gradient, and the
hook masks that layer's gradient as before.

Masks are read from the pruner on every refresh: a mask the pruner replaces (resume, best-model restore, dynamic
updates) triggers a full pack, never a stale one.

Under FSDP2 (``fully_shard``) the layer's ``weight`` is a sharded DTensor at rest and the full weight exists only
inside the forward (FSDP2 swaps it in, all-gathered). The shadows are therefore built inside the forward, from that
full weight, and are plain attributes of the per-layer state (never parameters or buffers, which FSDP2 would try to
shard). FSDP2 all-gathers every step into the same storage and keeps its version counter, so the master's version
cannot tell a new step from an old one: for a sharded layer the shadows are rebuilt on every forward (a cast and a
repack; the full pack only when the mask changes).
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..ops import dispatch
from ..ops._build import KernelUnavailableError
from ..ops._layout import VALID_M, VALID_V, PackedWeight
from ..ops.pack import pack, repack, repack_many
from ..patterns import NM, VNM, Pattern
from .optimizer_steps import optimizer_steps, watch_optimizer_steps
from .sparse_matmul import sparse_linear_unchecked

if TYPE_CHECKING:
    from ..pruner import Pruner

__all__ = [
    "disable_kernel_path",
    "enable_kernel_path",
    "kernel_path_layers",
    "kernel_pattern",
    "masks_final",
    "needs_grad_mask",
]

logger = logging.getLogger(__name__)

_ATTR = "_hf_sparse_kernel"
_LP_DTYPES = (torch.bfloat16, torch.float16)
_DENSE, _KERNEL = "dense", "kernel"
_DECIDE_AFTER = 3  # calls after which a backend still unmeasured (e.g. frozen weight: no dW) counts as dense


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


def _why_not(weight: Tensor, pattern: Pattern, allow_cpu: bool) -> str | None:
    """Why a layer cannot take the kernel path, or None if it can."""
    if kernel_pattern(pattern) is None:
        return f"pattern {pattern} has no Sparse Tensor Core kernel (2:4 and V:2:M with V in {VALID_V} only)"
    if not weight.is_cuda and not allow_cpu:
        return f"weight is on {weight.device}, not CUDA"
    rows, cols = weight.shape
    if rows % 8 or cols % 8:
        return f"shape ({rows}, {cols}) is not a multiple of 8 in both dimensions"
    return None


class _KernelGroup:
    """The layers one :func:`enable_kernel_path` call switched: their repacks after an optimizer step go together."""

    def __init__(self) -> None:
        self.layers: list[_LayerKernel] = []

    def repack_used(self, dtype: torch.dtype) -> None:
        """Repack, in one batch, every layer that ran on the kernels since the last batch and whose packs are stale
        for a reason a repack fixes (new master values, same mask and dtype); their ``lp`` is left to be made lazily
        by their own next call, where one needs it."""
        todo = [k for k in self.layers if k.used and k.repack_due(dtype)]
        for k in self.layers:
            k.used = False
        if not todo:
            return
        weights, packs, owners = [], [], []
        for k in todo:
            master = k.weight().detach()
            weights.append(master)
            packs.append(k.packed)
            owners.append((k, "packed"))
            if k.packed_t is not None:
                weights.append(master.t())
                packs.append(k.packed_t)
                owners.append((k, "packed_t"))
            view = dispatch.view24_of(k.packed) if k.m > 4 else None
            if view is not None:  # the dispatcher runs this V:2:M weight as 2:4: its view is due too
                weights.append(master)
                packs.append(view)
                owners.append((k, "view24"))
        with torch.no_grad():
            fresh = repack_many(weights, packs, all_valid=[k.all_valid and a != "view24" for k, a in owners])
            copies: list[tuple[Tensor, Tensor]] = []
            for k in todo:
                k.refresh_bias(dtype, copies)
            if copies:  # the biases' casts into their buffers, in one call too (a launch per layer otherwise)
                torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
        for (k, attr), p in zip(owners, fresh, strict=True):
            if attr == "view24":
                dispatch.adopt_view24(k.packed, p)  # k.packed is already the new pack (it comes first)
            else:
                setattr(k, attr, p)
        for k in todo:
            k.lp = None
            k._weight_key = k.weight_key(dtype)


class _LayerKernel:
    """Kernel-path state of one layer: its shadows of the master weight and the per-call-shape route."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        transposed: bool,
        pruner: Pruner,
        v: int,
        m: int,
        sharded: bool = False,
        group: _KernelGroup | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.transposed = transposed  # GPT-2 Conv1D stores (in, out): the logical weight is weight.T
        self.pruner = pruner
        self.v, self.m = v, m
        self.transposable = m == 4 and bool(pruner.config.transposable)
        self.routes: dict[tuple, str] = {}
        self.plans: dict[tuple, tuple] = {}  # per call shape: the measured (forward, input grad, weight grad) choices
        self.needs_lp: dict[tuple, bool] = {}  # per call shape: whether a dense choice reads ``lp``
        self.tries: dict[tuple, int] = {}
        self.dense_grad = True  # a gradient not made by the kernel path may be in .grad: the hook must mask it
        self.packed: PackedWeight | None = None
        self.packed_t: PackedWeight | None = None
        self.lp: Tensor | None = None
        self.bias_lp: Tensor | None = None  # the bias in the compute dtype, at a fixed address (cuSPARSELt plans)
        # FSDP2: weight at rest is a DTensor shard; in forward, the all-gathered full weight keeps one version
        self.sharded = sharded or _is_dtensor(module.weight)
        self.all_valid = False
        self._weight_key: tuple | None = None
        self._mask_key: tuple | None = None
        self.group = group if group is not None else _KernelGroup()
        self.group.layers.append(self)
        self.used = False  # refreshed (ran on the kernels) since the group's last batched repack

    def weight(self) -> Tensor:
        w = self.module.weight
        return w.t() if self.transposed else w

    def weight_key(self, dtype: torch.dtype) -> tuple:
        """What the shadows were built from, short of the mask: the master's version and address, the compute dtype,
        the optimizer steps taken (fused optimizers leave the version alone) and the bias's version."""
        w, bias = self.weight(), self.module.bias
        return (w._version, w.data_ptr(), dtype, optimizer_steps(), None if bias is None else bias._version)

    def _current_mask_key(self, dtype: torch.dtype) -> tuple:
        mask = self.pruner.masks[self.name]
        if mask is None:
            raise RuntimeError(f"hf_sparse: layer {self.name} is on the kernel path but the pruner has no mask for it")
        return (mask, mask._version, dtype)  # the mask itself, not its id: a freed mask's id can be reused

    def repack_due(self, dtype: torch.dtype) -> bool:
        """Whether the packs are stale only because the master's values changed (a repack, not a full pack)."""
        return self._values_stale(self.weight_key(dtype), self._current_mask_key(dtype))

    def _values_stale(self, wkey: tuple, mkey: tuple) -> bool:
        """:meth:`repack_due` for keys the caller already has."""
        return (
            self.packed is not None
            and not self.sharded
            and self.packed.dtype == mkey[2]
            and self._same_mask(mkey)
            and wkey != self._weight_key
        )

    def refresh(self, dtype: torch.dtype, need_lp: bool = True) -> None:
        """Rebuild the packs (and ``lp`` if ``need_lp``) if the master, the mask or the compute dtype changed since
        the last call."""
        self.used = True
        wkey = self.weight_key(dtype)
        mkey = self._current_mask_key(dtype)
        fresh = wkey == self._weight_key and self._same_mask(mkey) and not self.sharded
        if fresh and (self.lp is not None or not need_lp):
            return
        if not fresh and self._values_stale(wkey, mkey) and len(self.group.layers) > 1:
            self.group.repack_used(dtype)  # this layer's repack and every other used layer's, in one call
            self.refresh(dtype, need_lp)  # now only lp may be missing
            return
        w = self.weight()
        with torch.no_grad():
            master = w.detach()
            lp = master.to(dtype) if need_lp else None
            if fresh:
                pass  # only lp was missing
            elif not self._same_mask(mkey) or self.packed is None:
                src = lp if lp is not None else master.to(dtype)
                mask = mkey[0]
                self.packed = pack(src.contiguous(), mask, self.v, self.m, dtype)
                self.all_valid = bool(self.packed.valid.all())
                if self.transposable:
                    self.packed_t = pack(src.t().contiguous(), mask.t().contiguous(), 64, 4, dtype)
                self._mask_key = mkey
                self.routes.clear()
                self.plans.clear()
                self.needs_lp.clear()
                self.tries.clear()
            else:  # the repack casts as it gathers: it reads the master (any float dtype) when lp is not made
                src = lp if lp is not None else master
                self.packed = repack(src, self.packed, all_valid=self.all_valid)
                if self.packed_t is not None:
                    self.packed_t = repack(src.t(), self.packed_t, all_valid=self.all_valid)
            if not fresh:
                self.refresh_bias(dtype)
        self.lp = lp
        self._weight_key = wkey

    def refresh_bias(self, dtype: torch.dtype, copies: list[tuple[Tensor, Tensor]] | None = None) -> None:
        """Bring ``bias_lp`` up to date: None where the bias needs no cast, else the bias in ``dtype``, copied into
        the same buffer when it has one (its address stays: cuSPARSELt plans hold it). ``copies``: collect the
        (buffer, bias) pairs for the caller to copy in one call instead of copying here."""
        bias = self.module.bias
        if bias is None or bias.dtype == dtype:
            self.bias_lp = None
        elif self.bias_lp is None or self.bias_lp.dtype != dtype or self.bias_lp.shape != bias.shape:
            self.bias_lp = bias.detach().to(dtype)
        elif copies is not None:
            copies.append((self.bias_lp, bias.detach()))
        else:
            self.bias_lp.copy_(bias.detach())

    def _same_mask(self, mkey: tuple) -> bool:
        old = self._mask_key
        return old is not None and old[0] is mkey[0] and old[1:] == mkey[1:]

    def decide(self, key: tuple, tokens: int, device: torch.device, grad: bool) -> str | None:
        """Dense route if the dispatcher measured dense as fastest for every part of this call shape."""
        if dispatch.backend_mode() != "auto" or device.type != "cuda":
            self.routes[key] = _KERNEL
            self.needs_lp[key] = True
            return _KERNEL
        assert self.packed is not None
        trains = grad and self.module.weight.requires_grad  # the kind sparse_linear's forward measures under
        fwd = "fwd_train" if trains else "fwd"
        forward = dispatch.choice(fwd, tokens, self.packed, device)
        parts = [forward]
        input_grad = weight_grad = None  # input gradient: dense GEMM on lp unless packed_t runs it
        if grad:
            if self.module.weight.requires_grad:
                parts.append(weight_grad := dispatch.choice("dw", tokens, self.packed, device))
            if self.packed_t is not None:
                parts.append(input_grad := dispatch.choice(fwd, tokens, self.packed_t, device))
        if None in parts:
            self.tries[key] = self.tries.get(key, 0) + 1
            if parts[0] is None or self.tries[key] < _DECIDE_AFTER:
                return None
        route = _DENSE if all(p in ("dense", None) for p in parts) else _KERNEL
        self.routes[key] = route
        self.plans[key] = (forward, input_grad, weight_grad)
        self.needs_lp[key] = forward in ("dense", None) or (grad and input_grad in ("dense", None))
        logger.debug("hf_sparse: %s, %d tokens, grad=%s: %s path", self.name, tokens, grad, route)
        return route


def _fsdp_managed(model: nn.Module) -> set[int]:
    """ids of the modules whose parameters FSDP2 manages (every module under a ``fully_shard``-ed one)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return set()
    return {id(sub) for module in model.modules() if isinstance(module, FSDPModule) for sub in module.modules()}


def _is_dtensor(tensor: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(tensor, DTensor)


def _compute_dtype(weight: Tensor) -> torch.dtype | None:
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return dtype if dtype in _LP_DTYPES else None
    return weight.dtype if weight.dtype in _LP_DTYPES else None


def _kernel_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward installed on a kernel-path layer (``self`` is the Linear / Conv1D module)."""
    k: _LayerKernel = self.__dict__[_ATTR]
    w = k.weight()
    dtype = _compute_dtype(w)
    grad = torch.is_grad_enabled()
    if dtype is not None:
        tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
        key = (1 << max(0, tokens - 1).bit_length(), grad, dtype)
        auto = dispatch.backend_mode() == "auto"
        route = k.routes.get(key) if auto else _KERNEL
        if route is None and k.packed is not None and k.packed.dtype == dtype:
            route = k.decide(key, tokens, w.device, grad)
    if dtype is None or route == _DENSE:  # the layer's own forward: its weight gradient is dense, the hook masks it
        k.dense_grad = k.dense_grad or (grad and w.requires_grad)
        return type(self).forward(self, x)
    k.refresh(dtype, k.needs_lp.get(key, True))
    # the shadows are this layer's own, built from w and the bias: sparse_linear's argument checks are not needed
    plan = k.plans.get(key) if auto else None
    return sparse_linear_unchecked(x, w, k.packed, self.bias, k.packed_t, k.lp, k.bias_lp, plan)


def enable_kernel_path(model: nn.Module, pruner: Pruner, *, allow_cpu: bool = False) -> list[str]:
    """Route the pruner's kernel-ready layers through the sparse kernels; returns the names of the layers switched.

    Call once the masks are final and static (:func:`masks_final`); earlier, nothing is switched. Layers that cannot
    run on the kernels (CPU, a pattern without a kernel, odd shapes, a forward someone else replaced) keep their own
    forward; with no CUDA GPU this is a no-op. ``allow_cpu`` runs the path on CPU with the ops' reference
    implementations (tests only: slow). ``model`` is the model the pruner was built on (only used to check that the
    pruner's layers belong to it).
    """
    if not masks_final(pruner):
        return []
    if not allow_cpu:
        if not torch.cuda.is_available():
            return []
        try:
            from ..ops._build import load_extension

            load_extension()
        except KernelUnavailableError as err:
            warnings.warn(f"hf_sparse: training stays on the dense path: {err}", stacklevel=2)
            return []
    watch_optimizer_steps()
    owned = {id(m) for m in model.modules()}
    managed = _fsdp_managed(model)
    pattern = pruner.current_pattern()
    assert pattern is not None
    switched, skipped = [], []
    group = _KernelGroup()
    for layer in pruner.layers:
        module = layer.module
        if id(module) not in owned:
            raise ValueError(f"hf_sparse.enable_kernel_path: layer {layer.name} is not part of the given model")
        if _ATTR in module.__dict__:
            switched.append(layer.name)
            continue
        if "forward" in module.__dict__:  # another per-instance forward (e.g. a dynamic-mask one): leave it alone
            skipped.append(f"{layer.name} (its forward is already replaced)")
            continue
        reason = _why_not(layer.weight, pattern, allow_cpu)
        if reason is not None:
            skipped.append(f"{layer.name} ({reason})")
            continue
        v, m = kernel_pattern(pattern)  # type: ignore[misc]
        module.__dict__[_ATTR] = _LayerKernel(
            layer.name, module, layer.transposed, pruner, v, m, sharded=id(module) in managed, group=group
        )
        module.forward = types.MethodType(_kernel_forward, module)
        switched.append(layer.name)
    if skipped:
        logger.info("hf_sparse: %d layer(s) stay dense: %s", len(skipped), "; ".join(skipped))
    if switched:
        logger.info("hf_sparse: %d layer(s) now run on the sparse kernels (%s)", len(switched), pattern)
    return switched


def disable_kernel_path(model: nn.Module) -> int:
    """Give every kernel-path layer of ``model`` its own dense forward back; returns how many were restored."""
    count = 0
    for module in model.modules():
        if module.__dict__.pop(_ATTR, None) is not None:
            forward = module.__dict__.get("forward")
            if getattr(forward, "__func__", None) is _kernel_forward:
                del module.__dict__["forward"]
            count += 1
    return count


def needs_grad_mask(module: nn.Module) -> bool:
    """Whether ``module.weight.grad`` may hold nonzeros at pruned positions, for the pruner's gradient hook, which
    then masks it: False only for a kernel-path layer all of whose forwards since the last call took the kernel
    route (its weight gradient is zero there by construction). Resets the layer's record: call it where the
    gradient gets masked."""
    k = module.__dict__.get(_ATTR)
    if k is None:
        return True
    dense, k.dense_grad = k.dense_grad, False
    return dense


def masks_final(pruner: Pruner) -> bool:
    """Whether the pruner's masks are final and will not move again (static masks at the final pattern).

    Uses ``Pruner.masks_final`` where the pruner has it (dynamic-mask pruners: final only when not dynamic), else
    ``Pruner.is_final``.
    """
    final = getattr(pruner, "masks_final", None)
    if final is None:
        return pruner.is_final
    return bool(final() if callable(final) else final)


def kernel_path_layers(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` currently on the kernel path."""
    return [name for name, module in model.named_modules() if _ATTR in module.__dict__]
