"""Dynamic masks: straight-through forward, masked decay, flip rate, dense fine-tuning phase, exact resume."""

import copy
import json

import pytest
import torch
from conftest import ToyClassification, random_ids, tiny_config
from helpers import StopAt, trainer_args
from torch import nn
from transformers import AutoModelForSequenceClassification, TrainerCallback

from hf_sparse import Pruner, SparseTrainer, SparsityConfig
from hf_sparse.dynamic import has_masked_forward


def _args(tmp_path, **kwargs):
    return trainer_args(tmp_path, **{"logging_steps": 2, **kwargs})


def _model(family="bert"):
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_config(family))


def _dynamic_pruner(model, pattern="2:4", **kwargs):
    config = SparsityConfig(score="magnitude", pattern=pattern, schedule="oneshot", start=0, dynamic=True, **kwargs)
    pruner = Pruner(model, config)
    pruner.bind(100)
    pruner.update(0)
    return pruner


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_forward_is_masked_and_every_weight_gets_the_masked_networks_gradient(family):
    model = _model(family)
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pruner = _dynamic_pruner(model)
    # the master weights are untouched: pruned positions keep their values
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    # the reference network has the masked weights as its (dense) parameters
    with torch.no_grad():
        for layer in pruner.layers:
            ref_weight = reference.get_submodule(layer.name).weight
            ref_weight.masked_fill_(~(pruner.masks[layer.name].T if layer.transposed else pruner.masks[layer.name]), 0)
    ids, labels = random_ids(4, 10, seed=3), torch.tensor([0, 1, 2, 1])
    model.train(False), reference.train(False)
    out, ref = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    out.loss.backward(), ref.loss.backward()
    for layer in pruner.layers:
        grad = model.get_submodule(layer.name).weight.grad
        ref_grad = reference.get_submodule(layer.name).weight.grad
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)  # straight-through: d/dW = d/d(W⊙mask)
        pruned = ~(pruner.masks[layer.name].T if layer.transposed else pruner.masks[layer.name])
        assert (grad[pruned] != 0).any(), layer.name
    assert not pruner.masks_final and pruner.is_final


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1, bias=False)


def test_masked_decay_hand_computed():
    model = _Tiny()
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[1.0, -2.0, 3.0, 0.5]]))
    pruner = _dynamic_pruner(model, targets=[r"^fc$"], masked_decay=0.1)
    assert pruner.masks["fc"].tolist() == [[False, True, True, False]]  # 2:4 keeps -2 and 3
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = model.fc(x)
    assert out.item() == pytest.approx(-2.0 * 2 + 3.0 * 3)  # the forward uses W ⊙ mask
    out.sum().backward()
    assert model.fc.weight.grad.tolist() == [[1.0, 2.0, 3.0, 4.0]]  # straight-through: x everywhere
    pruner.before_optimizer_step(0)
    # grad += 0.1 · (1 − mask) ⊙ W = 0.1 · [1, 0, 0, 0.5]
    torch.testing.assert_close(model.fc.weight.grad, torch.tensor([[1.1, 2.0, 3.0, 4.05]]))


def _independent_2of4(weight):
    """Top-2 |w| of each group of 4, ties to the lower index, by Python sorting."""
    keep = []
    for row in weight.abs().tolist():
        flags = []
        for g in range(0, len(row), 4):
            group = row[g : g + 4]
            top = sorted(range(4), key=lambda i: (-group[i], i))[:2]
            flags += [i in top for i in range(4)]
        keep.append(flags)
    return keep


def test_flip_rate_matches_an_independent_count():
    model = _model()
    config = SparsityConfig(
        score="magnitude", pattern="2:4", schedule="oneshot", start=0, update_every=3, dynamic=True
    )
    pruner = Pruner(model, config)
    pruner.bind(20)
    assert pruner.update(0) and pruner.flip_rate is None
    first = {layer.name: _independent_2of4(layer.weight.detach()) for layer in pruner.layers}
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in pruner.layers:  # move the dense weights: some masks must flip
            layer.weight.add_(0.02 * torch.randn(layer.weight.shape, generator=gen))
    assert not pruner.update(2) and pruner.update(3)  # dynamic updates every 3 steps after end (step 0)
    changed = total = 0
    for layer in pruner.layers:
        second = _independent_2of4(layer.weight.detach())
        assert pruner.masks[layer.name].tolist() == second, layer.name
        for row_a, row_b in zip(first[layer.name], second, strict=True):
            changed += sum(a != b for a, b in zip(row_a, row_b, strict=True))
            total += len(row_a)
    assert changed > 0
    assert pruner.flip_rate == changed / total
    assert pruner.metrics()["sparsity_flip_rate"] == changed / total
    assert pruner.metrics()["sparsity"] == pytest.approx(0.5)  # counted on W ⊙ mask, the master is dense


class _Probe(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.masked = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        pruner = self.trainer.pruner
        self.masked[state.global_step] = all(pruner.masks[layer.name] is not None for layer in pruner.layers)


def _dynamic_trainer(tmp_path, probe=None, **config_kwargs):
    kwargs = dict(pattern="2:4", schedule="linear", start=0, end=4, update_every=2, dynamic=True, masked_decay=1e-3)
    kwargs.update(config_kwargs)
    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path),
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(score="magnitude", **kwargs),
        callbacks=[probe] if probe else [],
    )
    if probe:
        probe.trainer = trainer
    return trainer


