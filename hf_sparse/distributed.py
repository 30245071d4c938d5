"""What the pruner needs to stay exact when several processes train one model (DDP, FSDP2 ``fully_shard``).

Two facts shape it:

* **Masks must be the same on every rank.** DDP averages gradients, so a position pruned on one rank and kept on
  another receives a non-zero average; FSDP2 all-gathers shards, so ranks must agree on which rows are pruned.
  :func:`broadcast_masks` makes rank 0's masks everyone's after each update (see ``docs/design.md``,
  "Distributed", for why we broadcast rather than trust identical arithmetic).
* **Under FSDP2 a weight is a ``DTensor``** whose local tensor holds a slice of rows. Masks are computed on the
  full weight (:func:`full_tensor`; a V:N:M block spans V rows, which may straddle two shards) and kept whole on
  every rank; :func:`local_part` pairs a sharded tensor's local slice with the matching slice of the mask.

Nothing here imports ``torch.distributed.tensor``: a tensor can only be a ``DTensor`` if that module is already
loaded, so :func:`is_sharded` looks it up in ``sys.modules`` and plain single-process runs pay nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

__all__ = [
    "KeptGradientAllReduce",
    "broadcast_masks",
    "count_zeros",
    "full_tensor",
    "gather_full_state_dict",
    "has_sharded_parameters",
    "is_main_process",
    "is_sharded",
    "kept_gradient_all_reduce_hook",
    "local_part",
    "world_size",
]


def _dtensor_class() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP2 / tensor-parallel parameter or gradient)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def has_sharded_parameters(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor``: saving it then needs every rank (a gather)."""
    return any(is_sharded(p) for p in model.parameters())


