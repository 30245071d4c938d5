"""OBS pruning: the choices and updates of hf_sparse.obs against an independent brute force of the same objective,
and a real Trainer run with score="obs"."""

import itertools

import pytest
import torch
from conftest import ToyClassification, tiny_config
from helpers import StopAt, trainer_args
from transformers import AutoModelForSequenceClassification, TrainerCallback

from hf_sparse import SparseTrainer, SparsityConfig
from hf_sparse.formats.compressed import compress
from hf_sparse.masks import nm_mask
from hf_sparse.obs import accumulate_fisher, damped_fisher, obs_prune, obs_saliency, obs_update
from hf_sparse.patterns import NM, VNM, Unstructured
from hf_sparse.scoring import ObsScore

DAMP = 0.05


def _problem(rows, cols, block, grads=6, seed=0):
    """Random weights, ``grads`` random gradients, and the damped Fisher blocks built independently here."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    g = torch.randn(grads, rows, cols, generator=gen, dtype=torch.float64) * torch.rand(1, 1, cols, generator=gen)
    blocks = g.reshape(grads, rows, cols // block, block)
    fisher = torch.einsum("trgi,trgj->rgij", blocks, blocks) / grads
    mean_diag = fisher.diagonal(dim1=-2, dim2=-1).mean()
    fisher = fisher + DAMP * mean_diag * torch.eye(block, dtype=torch.float64)
    return weight, g, fisher.reshape(-1, block, block)


def _brute_force_group(w, fisher, n, allowed=None):
    """Keep the ``n`` of the group minimising ½ w_Qᵀ (F⁻¹_QQ)⁻¹ w_Q; return (kept indices, updated group)."""
    inv = torch.linalg.inv(fisher)
    size = len(w)
    best = None
    for pruned in itertools.combinations(range(size), size - n):
        kept = [i for i in range(size) if i not in pruned]
        if allowed is not None and not all(allowed[i] for i in kept):
            continue
        q = list(pruned)
        inner = torch.linalg.inv(inv[q][:, q])
        loss = 0.5 * w[q] @ inner @ w[q]
        if best is None or loss < best[0]:
            new = w - inv[:, q] @ inner @ w[q]
            new[q] = 0.0
            best = (loss, kept, new)
    return best[1], best[2]


def _quadratic_loss(fisher_blocks, delta, block):
    d = delta.reshape(-1, block)
    return 0.5 * torch.einsum("bi,bij,bj->", d, fisher_blocks, d)


def test_damped_fisher_matches_definition():
    weight, g, expected = _problem(3, 16, 8)
    fisher_sum = None
    for grad in g:
        fisher_sum = accumulate_fisher(fisher_sum, grad.float(), 8)
    got = damped_fisher(fisher_sum, len(g), DAMP, weight, 8)
    assert got.shape == (6, 8, 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # no gradient: identity (OBS is then magnitude)
    assert torch.equal(damped_fisher(None, 0, DAMP, weight, 8), torch.eye(8, dtype=torch.float64).expand(6, 8, 8))


@pytest.mark.parametrize("n, m, rows", [(2, 4, 3), (2, 8, 3), (1, 4, 5), (3, 8, 2), (5, 8, 1)])
def test_nm_subsets_and_update_match_brute_force(n, m, rows):
    cols = 3 * m
    weight, _, fisher = _problem(rows, cols, m, seed=n * 10 + m)
    mask, new = obs_prune(weight, fisher, NM(n, m))
    groups = weight.reshape(-1, m)
    for i in range(groups.shape[0]):
        kept, expected = _brute_force_group(groups[i], fisher[i], n)
        assert mask.reshape(-1, m)[i].nonzero().flatten().tolist() == kept, i
        torch.testing.assert_close(new.reshape(-1, m)[i], expected, rtol=1e-9, atol=1e-12)
    assert (mask.reshape(-1, m).sum(-1) == n).all()
    assert not torch.signbit(new[~mask]).any() and (new[~mask] == 0).all()


def test_nested_levels_keep_pruned_weights_pruned():
    weight, _, fisher = _problem(4, 16, 8, seed=3)
    previous = obs_prune(weight, fisher, NM(4, 8))[0]
    mask, new = obs_prune(weight, fisher, NM(2, 8), eligible=previous)
    assert not (mask & ~previous).any()
    for i, group in enumerate(weight.reshape(-1, 8)):
        kept, expected = _brute_force_group(group, fisher[i], 2, allowed=previous.reshape(-1, 8)[i].tolist())
        assert mask.reshape(-1, 8)[i].nonzero().flatten().tolist() == kept
        torch.testing.assert_close(new.reshape(-1, 8)[i], expected, rtol=1e-9, atol=1e-12)


def test_obs_update_lowers_the_quadratic_loss():
    weight, _, fisher = _problem(6, 24, 8, seed=5)
    mask, new = obs_prune(weight, fisher, NM(2, 8))
    plain = weight * mask
    assert _quadratic_loss(fisher, new - weight, 8) < 0.8 * _quadratic_loss(fisher, plain - weight, 8)
    # and OBS's choice beats magnitude's mask, even with OBS's update applied to both
    magnitude = nm_mask(weight.abs(), 2, 8)
    best_for_magnitude = obs_update(weight, fisher, magnitude)
    assert _quadratic_loss(fisher, new - weight, 8) < _quadratic_loss(fisher, best_for_magnitude - weight, 8)


def test_without_gradients_obs_is_magnitude():
    weight = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    identity = damped_fisher(None, 0, DAMP, weight, 8)
    mask, new = obs_prune(weight, identity, NM(2, 8))
    assert torch.equal(mask, nm_mask(weight.abs(), 2, 8))
    assert torch.equal(new, weight * mask)


@pytest.mark.parametrize("n", [2, 1, 3])
def test_vnm_columns_by_summed_saliency_then_exact_rows(n):
    v, m, rows, cols = 2, 8, 4, 16
    weight, _, fisher = _problem(rows, cols, m, seed=11 + n)
    mask, new = obs_prune(weight, fisher, VNM(v, n, m))
    inv = torch.linalg.inv(fisher).reshape(rows, cols // m, m, m)
    saliency = weight.square() / (2 * inv.diagonal(dim1=-2, dim2=-1).reshape(rows, cols))
    for rb in range(rows // v):
        for g in range(cols // m):
            block = saliency[rb * v : (rb + 1) * v, g * m : (g + 1) * m].sum(0)
            columns = sorted(torch.topk(block, 4).indices.tolist())
            used = mask[rb * v : (rb + 1) * v, g * m : (g + 1) * m].any(0).nonzero().flatten().tolist()
            assert set(used) <= set(columns)
            for r in range(rb * v, (rb + 1) * v):
                group_fisher = fisher.reshape(rows, cols // m, m, m)[r, g]
                allowed = [i in columns for i in range(m)]
                kept, expected = _brute_force_group(weight[r, g * m : (g + 1) * m], group_fisher, n, allowed)
                assert mask[r, g * m : (g + 1) * m].nonzero().flatten().tolist() == kept
                torch.testing.assert_close(new[r, g * m : (g + 1) * m], expected, rtol=1e-9, atol=1e-12)
    compress(new, mask, VNM(v, n, m))  # raises unless the mask is a valid V:N:M mask


def test_vnm_column_levels_keep_whole_columns():
    weight, _, fisher = _problem(4, 16, 8, seed=2)
    mask, new = obs_prune(weight, fisher, VNM(2, 6, 8))
    blocks = mask.reshape(2, 2, 2, 8)
    assert (blocks[:, 0] == blocks[:, 1]).all() and (blocks.sum(-1) == 6).all()
    assert _quadratic_loss(fisher, new - weight, 8) < _quadratic_loss(fisher, weight * mask - weight, 8)


def _exact_update(weight, fisher, mask, block):
    """Independent OBS update for a given mask: w_K' = F_KK⁻¹ (F w)_K per block."""
    out = torch.zeros_like(weight).reshape(-1, block)
    for i, (w, keep) in enumerate(zip(weight.reshape(-1, block), mask.reshape(-1, block), strict=True)):
        k = keep.nonzero().flatten()
        out[i, k] = torch.linalg.solve(fisher[i][k][:, k], (fisher[i] @ w)[k])
    return out.reshape(weight.shape)


