"""Mask construction: pure tensor functions, vectorised, the same on any device.

Every function takes an *importance* tensor (larger means keep; see :mod:`hf_sparse.scoring`) shaped like the
logical weight ``(out_features, in_features)`` and returns a ``bool`` mask of the same shape. Ties are broken
towards the lower index (stable sorts, first-maximum ``argmax``), so CPU and CUDA give the same mask. On CUDA, once
this process has loaded the kernel extension (SparsityCallback does on CUDA), N:M, V:N:M and transposable 2:4 masks of
fp32/bf16/fp16 scores come from dedicated kernels (``csrc/mask_select.cu``) that apply the same rules, tie-breaking
included; the torch forms sort every group or loop over chunks of a float64 matmul, many launches per layer.
Applying a mask writes ``+0.0`` at pruned positions (:func:`apply_mask`), never the ``-0.0`` that ``w * mask``
leaves for negative weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from functools import cache

import torch
from torch import Tensor

from .patterns import NM, SPTC_GROUP, VNM, Pattern, Unstructured

__all__ = [
    "apply_mask",
    "apply_masks",
    "compute_mask",
    "nm_mask",
    "transposable_2to4_mask",
    "unstructured_mask",
    "unstructured_threshold",
    "vnm_mask",
]

# Blocks per chunk of the transposable search: its (chunk x 90) float64 scratch (5.9 MB) stays in cache.
_TRANSPOSABLE_CHUNK = 1 << 13


def _top_k_last_dim(score: Tensor, k: int) -> Tensor:
    """``bool`` mask of the ``k`` largest entries along the last dim; ties go to the lower index."""
    size = score.shape[-1]
    if k >= size:
        return torch.ones_like(score, dtype=torch.bool)
    keep = torch.zeros_like(score, dtype=torch.bool)
    if k <= 0:
        return keep
    order = torch.argsort(score, dim=-1, descending=True, stable=True)
    return keep.scatter_(-1, order[..., :k], True)


_KERNEL_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # converted to fp32 exactly


def _selection_kernels(score: Tensor):
    """The extension, for a CUDA score the mask kernels take, once this process has loaded it (never builds)."""
    if not score.is_cuda or score.dtype not in _KERNEL_SCORE_DTYPES or score.dim() != 2:
        return None
    return _mask_extension()


def nm_mask(score: Tensor, n: int, m: int) -> Tensor:
    """Keep the ``n`` largest of every ``m`` consecutive entries of each row."""
    rows, cols = score.shape
    if cols % m:
        raise ValueError(f"N:M mask {n}:{m}: in_features={cols} is not a multiple of m={m}")
    ext = _selection_kernels(score)
    if ext is not None:
        return ext.nm_mask(score.float().contiguous(), n, m)
    return _nm_mask_torch(score, n, m)


def _nm_mask_torch(score: Tensor, n: int, m: int) -> Tensor:
    rows, cols = score.shape
    return _top_k_last_dim(score.reshape(rows, cols // m, m), n).reshape(rows, cols)


def vnm_mask(score: Tensor, v: int, n: int, m: int, keep_cols: int = SPTC_GROUP) -> Tensor:
    """VENOM ``V:N:M``: per block of ``v`` rows x ``m`` columns, keep ``keep_cols`` columns, then ``n`` per row.

    The rule, in two stages:

    1. **Columns.** Each block keeps the ``keep_cols`` (4 for the hardware) columns with the largest *summed*
       importance over the block's ``v`` rows (accumulated in float64, so summation order cannot flip a choice).
    2. **Rows.** Inside those columns each row keeps its ``n`` largest entries.

    Stage 1 is a greedy stand-in for the exact "which 4 columns keep the most importance after stage 2", which
    needs all ``C(m, 4)`` subsets per block (1820 at ``m=16``; what Spatha's CPU tool enumerates); the column sum
    is linear in the block size and ranks columns by exactly the importance stage 2 chooses from.
    """
    rows, cols = score.shape
    if rows % v or cols % m:
        raise ValueError(f"V:N:M mask {v}:{n}:{m}: shape ({rows}, {cols}) needs rows % {v} == 0 and cols % {m} == 0")
    ext = _selection_kernels(score)
    if ext is not None:
        return ext.vnm_mask(score.float().contiguous(), v, n, m, keep_cols)
    return _vnm_mask_torch(score, v, n, m, keep_cols)


def _vnm_mask_torch(score: Tensor, v: int, n: int, m: int, keep_cols: int) -> Tensor:
    rows, cols = score.shape
    blocks = score.reshape(rows // v, v, cols // m, m)
    column_score = blocks.sum(dim=1, dtype=torch.float64)  # (row_blocks, col_groups, m)
    kept_columns = _top_k_last_dim(column_score, keep_cols).unsqueeze(1)  # broadcast over the block's rows
    if n >= keep_cols:
        keep = kept_columns.expand_as(blocks)
    else:
        candidates = blocks.masked_fill(~kept_columns, float("-inf"))
        keep = _top_k_last_dim(candidates, n) & kept_columns
    return keep.reshape(rows, cols)


@cache
def _transposable_patterns() -> Tensor:
    """The 90 binary 4x4 patterns with exactly two ones per row and per column, flattened: ``(90, 16)`` float64."""
    row_choices = [c for c in itertools.product((0, 1), repeat=4) if sum(c) == 2]  # the 6 ways to keep 2 of 4
    patterns = [
        [x for row in rows for x in row]
        for rows in itertools.product(row_choices, repeat=4)
        if all(sum(row[j] for row in rows) == 2 for j in range(4))
    ]
    if len(patterns) != 90:  # a property of the combinatorics, checked once
        raise RuntimeError(f"expected 90 transposable 2:4 patterns, built {len(patterns)}")
    return torch.tensor(patterns, dtype=torch.float64)


def transposable_2to4_mask(score: Tensor) -> Tensor:
    """Exact transposable 2:4: per 4x4 block, the one of the 90 patterns valid for W and W.T keeping the most.

    All 90 totals come from one small matmul per chunk (a stride-4 "convolution" with 90 filters) in float64,
    exact for float32 inputs, so no summation order can flip a choice between CPU and CUDA; ``argmax`` takes the
    first best pattern on ties. Chunks of 8192 blocks keep the ``(chunk, 90)`` scratch in cache (measured: 2.5x
    faster than one big matmul on a 2-core CPU).
    """
    rows, cols = score.shape
    if rows % 4 or cols % 4:
        raise ValueError(f"transposable 2:4 mask: shape ({rows}, {cols}) needs both dimensions divisible by 4")
    ext = _selection_kernels(score)
    if ext is not None:
        return ext.transposable_2to4_mask(score.float().contiguous(), _transposable_bits(score.device))
    return _transposable_2to4_mask_torch(score)


@cache
def _transposable_bits(device: torch.device) -> Tensor:
    """The 90 patterns as 16-bit masks (bit ``4 r + c``: row ``r``, column ``c`` of the block kept), in the order of
    :func:`_transposable_patterns` (the kernel keeps the first best, as ``argmax`` does), as int16 on ``device``."""
    weights = torch.tensor([1 << k for k in range(16)], dtype=torch.float64)
    bits = (_transposable_patterns() @ weights).long()
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(device=device, dtype=torch.int16)


def _transposable_2to4_mask_torch(score: Tensor) -> Tensor:
    rows, cols = score.shape
    patterns = _transposable_patterns().to(score.device)
    filters = patterns.T.contiguous()
    blocks = score.reshape(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    best = torch.empty(blocks.shape[0], dtype=torch.long, device=score.device)
    for start in range(0, blocks.shape[0], _TRANSPOSABLE_CHUNK):
        chunk = blocks[start : start + _TRANSPOSABLE_CHUNK].to(torch.float64)
        best[start : start + _TRANSPOSABLE_CHUNK] = (chunk @ filters).argmax(dim=1)
    keep = patterns[best].to(torch.bool)
    return keep.reshape(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)


def unstructured_threshold(scores: list[Tensor], sparsity: float) -> float:
    """The importance below or at which a ``sparsity`` fraction of all entries of ``scores`` falls (global pruning)."""
    flat = torch.cat([s.detach().reshape(-1).float().cpu() for s in scores])
    prune = int(round(sparsity * flat.numel()))
    if prune <= 0:
        return float("-inf")
    return flat.kthvalue(prune).values.item()


def unstructured_mask(score: Tensor, sparsity: float, threshold: float | None = None) -> Tensor:
    """Keep the largest ``1 - sparsity`` of this layer, or (global pruning) everything above ``threshold``.

    Per layer the count is exact: ``round((1 - sparsity) * numel)`` kept, ties at the cut going to the lower flat
    index (a k-th value search and one cumulative sum, linear in the layer size).
    """
    if threshold is not None:
        return score > threshold
    flat = score.reshape(-1)
    keep = int(round((1.0 - sparsity) * flat.numel()))
    if keep >= flat.numel():
        return torch.ones_like(score, dtype=torch.bool)
    if keep <= 0:
        return torch.zeros_like(score, dtype=torch.bool)
    cut = flat.kthvalue(flat.numel() - keep).values  # the largest pruned value
    above = flat > cut
    ties = flat == cut
    room = keep - int(above.sum())
    ties_kept = ties & (torch.cumsum(ties, dim=0) <= room)
    return (above | ties_kept).reshape(score.shape)


def compute_mask(score: Tensor, pattern: Pattern, *, transposable: bool = False) -> Tensor:
    """Dispatch on the pattern. ``transposable`` asks for a mask that is 2:4 along both dimensions (2:4 only)."""
    if transposable:
        if not (isinstance(pattern, NM) and (pattern.n, pattern.m) == (2, 4)):
            raise ValueError(f"transposable masks exist for the 2:4 pattern only, not {pattern}")
        return transposable_2to4_mask(score)
    if isinstance(pattern, NM):
        return nm_mask(score, pattern.n, pattern.m)
    if isinstance(pattern, VNM):
        return vnm_mask(score, pattern.v, pattern.n, pattern.m, pattern.keep_cols)
    if isinstance(pattern, Unstructured):
        return unstructured_mask(score, pattern.sparsity)
    raise TypeError(f"unknown pattern type {type(pattern).__name__}")


@torch.no_grad()
def apply_mask(weight: Tensor, mask: Tensor) -> Tensor:
    """Zero ``weight`` in place where ``mask`` is False, writing ``+0.0``; returns ``weight``.

    The pruner calls this for every gradient and every weight of every step; :func:`apply_masks` says how it runs.
    """
    apply_masks([(weight, mask)])
    return weight


@torch.no_grad()
def apply_masks(pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
    """:func:`apply_mask` over many ``(tensor, mask)`` pairs.

    On CUDA, once this process has loaded the kernel extension (SparsityCallback does), contiguous fp32 / bf16 / fp16
    tensors go to one fused kernel launch (``csrc/mask.cu``): torch's ``where`` takes its non-vectorised path here
    and costs one launch per tensor (on an H200: ~1.5 ms of kernel time per pass over BERT-large's 302M weights and
    10-15 us of host time per tensor, ``benchmarks/bench_apply_mask.py``). Everything else (CPU, views such as
    GPT-2's transposed weights, other dtypes, no extension) takes one ``where`` pass per tensor with a zero on the
    tensor's device: a CPU zero would be copied to the GPU on every call, which blocks the host.
    """
    ext = None
    fused_t: list[Tensor] = []
    fused_m: list[Tensor] = []
    for t, m in pairs:
        if _fusable(t, m) and (ext is not None or (ext := _mask_extension()) is not None):
            fused_t.append(t)
            fused_m.append(m)
        else:
            torch.where(m, t, _zero(t.dtype, t.device), out=t)
    if fused_t:
        ext.apply_masks_(fused_t, fused_m)
        # the kernel wrote through raw pointers: tell autograd, and every cache keyed on the version counter, that
        # these tensors changed in place
        torch.autograd.graph.increment_version(fused_t)


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fusable(t: Tensor, m: Tensor) -> bool:
    return (
        t.is_cuda
        and t.dtype in _FUSED_DTYPES
        and m.dtype == torch.bool
        and t.shape == m.shape
        and t.device == m.device
        and t.is_contiguous()
        and m.is_contiguous()
    )


#: The kernel extension once this process has loaded it: :func:`hf_sparse.ops._build.load_extension` hands it over
#: through :func:`use_extension`. This module never loads or builds it (nor imports the ops layer above it).
_extension = None


def use_extension(extension) -> None:
    """Let the mask functions use ``extension``'s kernels (called by the ops layer when it loads them)."""
    global _extension
    _extension = extension


def _mask_extension():
    return _extension


@cache
def _zero(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-dim ``+0.0`` on ``device``: a scalar operand for ``where``, allocated once per dtype and device."""
    return torch.zeros((), dtype=dtype, device=device)
