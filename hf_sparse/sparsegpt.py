"""Activation-aware pruning from calibration inputs: Wanda and SparseGPT, as pure tensor functions.

Both look at a layer ``y = W x`` (logical ``W`` of shape ``(R, K)``) through the inputs ``X`` (``T × K``, one row
per calibration token) it saw; :class:`hf_sparse.scoring.WandaScore` / :class:`~hf_sparse.scoring.SparseGPTScore`
collect the statistics and :mod:`hf_sparse.calibration` feeds them the inputs layer by layer.

**Wanda** (Sun et al. 2023) ranks ``|W_ij| · ‖X_j‖₂``: a weight matters as much as the inputs it multiplies. The
statistic is the per-feature sum of squares ``Σ_t x_tj²`` (``K`` floats per layer).

**SparseGPT** (Frantar & Alistarh 2023) minimises the layer's reconstruction error ``‖W X − W' X‖²`` over the
pattern's masks and the kept values. With ``H = Xᵀ X + λ I`` (``λ = damp · mean(diag H)``) it prunes the columns
left to right; pruning weight ``w_j`` of a row moves the row's columns to the right of ``j`` by the OBS update
``δ = −(w_j / U_jj) U_{j, j:}``, where ``U`` is the upper Cholesky factor of ``H⁻¹`` (``U_jj²`` is ``[H_F⁻¹]_jj``
for the columns ``F`` still to be processed). The mask is chosen on the fly from the saliency ``w_j² / U_jj²`` of
the *updated* weights:

* **N:M**: at the first column of every group of ``M``, the ``M − N`` of least saliency in each row are pruned;
* **V:N:M**: at the first column of every group, each ``V``-row block keeps the 4 columns of largest summed
  saliency over its rows, then each row keeps its ``N`` of those 4 of largest saliency;
* **unstructured**: in each block of ``block_size`` columns, the least salient ``sparsity`` fraction of the block;
* **a mask given** (transposable 2:4, which the pruner builds from :func:`sparsegpt_saliency`): the same column
  sweep, pruning what the mask says.

The sweep runs in blocks of ``block_size`` columns (lazy batch updates: the columns to the right of a block are
updated once per block with one matrix product), float32 like the reference implementation. Memory per layer:
``H`` and ``U`` (``2 · K² · 4`` bytes: 4.7 MB at ``K = 768``, 75 MB at ``K = 3072``, 970 MB at ``K = 11008``) and
one float32 copy of ``W``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import _top_k_last_dim, nm_mask, unstructured_mask
from .patterns import NM, VNM, Pattern, Unstructured

__all__ = [
    "accumulate_hessian",
    "accumulate_sq_norms",
    "inverse_cholesky",
    "sparsegpt_prune",
    "sparsegpt_saliency",
    "wanda_score",
]


def accumulate_sq_norms(sq_norms: Tensor | None, inputs: Tensor) -> Tensor:
    """Add ``Σ_t x_tj²`` of ``inputs`` (``(T, K)``) to ``sq_norms`` (float32 ``(K,)``, created on the first call)."""
    x = inputs.detach().to(torch.float32)
    if sq_norms is None:
        sq_norms = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    return sq_norms.add_(x.square().sum(0))


def accumulate_hessian(hessian: Tensor | None, inputs: Tensor) -> Tensor:
    """Add ``Xᵀ X`` of ``inputs`` (``(T, K)``) to ``hessian`` (float32 ``(K, K)``, created on the first call)."""
    x = inputs.detach().to(torch.float32)
    if hessian is None:
        hessian = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float32, device=x.device)
    return hessian.addmm_(x.T, x)


def wanda_score(weight: Tensor, sq_norms: Tensor) -> Tensor:
    """``|W_ij| · ‖X_j‖₂`` in float32, shaped like ``weight``."""
    return weight.detach().abs().to(torch.float32) * sq_norms.to(weight.device, torch.float32).sqrt().unsqueeze(0)


def inverse_cholesky(hessian: Tensor, damp: float) -> Tensor:
    """``U``: the upper Cholesky factor of ``(H + λ I)⁻¹``, ``λ = damp · mean(diag H)`` (float32).

    A Hessian with a zero diagonal (a layer no calibration token reached) becomes the identity: the saliency is then
    ``w²``, magnitude pruning, and the update moves nothing.
    """
    h = hessian.to(torch.float32).clone()
    mean_diag = float(h.diagonal().mean())
    if not mean_diag > 0:
        return torch.eye(h.shape[0], dtype=torch.float32, device=h.device)
    h.diagonal().add_(damp * mean_diag)  # also makes the diagonal of a feature no token used positive
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def sparsegpt_saliency(weight: Tensor, hessian: Tensor, damp: float = 0.01) -> Tensor:
    """SparseGPT's saliency of the unchanged weights, ``w_ij² / U_jj²`` (float32): what the pruner ranks when it
    builds a mask itself (transposable 2:4)."""
    diag = inverse_cholesky(hessian.to(weight.device), damp).diagonal()
    return weight.detach().to(torch.float32).square() / diag.square().unsqueeze(0)


def _vnm_select(saliency: Tensor, eligible: Tensor, pattern: VNM) -> Tensor:
    """Kept positions of one ``(R, M)`` column group: each ``V``-row block's ``keep_cols`` columns by summed
    saliency over its eligible rows, then ``N`` per row among those (ties to the lower index)."""
    rows, m = saliency.shape
    v, n, c = pattern.v, pattern.n, pattern.keep_cols
    blocks = saliency.reshape(rows // v, v, m)
    ok = eligible.reshape(rows // v, v, m)
    column_score = blocks.masked_fill(~ok, 0.0).sum(1, dtype=torch.float64)
    column_score = column_score.masked_fill(~ok.any(1), float("-inf"))
    columns = _top_k_last_dim(column_score, c).unsqueeze(1)  # (R/v, 1, M)
    if n >= c:
        keep = columns.expand(-1, v, -1)
    else:
        keep = _top_k_last_dim(blocks.masked_fill(~(columns & ok), float("-inf")), n) & columns
    return keep.reshape(rows, m)


def _select_group(saliency: Tensor, eligible: Tensor, pattern: Pattern) -> Tensor:
    """Kept positions of one ``(R, M)`` group of columns for an N:M or V:N:M pattern."""
    if isinstance(pattern, NM):
        return nm_mask(saliency.masked_fill(~eligible, float("-inf")), pattern.n, pattern.m)
    return _vnm_select(saliency, eligible, pattern)


@torch.no_grad()
def sparsegpt_prune(
    weight: Tensor,
    hessian: Tensor,
    pattern: Pattern | None,
    *,
    eligible: Tensor | None = None,
    mask: Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[Tensor, Tensor]:
    """SparseGPT on ``weight`` (logical ``(R, K)``) with ``hessian`` ``Σ Xᵀ X`` (``(K, K)``).

    ``pattern`` chooses the mask as the sweep goes (see the module docstring); ``mask`` (bool ``(R, K)``, True =
    keep) fixes it instead, and ``pattern`` is then ignored. ``eligible`` (the previous mask of a gradual ramp) are
    the only weights that may be kept. Returns ``(mask, new_weight)``, ``new_weight`` in ``weight``'s dtype with
    ``+0.0`` wherever ``mask`` is False.
    """
    rows, cols = weight.shape
    device = weight.device
    w = weight.detach().to(torch.float32).clone()
    u = inverse_cholesky(hessian.to(device), damp)
    if eligible is None:
        eligible = torch.ones(rows, cols, dtype=torch.bool, device=device)
    eligible = eligible.to(device)
    group = pattern.m if mask is None and isinstance(pattern, NM | VNM) else 1
    if mask is None and not isinstance(pattern, NM | VNM | Unstructured):
        raise TypeError(f"SparseGPT pruning: unknown pattern type {type(pattern).__name__}")
    block = max(group, block_size - block_size % group)
    keep = torch.ones(rows, cols, dtype=torch.bool, device=device) if mask is None else mask.to(device).bool()
    for start in range(0, cols, block):
        end = min(start + block, cols)
        w1 = w[:, start:end].clone()
        u1 = u[start:end, start:end]
        d = u1.diagonal()
        errors = torch.zeros_like(w1)
        if mask is None and isinstance(pattern, Unstructured):
            saliency = (w1.square() / d.square()).masked_fill(~eligible[:, start:end], float("-inf"))
            keep[:, start:end] = unstructured_mask(saliency, pattern.sparsity) & eligible[:, start:end]
        for i in range(end - start):
            j = start + i
            if mask is None and group > 1 and i % group == 0:
                sl = slice(i, i + group)
                saliency = w1[:, sl].square() / d[sl].square()
                keep[:, j : j + group] = _select_group(saliency, eligible[:, j : j + group], pattern)
            column = w1[:, i]
            error = column.masked_fill(keep[:, j], 0.0) / d[i]  # the pruned part of the column, scaled
            w1[:, i:] -= error.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, start:end] = w1
        w[:, end:] -= errors @ u[start:end, end:]
    w.masked_fill_(~keep, 0.0)
    return keep, (w + 0.0).to(weight.dtype)  # + 0.0 turns any -0.0 into +0.0