@pytest.mark.parametrize("pattern, block", [(NM(2, 4), 8), (VNM(2, 2, 4), 8), (NM(2, 8), 8)])
def test_greedy_fallback_is_valid_and_compensated(pattern, block):
    """Blocks larger than M (or too many subsets, forced here with max_subsets=1) use greedy OBS."""
    weight, _, fisher = _problem(4, 16, block, seed=13)
    previous = torch.rand(4, 16, generator=torch.Generator().manual_seed(1)) > 0.1
    previous = previous | nm_mask(torch.rand(4, 16), 3, 4)  # at least 3 of every 4 eligible
    eligible = previous if isinstance(pattern, NM) and pattern.m == 4 else None
    mask, new = obs_prune(weight, fisher, pattern, eligible=eligible, max_subsets=1)
    compress(new, mask, pattern)
    if eligible is not None:
        assert not (mask & ~eligible).any()
    torch.testing.assert_close(new, _exact_update(weight, fisher, mask, block), rtol=1e-9, atol=1e-12)
    plain = weight * mask
    assert _quadratic_loss(fisher, new - weight, block) < _quadratic_loss(fisher, plain - weight, block)


def test_unstructured_saliency_and_update():
    weight, _, fisher = _problem(4, 32, 16, seed=4)
    mask, new = obs_prune(weight, fisher, Unstructured(0.75))
    inv = torch.linalg.inv(fisher)
    saliency = weight.reshape(-1, 16).square() / (2 * inv.diagonal(dim1=-2, dim2=-1))
    torch.testing.assert_close(obs_saliency(weight, fisher), saliency.reshape(4, 32))
    expected = torch.zeros(4 * 32, dtype=torch.bool)
    expected[saliency.flatten().topk(32).indices] = True
    assert torch.equal(mask.flatten(), expected)
    torch.testing.assert_close(new, _exact_update(weight, fisher, mask, 16), rtol=1e-9, atol=1e-12)


