"""``Pruner.apply(optimizer)``: once masks are final and the optimizer is elementwise, the optimizer state is zeroed
at pruned positions once and the masking pass after each step leaves the layer out; the weights must stay exactly
what masking every step gives."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_ids, tiny_config
from helpers import prune_now
from transformers import AutoModelForSequenceClassification

import hf_sparse.pruner as pruner_module

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def _model():
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_config("bert"))


def _step(model, opt, seed: int) -> None:
    torch.manual_seed(seed)  # the same dropout for the same step in both runs
    ids = random_ids(4, 12, seed=seed)
    model(input_ids=ids, labels=ids[:, 0] % 3).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _trained_then_pruned(make_opt):
    """A model whose optimizer state is non-zero everywhere (dense steps first), then pruned to its final masks."""
    model = _model()
    opt = make_opt(model.parameters())
    for seed in range(3):
        _step(model, opt, seed)
    return model, opt, prune_now(model, "2:4")


def _masked_weights(monkeypatch) -> list[int]:
    """Per apply_masks call of the pruner, how many tensors it masked."""
    counts: list[int] = []
    real = pruner_module.apply_masks

    def spy(pairs):
        pairs = list(pairs)
        counts.append(len(pairs))
        real(pairs)

    monkeypatch.setattr(pruner_module, "apply_masks", spy)
    return counts


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_settled_layers_keep_the_weights_that_masking_every_step_gives(name, monkeypatch):
    masked_model, masked_opt, masked_pruner = _trained_then_pruned(OPTIMIZERS[name])
    model, opt, pruner = _trained_then_pruned(OPTIMIZERS[name])
    counts = _masked_weights(monkeypatch)
    for seed in range(10, 16):
        _step(masked_model, masked_opt, seed)
        masked_pruner.apply()  # no optimizer: every layer masked, as before
        _step(model, opt, seed)
        pruner.apply(opt)
        for a, b in zip(masked_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        for layer in pruner.layers:
            assert (layer.weight[~pruner.masks[layer.name]] == 0).all()
    n = len(pruner.layers)
    # per step: masked_pruner.apply() masks n weights; pruner.apply(opt) zeroes the state (>= one tensor per weight)
    # and masks the n weights once more, then masks nothing
    steps = [counts[i : i + 3] for i in range(0, len(counts), 3)]
    assert steps[0][0] == n and steps[0][1] >= n and steps[0][2] == n, counts
    assert all(step == [n, 0, 0] for step in steps[1:]), counts


def test_without_the_state_zeroing_pruned_weights_would_move():
    """Why the state is zeroed: a pruned position's momentum from before the pruning moves its weight again."""
    model, opt, pruner = _trained_then_pruned(OPTIMIZERS["adamw"])
    _step(model, opt, 20)
    assert any((layer.weight[~pruner.masks[layer.name]] != 0).any() for layer in pruner.layers)


def test_new_state_new_mask_or_another_optimizer_mask_again(monkeypatch):
    model, opt, pruner = _trained_then_pruned(OPTIMIZERS["adamw"])
    counts = _masked_weights(monkeypatch)
    n = len(pruner.layers)
    for seed in range(2):
        _step(model, opt, seed)
        pruner.apply(opt)
    assert counts[-2:] == [0, 0]  # settled: no state zeroing, no weight masked
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a resumed optimizer: new state tensors
    _step(model, opt, 5)
    pruner.apply(opt)
    assert counts[-2] > 0 and counts[-1] == n
    first = pruner.layers[0].name
    pruner.masks[first] = pruner.masks[first].clone()  # a mask replaced (resume, best-model restore)
    _step(model, opt, 6)
    pruner.apply(opt)
    assert counts[-1] == 1
    other = torch.optim.Adagrad(model.parameters(), lr=1e-2)  # not known to be elementwise: masked every step
    _step(model, other, 7)
    pruner.apply(other)
    _step(model, other, 8)
    pruner.apply(other)
    assert counts[-1] == n
    for layer in pruner.layers:
        assert (layer.weight[~pruner.masks[layer.name]] == 0).all()
