"""Wanda and SparseGPT on small problems: Wanda against numbers worked by hand, SparseGPT against a brute-force
solution of its objective ``min ‖(w − w') X‖²`` over every mask of the pattern and the kept values' least-squares
optimum."""

import itertools

import pytest
import torch

from hf_sparse.masks import nm_mask
from hf_sparse.patterns import NM, VNM, Unstructured
from hf_sparse.scoring import SparseGPTScore, WandaScore
from hf_sparse.sparsegpt import sparsegpt_prune


def test_wanda_score_and_mask_by_hand():
    # two batches of tokens; column norms sqrt(3²+4²)=5, sqrt(0+1)=1, sqrt(0+2²)=2, sqrt(1+0)=1
    w = torch.tensor([[1.0, -2.0, 3.0, -4.0], [4.0, 3.0, -2.0, 1.0]])
    score = WandaScore()
    score.observe_input("l", torch.tensor([[3.0, 0.0, 0.0, 1.0]]))
    score.observe_input("l", torch.tensor([[4.0, 1.0, 2.0, 0.0]]))
    expected = torch.tensor([[5.0, 2.0, 6.0, 4.0], [20.0, 3.0, 4.0, 1.0]])
    torch.testing.assert_close(score.score("l", w), expected)
    mask, new_weight = score.prune("l", w, NM(2, 4))
    assert new_weight is None  # Wanda does not move weights
    assert mask.tolist() == [[True, False, True, False], [True, False, True, False]]  # magnitude keeps 2,3 / 0,1
    # unstructured 50%: per output row (Wanda's comparison group), not per layer
    mask, _ = score.prune("l", w, Unstructured(0.5))
    assert mask.tolist() == [[True, False, True, False], [True, False, True, False]]
    # a weight pruned at an earlier level stays pruned
    previous = torch.tensor([[True, True, False, True], [True, True, True, True]])
    mask, _ = score.prune("l", w, NM(2, 4), previous)
    assert mask[0].tolist() == [True, False, False, True]


def _problem(seed: int, rows: int = 4, cols: int = 8, tokens: int = 64):
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(cols, dtype=torch.float64) + 0.3 * torch.randn(cols, cols, generator=g, dtype=torch.float64)
    scale = torch.rand(cols, generator=g, dtype=torch.float64) + 0.5
    x = torch.randn(tokens, cols, generator=g, dtype=torch.float64) @ mix * scale
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return w, x.T @ x


def _damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    return h


def _error(w, new, h) -> float:
    d = w - new
    return float(d @ h @ d)


def _best_error(w, h, keep) -> float:
    """The least-squares optimum of the kept values for mask ``keep`` (one row): ``wᵀHw − u_Kᵀ H_KK⁻¹ u_K``."""
    u = h @ w
    return float(w @ h @ w - u[keep] @ torch.linalg.solve(h[keep][:, keep], u[keep]))


def _nm_row_masks(n: int, m: int, groups: int):
    per_group = [[i in c for i in range(m)] for c in itertools.combinations(range(m), n)]
    return [torch.tensor(sum(choice, [])) for choice in itertools.product(per_group, repeat=groups)]


def test_sparsegpt_2of4_against_brute_force():
    """Over all 36 2:4 masks of 8-wide rows, SparseGPT's objective is at least the optimum (a lower bound, so the
    check is sound) and within 2.5x of it in total (its greedy left-to-right sweep freezes columns already done),
    and well below magnitude pruning's."""
    damp = 0.01
    totals = {"sparsegpt": 0.0, "optimum": 0.0, "magnitude": 0.0}
    masks = _nm_row_masks(2, 4, 2)
    for seed in range(12):
        w, h = _problem(seed)
        keep, new = sparsegpt_prune(w, h, NM(2, 4), damp=damp)
        hd = _damped(h, damp)
        assert keep.reshape(-1, 4).sum(-1).eq(2).all()
        assert (new[~keep] == 0).all()
        magnitude = nm_mask(w.abs(), 2, 4)
        for r in range(w.shape[0]):
            optimum = min(_best_error(w[r], hd, m) for m in masks)
            got = _error(w[r], new[r], hd)
            assert got >= optimum * (1 - 1e-6)
            totals["sparsegpt"] += got
            totals["optimum"] += optimum
            totals["magnitude"] += _error(w[r], w[r] * magnitude[r], hd)
    assert totals["sparsegpt"] <= 2.5 * totals["optimum"]
    assert totals["sparsegpt"] <= 0.75 * totals["magnitude"]