def test_score_accumulates_and_resets():
    score = ObsScore(num_grads=4, damp=DAMP, pattern=NM(2, 8))
    weight, g, fisher = _problem(3, 16, 8, grads=4, seed=9)
    for grad in g:
        score.observe_gradient("layer", weight, grad.float())
    torch.testing.assert_close(score.fisher("layer", weight), fisher, rtol=1e-5, atol=1e-6)
    score.reset()
    with pytest.warns(UserWarning, match="no gradient observed"):
        assert torch.equal(score.fisher("layer", weight), torch.eye(8, dtype=torch.float64).expand(6, 8, 8))


def test_bf16_weights_keep_their_dtype_and_positive_zeros():
    weight, _, fisher = _problem(2, 8, 4, seed=6)
    mask, new = obs_prune(weight.to(torch.bfloat16), fisher, NM(2, 4))
    assert new.dtype == torch.bfloat16 and (new[~mask] == 0).all() and not torch.signbit(new[~mask]).any()


def test_pruner_ramp_nests_and_moves_kept_weights():
    """A gradual 2:8 ramp driven by hand: every level is a subset of the one before, pruned weights are +0.0, and
    the OBS update moved kept weights (magnitude pruning never does)."""
    from hf_sparse import Pruner

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    config = SparsityConfig(
        pattern="2:8", schedule="linear", start=1, end=7, update_every=1, score="obs", obs_num_grads=1
    )
    pruner = Pruner(model, config)
    pruner.bind(10)
    gen = torch.Generator().manual_seed(0)
    previous = None
    for step in range(8):
        before = {layer.name: layer.weight.detach().clone() for layer in pruner.layers}
        if pruner.update(step) and pruner.level is not None:
            for layer in pruner.layers:
                mask, weight = pruner.masks[layer.name], layer.weight.detach()
                assert (weight[~mask] == 0).all() and not torch.signbit(weight[~mask]).any()
                assert not torch.equal(weight[mask], before[layer.name][mask])  # compensated
                if previous is not None:
                    assert not (mask & ~previous[layer.name]).any(), (step, layer.name)
            previous = {name: mask.clone() for name, mask in pruner.masks.items()}
        for layer in pruner.layers:  # the step's gradient, masked as the grad hook would leave it
            grad = torch.randn(layer.module.weight.shape, generator=gen)
            mask = pruner.masks[layer.name]
            layer.module.weight.grad = grad if mask is None else grad.masked_fill(~mask, 0.0)
        pruner.before_optimizer_step(step)
    assert pruner.current_pattern() == NM(2, 8)


@pytest.mark.parametrize(
    "extra", [{"pattern": "2:4", "transposable": True}, {"pattern": "unstructured:0.7", "global_unstructured": True}]
)
def test_masks_the_pruner_builds_itself_are_compensated(extra):
    """Transposable 2:4 and global unstructured masks come from the OBS saliency, then get the OBS update."""
    from hf_sparse import Pruner

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    pruner = Pruner(model, SparsityConfig(schedule="oneshot", start=1, score="obs", obs_num_grads=4, **extra))
    pruner.bind(10)
    gen = torch.Generator().manual_seed(1)
    for layer in pruner.layers:  # the gradient of step 0, the one before the update at step 1
        layer.module.weight.grad = torch.randn(layer.module.weight.shape, generator=gen)
    pruner.before_optimizer_step(0)
    before = {layer.name: layer.weight.detach().clone() for layer in pruner.layers}
    assert pruner.update(1)
    zeros = total = 0
    for layer in pruner.layers:
        mask, weight = pruner.masks[layer.name], layer.weight.detach()
        assert (weight[~mask] == 0).all() and not torch.equal(weight[mask], before[layer.name][mask])
        zeros, total = zeros + int((~mask).sum()), total + mask.numel()
        if extra.get("transposable"):
            blocks = mask.reshape(mask.shape[0] // 4, 4, -1, 4)
            assert (blocks.sum(1) == 2).all() and (blocks.sum(3) == 2).all()
    if extra.get("global_unstructured"):
        assert zeros / total == pytest.approx(0.7, abs=1e-3)


# ----------------------------------------------------------------------------------------------- Trainer runs
def _args(tmp_path, **kwargs):
    return trainer_args(tmp_path, **kwargs)


def _model():
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_config("bert"))