def world_size() -> int:
    """Processes in the default group; 1 when ``torch.distributed`` is not initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def is_main_process() -> bool:
    """Rank 0 of the default group, or the only process."""
    if world_size() == 1:
        return True
    return torch.distributed.get_rank() == 0


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor on every rank (an all-gather for a ``DTensor``: every rank must call it); else ``tensor``."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_part(tensor: Tensor, mask: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """``(t, m)`` such that ``apply_mask(t, m)`` masks what this rank holds of ``tensor``.

    ``tensor`` is a weight or gradient as stored (GPT-2's ``Conv1D``: ``(in, out)``, ``transposed=True``);
    ``mask`` is the full logical ``(out, in)`` mask. A plain tensor gives its logical view and ``mask``; a
    ``DTensor`` gives its local shard and the slice of ``mask`` (stored orientation) that this shard covers.
    """
    if not is_sharded(tensor):
        return (tensor.T if transposed else tensor), mask
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    stored_mask = mask.T if transposed else mask
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    index = tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
    part = stored_mask[index]
    if part.shape != local.shape:
        raise RuntimeError(
            f"hf_sparse: a sharded tensor's local shape {tuple(local.shape)} does not match its slice "
            f"{tuple(part.shape)} of the global {tuple(tensor.shape)}; placements {tensor.placements} are not supported"
        )
    return local, part.to(local.device)


def _broadcast_(tensor: Tensor, src: int = 0) -> None:
    """In-place broadcast; NCCL needs CUDA tensors, so CPU tensors travel through the current CUDA device."""
    backend = str(torch.distributed.get_backend())
    if tensor.device.type == "cpu" and "nccl" in backend and "gloo" not in backend:
        staged = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.broadcast(staged, src=src)
        tensor.copy_(staged)
    else:
        torch.distributed.broadcast(tensor, src=src)


def broadcast_masks(masks: Mapping[str, Tensor | None], src: int = 0) -> None:
    """Overwrite every rank's ``bool`` masks in place with rank ``src``'s (one broadcast per layer, 1 byte a weight).

    All ranks must call it with masks of the same names and shapes; ``None`` entries are skipped on all ranks.
    """
    if world_size() == 1:
        return
    for mask in masks.values():
        if mask is None:
            continue
        if mask.dtype != torch.bool or not mask.is_contiguous():
            raise TypeError("broadcast_masks: masks must be contiguous bool tensors")
        _broadcast_(mask.view(torch.uint8), src=src)


def _counts_once(tensor: Tensor) -> bool:
    """Whether this rank's shard of ``tensor`` is the one to count: the first replica along replicated mesh dims
    (HSDP keeps copies of each shard), so that a sum over all ranks counts every element once."""
    from torch.distributed.tensor import Replicate

    mesh = tensor.device_mesh
    return all(
        mesh.get_local_rank(dim) == 0
        for dim, placement in enumerate(tensor.placements)
        if isinstance(placement, Replicate)
    )


@torch.no_grad()
def count_zeros(tensors: Iterable[Tensor]) -> list[int]:
    """Exact zeros in each tensor, over whole tensors: sharded ones are counted locally and summed over ranks in
    one all-reduce (so every rank must call it when any tensor is sharded)."""
    tensors = list(tensors)
    sharded = [is_sharded(t) for t in tensors]
    counts = []
    for tensor, is_shard in zip(tensors, sharded, strict=True):
        if is_shard:
            counts.append(int((tensor.to_local() == 0).sum()) if _counts_once(tensor) else 0)
        else:
            counts.append(int((tensor == 0).sum()))
    if world_size() == 1 or not any(sharded):
        return counts
    summed = _all_reduce_ints([c if is_shard else 0 for c, is_shard in zip(counts, sharded, strict=True)])
    return [total if is_shard else c for c, is_shard, total in zip(counts, sharded, summed, strict=True)]


def _all_reduce_ints(values: list[int]) -> list[int]:
    backend = str(torch.distributed.get_backend())
    device = torch.device("cpu")
    if "nccl" in backend and "gloo" not in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = torch.tensor(values, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(buffer)
    return [int(v) for v in buffer.tolist()]


def gather_full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Full, unsharded CPU state dict on rank 0 and ``{}`` elsewhere; every rank must call it (FSDP2's gather).

    The same options ``accelerate`` uses for ``Accelerator.get_state_dict`` under FSDP2.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


class KeptGradientAllReduce:
    """DDP communication hook that all-reduces only the kept positions of pruned weights' gradients.

    A pruned position's gradient is exactly zero on every rank when the bucket is reduced (the pruner's gradient
    hook runs before DDP's reducer), so sending it is wasted bandwidth: at 64:2:8 the encoder's linear layers send a
    quarter of their gradient. Per bucket, the kept positions are gathered into a compact buffer, averaged over the
    ranks with one all-reduce, and written back; the pruned positions stay ``+0.0``. The result equals DDP's default
    averaging. The positions are re-derived when the masks change (an index of 8 bytes per kept element, cached per
    bucket), and a bucket that would shrink by less than ``min_saving`` is reduced whole.

    Usage: ``ddp_model.register_comm_hook(KeptGradientAllReduce(pruner), kept_gradient_all_reduce_hook)``.
    """

    def __init__(self, pruner, process_group=None, min_saving: float = 0.25) -> None:
        self.pruner = pruner
        self.process_group = process_group
        self.min_saving = min_saving
        self._cache: dict[int, tuple[tuple, Tensor | None]] = {}
        #: gradient elements all-reduced, and how many DDP's default hook would have sent (since construction)
        self.elements_sent = 0
        self.elements_total = 0

    def _layers_by_param(self) -> dict[int, object]:
        # a compact layer's gradient holds its kept values only: all-reduced whole, like any dense parameter
        return {id(layer.module.weight): layer for layer in self.pruner.layers if not layer.compact}

    def _kept_index(self, bucket) -> Tensor | None:
        buffer = bucket.buffer()
        masks = self.pruner.dense_masks()  # a compact layer's gradient is all-reduced whole
        key = (buffer.data_ptr(), buffer.numel(), tuple((name, id(m)) for name, m in masks.items()))
        cached = self._cache.get(bucket.index())
        if cached is not None and cached[0] == key:
            return cached[1]
        layers = self._layers_by_param()
        pieces, pruned = [], False
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            start = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
            layer = layers.get(id(param))
            mask = masks.get(layer.name) if layer is not None else None
            if mask is None:
                pieces.append(torch.arange(start, start + grad.numel(), device=buffer.device))
            else:
                stored = (mask.T if layer.transposed else mask).reshape(-1).to(buffer.device)
                pieces.append(stored.nonzero().squeeze(1) + start)
                pruned = True
        index = torch.cat(pieces) if pruned else None
        if index is not None and index.numel() > (1 - self.min_saving) * buffer.numel():
            index = None
        self._cache[bucket.index()] = (key, index)
        return index

    def reduce(self, bucket):
        """The averaged bucket, as a future (what a DDP communication hook returns)."""
        group = self.process_group
        world = torch.distributed.get_world_size(group)
        buffer = bucket.buffer()
        index = self._kept_index(bucket)
        self.elements_total += buffer.numel()
        self.elements_sent += buffer.numel() if index is None else index.numel()
        if index is None:
            buffer.div_(world)
            future = torch.distributed.all_reduce(buffer, group=group, async_op=True).get_future()
            return future.then(lambda fut: fut.value()[0])
        compact = buffer.index_select(0, index).div_(world)
        future = torch.distributed.all_reduce(compact, group=group, async_op=True).get_future()

        def write_back(fut):
            buffer.index_copy_(0, index, fut.value()[0])
            return buffer

        return future.then(write_back)


def kept_gradient_all_reduce_hook(state: KeptGradientAllReduce, bucket):
    """The DDP communication hook of :class:`KeptGradientAllReduce` (its ``state``).

    Unannotated ``bucket`` and return: DDP compares annotations with ``GradBucket`` / ``Future[Tensor]`` objects,
    which this module's postponed (string) annotations would not equal.
    """
    return state.reduce(bucket)