def test_trainer_dynamic_run_logs_flips_and_saves_masked_compressed_weights(tmp_path):
    trainer = _dynamic_trainer(tmp_path)
    trainer.train()
    pruner = trainer.pruner
    flips = [h for h in trainer.state.log_history if "sparsity_flip_rate" in h]
    assert flips and all(0 <= h["sparsity_flip_rate"] <= 1 for h in flips)
    assert pruner.last_update_step == 10  # still updating (6, 8, 10) after the ramp ended at step 4
    assert [h for h in trainer.state.log_history if "loss" in h][-1]["sparsity"] == pytest.approx(0.5)
    assert not pruner.masks_final
    stray = sum(int((layer.weight[~pruner.masks[layer.name]] != 0).sum()) for layer in pruner.layers)
    assert stray > 0  # the dense master keeps its pruned values
    trainer.save_model(str(tmp_path / "out"))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    ids = random_ids(3, 12, seed=4)
    model = trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


def test_dense_finetune_phase_drops_the_masks(tmp_path):
    probe = _Probe()
    trainer = _dynamic_trainer(tmp_path, probe, dense_finetune_start=8)
    trainer.train()
    assert probe.masked[7] and not any(probe.masked[s] for s in range(8, 12))
    pruner = trainer.pruner
    assert all(mask is None for mask in pruner.masks.values()) and pruner.level is None
    assert not any(has_masked_forward(layer.module) for layer in pruner.layers)
    assert pruner.metrics()["sparsity"] < 0.01  # dense again: pruned weights trained back
    trainer.save_model(str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config  # an ordinary dense checkpoint


def test_static_mode_installs_nothing():
    model = _model()
    pruner = Pruner(model, SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0))
    pruner.bind(10)
    pruner.update(0)
    assert not any(has_masked_forward(layer.module) for layer in pruner.layers)
    assert pruner.masks_final


def _resume_run(tmp_path, stop_at=None, resume=None):
    config = SparsityConfig(
        score="magnitude",
        pattern="2:8",
        schedule="cubic",
        start=2,
        end=5,
        update_every=3,
        dynamic=True,
        masked_decay=1e-2,
        dense_finetune_start=16,
    )
    args = _args(tmp_path, max_steps=18, save_strategy="steps", save_steps=7, dataloader_drop_last=True)
    trainer = SparseTrainer(
        model=_model(),
        args=args,
        train_dataset=ToyClassification(),
        sparsity_config=config,
        callbacks=[StopAt(stop_at)] if stop_at else [],
    )
    masks = {}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 15:
                masks.update({k: v.clone() for k, v in trainer.pruner.masks.items()})

    trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=resume)
    return trainer, masks


def test_dynamic_resume_is_exact(tmp_path):
    whole, whole_masks = _resume_run(tmp_path / "whole")
    _resume_run(tmp_path / "cut", stop_at=7)
    resumed, resumed_masks = _resume_run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-7"))
    assert whole_masks and whole_masks.keys() == resumed_masks.keys()
    for name, mask in whole_masks.items():
        assert torch.equal(mask, resumed_masks[name]), name  # the masks of the dynamic update at step 14 agree
    for (name, p), (_, q) in zip(whole.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert whole.pruner.level is None and resumed.pruner.level is None  # both ended in the dense phase


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"masked_decay": 0.1}, "needs dynamic=True"),
        ({"dense_finetune_start": 0.9}, "needs dynamic=True"),
        ({"dynamic": True, "end": 0.5, "dense_finetune_start": 0.4}, "must be after"),
        ({"dynamic": True, "masked_decay": -1.0}, ">= 0"),
        ({"obs_block_size": 6, "pattern": "2:4"}, "multiple of m=4"),
        ({"obs_damp": 0}, "> 0"),
    ],
)
def test_config_errors(kwargs, text):
    with pytest.raises(ValueError, match=text):
        SparsityConfig(score="magnitude", **kwargs)


def test_dense_phase_must_follow_the_ramp_once_bound():
    config = SparsityConfig(score="magnitude", pattern="2:4", start=0, end=10, dynamic=True, dense_finetune_start=0.5)
    with pytest.raises(ValueError, match="not after the end of the ramp"):
        Pruner(_model(), config).bind(16)  # 0.5 of 16 steps = step 8, before the ramp ends at 10


def test_torch_compile_with_moving_masks(tmp_path):
    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=8, torch_compile=True, torch_compile_backend="aot_eager"),
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(
            score="magnitude",
            pattern="2:4",
            schedule="linear",
            start=0,
            end=2,
            update_every=2,
            dynamic=True,
            masked_decay=1e-3,
        ),
    )
    trainer.train()
    pruner = trainer.pruner
    assert pruner.last_update_step == 6 and pruner.is_final
    model = trainer.model.eval()
    reference = copy.deepcopy(model)
    for layer in pruner.layers:
        remove = reference.get_submodule(layer.name)
        remove.__dict__.pop("forward", None)
        with torch.no_grad():
            remove.weight.masked_fill_(~pruner.masks[layer.name], 0)
    ids = random_ids(3, 12, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_dynamic_obs_compensates_kept_weights_and_keeps_pruned_masters():
    model = _model()
    config = SparsityConfig(pattern="2:4", schedule="oneshot", start=1, update_every=2, dynamic=True, score="obs")
    pruner = Pruner(model, config)
    pruner.bind(20)
    gen = torch.Generator().manual_seed(2)
    for layer in pruner.layers:
        layer.module.weight.grad = torch.randn(layer.module.weight.shape, generator=gen)
    pruner.before_optimizer_step(0)
    before = {layer.name: layer.weight.detach().clone() for layer in pruner.layers}
    assert pruner.update(1) and not pruner.masks_final
    for layer in pruner.layers:
        mask, weight = pruner.masks[layer.name], layer.weight.detach()
        assert torch.equal(weight[~mask], before[layer.name][~mask])  # the dense master keeps pruned values
        assert not torch.equal(weight[mask], before[layer.name][mask])  # OBS moved the kept ones
        assert has_masked_forward(layer.module)