class _CollectionProbe(TrainerCallback):
    """Records, after every optimizer step, how many gradients the real ObsScore holds for one layer."""

    def __init__(self):
        self.trainer = None
        self.counts = {}

    def on_step_end(self, args, state, control, **kwargs):
        counts = self.trainer.pruner.scorer._counts
        self.counts[state.global_step - 1] = counts.get("bert.encoder.layer.0.output.dense", 0)


@pytest.mark.parametrize("pattern", ["2:4", "64:2:8"])
def test_trainer_run_with_obs_reaches_the_exact_pattern(tmp_path, pattern):
    config = SparsityConfig(
        pattern=pattern, schedule="cubic", start=3, end=9, update_every=3, score="obs", obs_num_grads=2
    )
    probe = _CollectionProbe()
    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path),
        train_dataset=ToyClassification(),
        sparsity_config=config,
        callbacks=[probe],
    )
    probe.trainer = trainer
    trainer.train()
    pruner = trainer.pruner
    assert pruner.is_final and pruner.masks_final
    for layer in pruner.layers:  # compact since the final update at step 9: the kept values at the mask's positions
        assert layer.compact and torch.equal(layer.module.mask(), pruner.masks[layer.name])
        weight, mask = layer.module.dense_weight().detach(), pruner.masks[layer.name]
        assert (weight[~mask] == 0).all() and not torch.signbit(weight[~mask]).any()
        compress(weight, mask, pruner.current_pattern())
    # updates at 3 (nothing at target 0), 6 and 9: gradients gathered only in the 2 steps before 6 and 9
    gathered = {step for step, count in probe.counts.items() if count}
    assert gathered == {4, 5, 7, 8}, probe.counts
    assert probe.counts[5] == 2 and probe.counts[8] == 2  # the update at 6 reset them, then 7 and 8 are added
    # the masks differ from magnitude's on the same weights: the Fisher was used
    magnitude = SparseTrainer(
        model=_model(),
        args=_args(tmp_path / "mag"),
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(
            score="magnitude", pattern=pattern, schedule="cubic", start=3, end=9, update_every=3
        ),
    )
    magnitude.train()
    assert any(not torch.equal(pruner.masks[a.name], magnitude.pruner.masks[a.name]) for a in pruner.layers)


def _obs_run(tmp_path, stop_at=None, resume=None):
    config = SparsityConfig(
        pattern="2:8", schedule="cubic", start=2, end=14, update_every=3, score="obs", obs_num_grads=1
    )
    args = _args(tmp_path, max_steps=18, save_strategy="steps", save_steps=7, dataloader_drop_last=True)
    trainer = SparseTrainer(
        model=_model(),
        args=args,
        train_dataset=ToyClassification(),
        sparsity_config=config,
        callbacks=[StopAt(stop_at)] if stop_at else [],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_obs_resume_is_exact(tmp_path):
    """Checkpoint at step 7, outside a gradient window (obs_num_grads=1, updates at 2, 5, 8, …): exact."""
    whole = _obs_run(tmp_path / "whole")
    _obs_run(tmp_path / "cut", stop_at=7)
    resumed = _obs_run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-7"))
    assert resumed.pruner.level == whole.pruner.level == 2
    for layer in whole.pruner.layers:
        assert torch.equal(whole.pruner.masks[layer.name], resumed.pruner.masks[layer.name]), layer.name
    for (name, p), (_, q) in zip(whole.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", [NM(2, 4), NM(2, 8), VNM(64, 2, 16), Unstructured(0.5)])
def test_cuda_chooses_what_cpu_chooses(pattern):
    block = pattern.m if hasattr(pattern, "m") else 32
    weight, _, fisher = _problem(128, 256, block, grads=40, seed=21)
    mask_cpu, new_cpu = obs_prune(weight.float(), fisher, pattern)
    mask_gpu, new_gpu = obs_prune(weight.float().cuda(), fisher.cuda(), pattern)
    assert torch.equal(mask_cpu, mask_gpu.cpu())
    torch.testing.assert_close(new_cpu, new_gpu.cpu(), rtol=1e-5, atol=1e-6)
