"""Optimal Brain Surgeon (OBS) pruning to N:M, V:N:M and unstructured patterns with an empirical Fisher.

Pure tensor functions, vectorised over every group of a layer (no Python loop over groups), the same on CPU and
CUDA; :class:`hf_sparse.scoring.ObsScore` feeds them the gradients the Trainer computes.

**The model.** Around the current weights ``w`` the loss is taken as ``½ dᵀ F d`` with ``F`` the damped empirical
Fisher of the last ``m`` optimizer-step gradients, block-diagonal over each run of ``B`` consecutive input weights
of a row (``B = M`` by default: one block per N:M group)::

    F = (1/m) Σ_t g_t g_tᵀ + λ I,      λ = damp · mean(diag of the layer's empirical Fisher)

The dampening is **relative** (SparseGPT's ``percdamp``): scale-free, so gradient clipping, loss scaling or a
learning-rate change cannot turn a good ``damp`` into a useless one. A layer that has seen no gradient gets
``F = I``, which makes every rule below the magnitude rule (a warning says so in :class:`ObsScore`).

**Pruning a set ``Q`` of a block** (``w_Q → 0``) and moving the kept weights ``K`` optimally costs
``½ w_Qᵀ (F⁻¹_QQ)⁻¹ w_Q``; the optimal kept weights are ``w'_K = F_KK⁻¹ (F w)_K`` (the OBS update
``δw = −F⁻¹[:, Q] (F⁻¹_QQ)⁻¹ w_Q`` written from the kept side). With ``u = F w`` the cost is
``½ (wᵀ F w − u_Kᵀ F_KK⁻¹ u_K)``: the best ``K`` maximises ``u_Kᵀ F_KK⁻¹ u_K``, an ``N × N`` solve per candidate
(2 × 2 for the hardware patterns) instead of an ``(M−N) × (M−N)`` inverse.

* **N:M** (``B = M``, ``C(M, N) ≤ max_subsets``): every ``N``-subset of every group is scored and the best kept
  exactly (2:4 → 6 subsets, 2:8 → 28, 2:16 → 120). Otherwise (bigger blocks, or ramp levels such as 8:16 with
  12,870 subsets) **greedy OBS**: remove, one weight at a time, the weight of least saliency ``w_q² / (2 [F⁻¹]_qq)``
  among the groups still above ``N``, then update ``w`` and ``F⁻¹`` by the exact rank-one OBS downdate; the
  final weights come from the exact update for the chosen mask.
* **V:N:M**: each ``V × M`` block keeps the 4 columns of largest *summed* per-weight saliency over its ``V`` rows,
  then each row keeps the ``N`` of those 4 that minimise the exact OBS cost with the 12 dropped columns in ``Q``
  (``C(4, 2) = 6`` candidates), or greedily when ``B > M``.
* **unstructured**: per-weight saliency ``w² / (2 [F⁻¹]_ii)`` ranked per layer (or against a global threshold),
  then the exact update for the chosen mask.

``eligible`` (the previous mask of a gradual ramp) restricts every choice: a weight pruned at an earlier level
stays pruned, so ramp levels nest as they do for magnitude.

All solves run in float64 (exact enough that CPU and CUDA choose the same subsets on anything but exact ties,
which go to the lexicographically first subset).
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import torch
from torch import Tensor

from .masks import _top_k_last_dim, unstructured_mask
from .patterns import NM, VNM, Pattern, Unstructured

__all__ = [
    "MAX_SUBSETS",
    "accumulate_fisher",
    "damped_fisher",
    "obs_prune",
    "obs_saliency",
    "obs_update",
]

#: Largest number of candidate subsets per group scored exactly; beyond it the greedy OBS rule is used.
MAX_SUBSETS = 512
# Elements of the (groups, subsets, n, n) scratch per chunk of the exact search (128 MB of float64).
_CHUNK_ELEMENTS = 1 << 24


def accumulate_fisher(fisher_sum: Tensor | None, grad: Tensor, block: int) -> Tensor:
    """Add ``g gᵀ`` of every ``block``-long run of ``grad`` (logical ``(R, K)``) to ``fisher_sum`` in place.

    ``fisher_sum`` is float32 ``(R, K/block, block, block)`` (created on the first call): ``R·K·block·4`` bytes,
    whatever the number of gradients summed.
    """
    rows, cols = grad.shape
    if cols % block:
        raise ValueError(f"OBS Fisher block size {block} does not divide in_features={cols}; set obs_block_size")
    g = grad.detach().to(torch.float32).reshape(rows, cols // block, block)
    if fisher_sum is None:
        fisher_sum = torch.zeros(rows, cols // block, block, block, dtype=torch.float32, device=grad.device)
    return fisher_sum.addcmul_(g.unsqueeze(-1), g.unsqueeze(-2))


def damped_fisher(fisher_sum: Tensor | None, count: int, damp: float, weight: Tensor, block: int) -> Tensor:
    """``(R·K/B, B, B)`` float64 on ``weight``'s device: the mean of ``count`` outer products plus relative
    dampening; the identity when no (non-zero) gradient was seen, which makes OBS rank like magnitude."""
    rows, cols = weight.shape
    blocks = rows * cols // block
    identity = torch.eye(block, dtype=torch.float64, device=weight.device).expand(blocks, block, block)
    if fisher_sum is None or count == 0:
        return identity.clone()
    fisher = fisher_sum.to(device=weight.device, dtype=torch.float64).reshape(blocks, block, block).div_(count)
    mean_diag = float(fisher.diagonal(dim1=-2, dim2=-1).mean())
    if not mean_diag > 0:  # no gradient reached this layer (or all were zero)
        return identity.clone()
    fisher.diagonal(dim1=-2, dim2=-1).add_(damp * mean_diag)
    return fisher


def _inverse(fisher: Tensor) -> Tensor:
    """Batched inverse of symmetric positive definite blocks (Cholesky)."""
    return torch.cholesky_inverse(torch.linalg.cholesky(fisher))


def obs_saliency(weight: Tensor, fisher: Tensor, inverse: Tensor | None = None) -> Tensor:
    """Per-weight OBS saliency ``w² / (2 [F⁻¹]_ii)``, ``(R, K)`` float64: the loss increase of pruning it alone."""
    rows, cols = weight.shape
    inverse = _inverse(fisher) if inverse is None else inverse
    block = fisher.shape[-1]
    w = weight.detach().to(torch.float64).reshape(-1, block)
    diag = inverse.diagonal(dim1=-2, dim2=-1)
    return (w.square() / (2 * diag)).reshape(rows, cols)


def obs_update(weight: Tensor, fisher: Tensor, keep: Tensor) -> Tensor:
    """The optimal weights for mask ``keep``: ``F_KK⁻¹ (F w)_K`` per block on ``K``, ``+0.0`` elsewhere (float64).

    One batched Cholesky solve of ``[[F_KK, 0], [0, I]] x = [(F w)_K, 0]`` per block, so every block is solved at
    once whatever its number of kept weights.
    """
    rows, cols = weight.shape
    block = fisher.shape[-1]
    w = weight.detach().to(torch.float64).reshape(-1, block, 1)
    k = keep.reshape(-1, block).to(torch.float64)
    system = fisher * (k.unsqueeze(-1) * k.unsqueeze(-2))
    system.diagonal(dim1=-2, dim2=-1).add_(1.0 - k)
    rhs = (fisher @ w).squeeze(-1) * k
    out = torch.cholesky_solve(rhs.unsqueeze(-1), torch.linalg.cholesky(system)).squeeze(-1)
    return out.masked_fill_(k == 0, 0.0).reshape(rows, cols)


@cache
def _subsets(size: int, n: int) -> Tensor:
    """All ``n``-subsets of ``range(size)`` in lexicographic order, ``(C(size, n), n)`` int64 (CPU)."""
    return torch.tensor(list(itertools.combinations(range(size), n)), dtype=torch.int64).reshape(-1, n)


def _solve_small(a: Tensor, b: Tensor) -> Tensor:
    """Solve ``a x = b`` for batches of tiny SPD systems: closed form for 1 × 1 and 2 × 2, LAPACK beyond."""
    n = a.shape[-1]
    if n == 1:
        return b / a[..., 0]
    if n == 2:
        a00, a01, a10, a11 = a[..., 0, 0], a[..., 0, 1], a[..., 1, 0], a[..., 1, 1]
        det = a00 * a11 - a01 * a10
        return torch.stack([(a11 * b[..., 0] - a01 * b[..., 1]) / det, (a00 * b[..., 1] - a10 * b[..., 0]) / det], -1)
    return torch.linalg.solve(a, b.unsqueeze(-1)).squeeze(-1)


def _exact_groups(
    fisher: Tensor, w: Tensor, candidates: Tensor | None, n: int, eligible: Tensor
) -> tuple[Tensor, Tensor]:
    """Per group, the ``n`` of ``candidates`` kept at least OBS cost, and their updated values.

    ``fisher`` ``(G, M, M)``, ``w`` ``(G, M)`` float64; ``candidates`` ``(G, C)`` positions in each group, or
    ``None`` for all ``M`` (the same subsets for every group: plain index selects, no per-group index tensors);
    ``eligible`` ``(G, M)`` bool. Returns ``keep`` ``(G, M)`` bool and ``values`` ``(G, M)`` float64 (``+0.0``
    off ``keep``). Groups are processed in chunks that bound the ``(groups, subsets, n, n)`` scratch.
    """
    groups, m = w.shape
    combos = _subsets(m if candidates is None else candidates.shape[1], n).to(w.device)  # (S, n)
    subsets = combos.shape[0]
    u = (fisher @ w.unsqueeze(-1)).squeeze(-1)  # (G, M) = F w
    keep = torch.zeros(groups, m, dtype=torch.bool, device=w.device)
    values = torch.zeros(groups, m, dtype=torch.float64, device=w.device)
    shared_pairs = (combos.unsqueeze(-1) * m + combos.unsqueeze(-2)).reshape(-1)  # flat (i, j) of every F_KK
    chunk = max(1, _CHUNK_ELEMENTS // (subsets * n * n))
    for start in range(0, groups, chunk):
        sl = slice(start, start + chunk)
        g = min(chunk, groups - start)
        flat_fisher = fisher[sl].reshape(g, m * m)
        if candidates is None:
            f_kk = flat_fisher.index_select(1, shared_pairs).view(g, subsets, n, n)
            u_k = u[sl].index_select(1, combos.reshape(-1)).view(g, subsets, n)
            valid = eligible[sl].index_select(1, combos.reshape(-1)).view(g, subsets, n).all(-1)
        else:
            pos = candidates[sl][:, combos]  # (g, S, n) positions in the group
            pairs = (pos.unsqueeze(-1) * m + pos.unsqueeze(-2)).reshape(g, -1)
            f_kk = flat_fisher.gather(1, pairs).view(g, subsets, n, n)
            u_k = u[sl].gather(1, pos.reshape(g, -1)).view(g, subsets, n)
            valid = eligible[sl].gather(1, pos.reshape(g, -1)).view(g, subsets, n).all(-1)
        x = _solve_small(f_kk, u_k)
        gain = (u_k * x).sum(-1)  # u_Kᵀ F_KK⁻¹ u_K: larger is a smaller loss increase
        best = gain.masked_fill(~valid, float("-inf")).argmax(-1)  # first maximum: lexicographic tie-break
        rows = torch.arange(g, device=w.device)
        chosen = combos[best] if candidates is None else pos[rows, best]  # (g, n)
        keep[sl].scatter_(1, chosen, True)
        values[sl].scatter_(1, chosen, x[rows, best])
    return keep, values


def _greedy_keep(inverse: Tensor, w: Tensor, eligible: Tensor, m: int, n: int) -> Tensor:
    """Greedy OBS inside blocks of ``B`` weights: keep ``n`` of every ``m``, removing one weight per iteration.

    ``inverse`` ``(nb, B, B)`` = ``F⁻¹`` per block, ``w`` ``(nb, B)`` float64, ``eligible`` ``(nb, B)``. Ineligible
    weights go first; then, among groups that still keep more than ``n``, the weight of least saliency
    ``w_q² / (2 [F⁻¹]_qq)``; ``w`` and ``F⁻¹`` are updated by the exact OBS step after each removal
    (``w -= F⁻¹[:, q] w_q / F⁻¹_qq``, ``F⁻¹ -= F⁻¹[:, q] F⁻¹[q, :] / F⁻¹_qq``). Loops over removals (``B − B/m·n``),
    never over blocks.
    """
    blocks, size = w.shape
    inverse, w = inverse.clone(), w.clone()
    keep = torch.ones(blocks, size, dtype=torch.bool, device=w.device)
    rows = torch.arange(blocks, device=w.device)
    for _ in range(size - size // m * n):
        diag = inverse.diagonal(dim1=-2, dim2=-1)
        saliency = w.square() / (2 * diag.clamp_min(torch.finfo(torch.float64).tiny))
        saliency = saliency.masked_fill(~eligible, float("-inf"))  # forced removals first
        at_quota = (keep.view(blocks, size // m, m).sum(-1) <= n).repeat_interleave(m, dim=1)
        saliency = saliency.masked_fill(~keep | at_quota, float("inf"))
        q = saliency.argmin(-1)
        column = inverse[rows, :, q]  # (nb, B)
        pivot = column[rows, q]
        w -= column * (w[rows, q] / pivot).unsqueeze(-1)
        inverse -= column.unsqueeze(-1) * column.unsqueeze(-2) / pivot.view(-1, 1, 1)
        keep[rows, q] = False
        w[rows, q] = 0.0
        inverse[rows, q, q] = 1.0  # removed: keep the diagonal positive (its row and column are now zero)
    return keep


def _can_enumerate(size: int, n: int, block: int, m: int, max_subsets: int) -> bool:
    return block == m and math.comb(size, n) <= max_subsets


def obs_prune(
    weight: Tensor,
    fisher: Tensor,
    pattern: Pattern,
    *,
    eligible: Tensor | None = None,
    threshold: float | None = None,
    max_subsets: int = MAX_SUBSETS,
) -> tuple[Tensor, Tensor]:
    """The OBS mask of ``weight`` (logical ``(R, K)``) for ``pattern`` and the updated weights.

    ``fisher`` is :func:`damped_fisher`'s ``(R·K/B, B, B)``; ``eligible`` (bool ``(R, K)``) the weights that may be
    kept (the previous mask of a ramp; ``None``: all); ``threshold`` a global unstructured saliency threshold.
    Returns ``(mask, new_weight)``: ``new_weight`` has ``weight``'s dtype and ``+0.0`` wherever ``mask`` is False.
    """
    rows, cols = weight.shape
    block = fisher.shape[-1]
    w = weight.detach().to(torch.float64)
    if eligible is None:
        eligible = torch.ones(rows, cols, dtype=torch.bool, device=weight.device)
    eligible = eligible.to(weight.device)
    if isinstance(pattern, NM):
        n, m = pattern.n, pattern.m
        if _can_enumerate(m, n, block, m, max_subsets):
            keep, values = _exact_groups(fisher, w.reshape(-1, m), None, n, eligible.reshape(-1, m))
            return keep.reshape(rows, cols), values.reshape(rows, cols).to(weight.dtype)
        keep = _greedy_keep(_inverse(fisher), w.reshape(-1, block), eligible.reshape(-1, block), m, n)
    elif isinstance(pattern, VNM):
        v, n, m, c = pattern.v, pattern.n, pattern.m, pattern.keep_cols
        saliency = obs_saliency(weight, fisher).reshape(rows // v, v, cols // m, m)
        in_block = eligible.reshape(rows // v, v, cols // m, m)
        column_score = saliency.sum(dim=1).masked_fill(~in_block.any(dim=1), float("-inf"))
        columns = _top_k_last_dim(column_score, c).unsqueeze(1)  # (R/v, 1, K/m, m)
        row_eligible = (columns & in_block).reshape(rows, cols)
        if n >= c:
            keep = columns.expand(-1, v, -1, -1).reshape(rows, cols)
        elif _can_enumerate(c, n, block, m, max_subsets):
            # the block's c kept columns, in increasing order, as every row's candidates
            order = torch.argsort((~columns).to(torch.int8), dim=-1, stable=True)[..., :c]
            candidates = order.expand(-1, v, -1, -1).reshape(-1, c)
            keep, values = _exact_groups(fisher, w.reshape(-1, m), candidates, n, row_eligible.reshape(-1, m))
            return keep.reshape(rows, cols), values.reshape(rows, cols).to(weight.dtype)
        else:
            inverse = _inverse(fisher)
            keep = _greedy_keep(inverse, w.reshape(-1, block), row_eligible.reshape(-1, block), m, n)
        keep = keep.reshape(rows, cols)
    elif isinstance(pattern, Unstructured):
        saliency = obs_saliency(weight, fisher).masked_fill(~eligible, float("-inf"))
        keep = unstructured_mask(saliency, pattern.sparsity, threshold)
    else:
        raise TypeError(f"OBS pruning: unknown pattern type {type(pattern).__name__}")
    keep = keep.reshape(rows, cols)
    return keep, obs_update(weight, fisher, keep).to(weight.dtype)