def test_sparsegpt_finds_the_optimum_with_uncorrelated_inputs():
    """Diagonal H: the objective separates per weight, so the best 2:4 mask keeps the largest ``w² H_jj`` and no
    update helps; SparseGPT must reach the brute-force optimum exactly."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, generator=g, dtype=torch.float64)
    h = torch.diag(torch.rand(8, generator=g, dtype=torch.float64) + 0.1)
    keep, new = sparsegpt_prune(w, h, NM(2, 4), damp=0.01)
    hd = _damped(h, 0.01)
    for r in range(3):
        optimum = min(_best_error(w[r], hd, m) for m in _nm_row_masks(2, 4, 2))
        assert _error(w[r], new[r], hd) == pytest.approx(optimum, rel=1e-5)


def test_sparsegpt_kept_values_are_the_least_squares_optimum_for_a_leading_mask():
    """With the pruned weights at the start of the row, the left-to-right sweep freezes nothing it should move:
    the kept values must equal the least-squares optimum for that mask."""
    w, h = _problem(5, rows=2, cols=8)
    mask = torch.tensor([[False, False, False, True, True, True, True, True]] * 2)
    _, new = sparsegpt_prune(w, h, None, mask=mask, damp=0.01, block_size=4)  # across a block boundary too
    hd = _damped(h, 0.01)
    for r in range(2):
        keep = mask[r]
        expected = torch.linalg.solve(hd[keep][:, keep], (hd @ w[r])[keep])
        torch.testing.assert_close(new[r][keep], expected, rtol=1e-5, atol=1e-6)
        assert (new[r][~keep] == 0).all()


def test_sparsegpt_vnm_against_brute_force():
    """A 2x8 block of 2:2:8 (2-row blocks): every choice of 4 columns then 2 of them per row (70 x 36 masks)."""
    damp = 0.01
    total = optimum_total = 0.0
    for seed in range(6):
        w, h = _problem(seed + 20, rows=2, cols=8)
        keep, new = sparsegpt_prune(w, h, VNM(2, 2, 8), damp=damp)
        columns = keep.any(0)
        assert int(columns.sum()) <= 4 and keep.sum(1).eq(2).all()  # rows pick 2 of the block's 4 columns
        hd = _damped(h, damp)
        best = float("inf")
        for cols in itertools.combinations(range(8), 4):
            per_row = 0.0
            for r in range(2):
                per_row += min(
                    _best_error(w[r], hd, torch.tensor([i in pair for i in range(8)]))
                    for pair in itertools.combinations(cols, 2)
                )
            best = min(best, per_row)
        got = sum(_error(w[r], new[r], hd) for r in range(2))
        assert got >= best * (1 - 1e-6)
        total += got
        optimum_total += best
    assert total <= 2.5 * optimum_total


def test_sparsegpt_unstructured_and_nested_levels():
    w, h = _problem(7, rows=4, cols=16)
    keep, new = sparsegpt_prune(w, h, Unstructured(0.5), damp=0.01, block_size=8)
    assert int(keep.sum()) == 32 and (new[~keep] == 0).all()
    hd = _damped(h, 0.01)
    # the update helps: better than zeroing the same weights without moving the rest
    assert sum(_error(w[r], new[r], hd) for r in range(4)) < sum(_error(w[r], w[r] * keep[r], hd) for r in range(4))
    # ramp: 2:4 after 3:4 keeps only weights the 3:4 mask kept
    keep34, new34 = sparsegpt_prune(w, h, NM(3, 4), damp=0.01)
    keep24, _ = sparsegpt_prune(new34, h, NM(2, 4), eligible=keep34, damp=0.01)
    assert not (keep24 & ~keep34).any()


def test_sparsegpt_score_needs_its_statistics():
    score = SparseGPTScore()
    with pytest.raises(RuntimeError, match="no calibration input reached layer 'l'"):
        score.prune("l", torch.ones(2, 4), NM(2, 4))
    score.observe_input("l", torch.randn(10, 4))
    score.share_statistics("k", "l")
    mask, new = score.prune("k", torch.randn(2, 4), NM(2, 4))
    assert mask.sum() == 4 and new.dtype == torch.float32
