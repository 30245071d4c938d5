"""The compact switch inside training: once masks are final, pruned layers hold their kept values only, and the run
continues exactly as the masked dense run (``SparsityConfig(score="magnitude", compact=False)``) would have."""

from __future__ import annotations

import copy
import json
import logging
import struct
import time

import pytest
import torch
from conftest import ToyClassification, tiny_config
from helpers import StopAt, prune_now, torch_compile_runs, trainer_args
from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback

from hf_sparse import SparseLinear, SparseTrainer, SparsityCallback, SparsityConfig, save_pretrained
from hf_sparse.compaction import make_compact

GRADUAL = dict(pattern="2:4", schedule="linear", start=0, end=6, update_every=3)  # levels 3:4 at 0, 2:4 at 6
ONESHOT = dict(pattern="64:2:8", schedule="oneshot", start=0)


def _model(family="bert"):
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_config(family))


def _recording(trainer_cls):
    class Recording(trainer_cls):
        """Records the full-precision loss of every micro-batch (Trainer logs it rounded)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append((loss[0] if return_outputs else loss).detach().clone())
            return loss

    return Recording


def _run(
    tmp_path,
    *,
    compact=True,
    family="bert",
    plain=False,
    schedule=GRADUAL,
    callbacks=(),
    resume=None,
    evaluate=False,
    fallback=None,
    **args,
):
    config = SparsityConfig(score="magnitude", **schedule, compact=compact, **(fallback or {}))
    settings = dict(max_steps=9, weight_decay=0.1, max_grad_norm=0.0, logging_steps=1, dataloader_drop_last=True)
    settings.update(args)
    common = dict(model=_model(family), args=trainer_args(tmp_path, **settings), train_dataset=ToyClassification())
    if evaluate:
        common["eval_dataset"] = ToyClassification(16)
    if plain:
        callback = SparsityCallback(config)
        trainer = _recording(Trainer)(**common, callbacks=[*callbacks, callback])
        trainer.pruner = callback.pruner
    else:
        trainer = _recording(SparseTrainer)(**common, sparsity_config=config, callbacks=list(callbacks))
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _pruner(trainer):
    return trainer.pruner  # plain Trainer: set by _run


def _kept_values(pruner, layer):
    """The layer's kept values in the compact order, from either form."""
    if layer.compact:
        return layer.module.weight.detach()
    flat = layer.weight.detach().reshape(-1)
    other = [m for m in pruner.layers if m.name == layer.name][0]
    return flat[torch.nonzero(pruner.masks[other.name].reshape(-1)).squeeze(1)]


def _assert_same_training(compact_trainer, dense_trainer):
    assert len(compact_trainer.losses) == len(dense_trainer.losses) > 0
    for step, (a, b) in enumerate(zip(compact_trainer.losses, dense_trainer.losses, strict=True)):
        assert torch.equal(a, b), f"loss of micro-batch {step}: {a.item()!r} != {b.item()!r}"
    cp, dp = _pruner(compact_trainer), _pruner(dense_trainer)
    pruned = set()
    for a, b in zip(cp.layers, dp.layers, strict=True):
        assert not b.compact, a.name
        assert torch.equal(cp.masks[a.name], dp.masks[b.name]), a.name
        dense = b.weight.detach().reshape(-1)
        if a.compact:
            values, index = a.module.weight.detach().reshape(-1), a.module.kept_index.long()
            assert torch.equal(values, dense[index]), a.name  # the kept weights, bit for bit
            assert int(torch.count_nonzero(dense)) <= values.numel()  # and nothing else survives in the dense run
        else:  # back on the masked dense path (the compact fallback)
            assert torch.equal(a.weight.detach().reshape(-1), dense), a.name
        pruned.add(f"{a.name}.weight")
    rest = dict(dense_trainer.model.named_parameters())
    for name, p in compact_trainer.model.named_parameters():
        if name not in pruned:
            assert torch.equal(p, rest[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, optim, plain",
    [
        ("bert", "adamw_torch", False),
        ("bert", "adamw_torch_fused", True),
        ("gpt2", "adamw_torch", False),  # Conv1D: state transposed to the logical (out, in) order
        ("bert", "sgd", False),
    ],
    ids=["bert-adamw", "bert-fused-adamw-Trainer", "gpt2-adamw", "bert-sgd-momentum"],
)
def test_switch_at_final_update_continues_the_masked_run_exactly(tmp_path, family, optim, plain):
    extra = {"optim_args": "momentum=0.9"} if optim == "sgd" else {}
    kwargs = dict(family=family, plain=plain, optim=optim, **extra)
    compact = _run(tmp_path / "compact", compact=True, **kwargs)
    dense = _run(tmp_path / "dense", compact=False, **kwargs)
    assert compact.state.global_step == 9
    assert all(layer.compact for layer in _pruner(compact).layers)
    _assert_same_training(compact, dense)
    # the optimizer carried the moved state: the compact Parameter has Adam moments / momentum of its own shape
    optimizer = getattr(compact.optimizer, "optimizer", compact.optimizer)
    layer = _pruner(compact).layers[0]
    state = optimizer.state[layer.module.weight]
    assert state and all(v.shape == layer.module.weight.shape for v in state.values() if v.dim() > 0)


@pytest.mark.slow
def test_oneshot_at_step_zero_is_compact_before_the_optimizer_exists(tmp_path):
    config = SparsityConfig(score="magnitude", **ONESHOT)
    trainer = SparseTrainer(
        model=_model(),
        args=trainer_args(tmp_path, max_steps=4),
        train_dataset=ToyClassification(),
        sparsity_config=config,
    )
    assert trainer.optimizer is None
    assert all(layer.compact and isinstance(layer.module, SparseLinear) for layer in trainer.pruner.layers)
    assert isinstance(trainer.model.bert.encoder.layer[0].output.dense, SparseLinear)
    compact = _run(tmp_path / "c", schedule=ONESHOT, max_steps=4)
    dense = _run(tmp_path / "d", schedule=ONESHOT, max_steps=4, compact=False)
    assert all(layer.compact for layer in _pruner(compact).layers)
    _assert_same_training(compact, dense)


def test_compact_layers_hold_kept_values_only(tmp_path):
    """Parameters, gradients (as the optimizer sees them) and optimizer state of pruned layers: nnz elements each."""
    seen = []

    class Count(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            pruner = _pruner(trainer_ref[0])
            for layer in pruner.layers:
                if not layer.compact:
                    continue
                nnz = int(pruner.masks[layer.name].sum())
                weight = layer.module.weight
                moments = [v for v in optimizer.optimizer.state[weight].values() if v.dim() > 0]
                seen.append((weight.numel(), weight.grad.numel(), *(v.numel() for v in moments), nnz))

    trainer_ref = []
    config = SparsityConfig(score="magnitude", **GRADUAL)
    trainer = SparseTrainer(
        model=_model(),
        args=trainer_args(tmp_path, max_steps=9, dataloader_drop_last=True),
        train_dataset=ToyClassification(),
        sparsity_config=config,
        callbacks=[Count()],
    )
    trainer_ref.append(trainer)
    trainer.train()
    assert seen  # steps 7-9 ran compact
    for counts in seen:
        assert len(counts) == 5 and len(set(counts)) == 1, counts  # param, grad, exp_avg, exp_avg_sq, nnz
    nnz = sum(int(m.sum()) for m in trainer.pruner.masks.values())
    dense = sum(layer.shape[0] * layer.shape[1] for layer in trainer.pruner.layers)
    assert nnz * 2 == dense


def test_dynamic_masks_and_compact_false_stay_dense(tmp_path):
    trainer = _run(tmp_path / "off", compact=False, max_steps=8)
    assert not any(layer.compact for layer in _pruner(trainer).layers)
    dynamic = dict(pattern="2:4", schedule="linear", start=0, end=4, update_every=2, dynamic=True)
    trainer = _run(tmp_path / "dyn", schedule=dynamic, max_steps=8)
    assert not any(layer.compact for layer in _pruner(trainer).layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cut, plain",
    [(4, False), (8, False), (8, True)],
    ids=["before-switch", "after-switch", "after-switch-Trainer+callback"],
)
def test_resume_across_the_switch_is_exact(tmp_path, cut, plain):
    """Checkpoints at 4 (dense layers, 3:4 masks) and 8 (compact since step 6); the plain Trainer loads the compact
    tensors of checkpoint-8 through the callback's load hook."""
    kwargs = dict(plain=plain, save_strategy="steps", save_steps=4, max_steps=10)
    whole = _run(tmp_path / "whole", **kwargs)
    _run(tmp_path / "cut", callbacks=[StopAt(cut)], **kwargs)
    resumed = _run(tmp_path / "cut", resume=str(tmp_path / "cut" / f"checkpoint-{cut}"), **kwargs)
    assert resumed.state.global_step == whole.state.global_step == 10
    assert whole.losses[-2:] == resumed.losses[-2:]
    for a, b in zip(_pruner(whole).layers, _pruner(resumed).layers, strict=True):
        assert a.compact and b.compact
        assert torch.equal(_pruner(whole).masks[a.name], _pruner(resumed).masks[b.name])
    resumed_params = dict(resumed.model.named_parameters())
    for name, p in whole.model.named_parameters():
        assert torch.equal(p, resumed_params[name]), name


def _safetensors_parts(folder):
    """(header, data bytes) of ``model.safetensors``: the header as a dict, because safetensors writes its metadata
    entries in a random order (a Rust HashMap: two saves of the same model differ there); everything else is bytes."""
    raw = (folder / "model.safetensors").read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def test_save_from_compact_equals_save_from_masked_dense(tmp_path):
    """The compact layer's tensors are the on-disk tensors: both forms write the same bytes (format_version 1)."""
    for pattern, extra in [("2:4", {"transposable": True}), ("64:2:8", {}), ("unstructured:0.7", {})]:
        model = _model("gpt2" if pattern == "64:2:8" else "bert")
        pruner = prune_now(model, pattern, **extra)
        save_pretrained(model, tmp_path / f"dense-{pattern}", pruner)
        compact_model = copy.deepcopy(model)
        compact_pruner = copy.copy(pruner)
        compact_pruner.layers = [copy.copy(layer) for layer in pruner.layers]
        for layer in compact_pruner.layers:
            layer.module = compact_model.get_submodule(layer.name)
        make_compact(compact_model, compact_pruner)
        assert all(isinstance(compact_model.get_submodule(layer.name), SparseLinear) for layer in pruner.layers)
        save_pretrained(compact_model, tmp_path / f"compact-{pattern}", compact_pruner)
        dense_file, compact_file = (tmp_path / f"{form}-{pattern}" for form in ("dense", "compact"))
        assert (dense_file / "config.json").read_bytes() == (compact_file / "config.json").read_bytes(), pattern
        assert _safetensors_parts(dense_file) == _safetensors_parts(compact_file), pattern
        assert b'"format_version": 1' in (tmp_path / f"compact-{pattern}" / "config.json").read_bytes()


def _bool_tensors(value, seen=None) -> list[torch.Tensor]:
    """Every bool tensor reachable from ``value`` through dicts, lists, tuples and plain objects' attributes (modules,
    whose tensors are the layers' own, are not entered)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, torch.nn.Module):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value] if value.dtype == torch.bool else []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return []
    return [t for item in items for t in _bool_tensors(item, seen)]


def test_compact_layers_own_their_masks(tmp_path):
    """Once a layer is compact its positions are its mask: the pruner keeps no bool copy (a GPU run would hold one
    byte per weight for nothing), reads decode the positions, and ``make_dense`` gives the pruner the same mask back."""
    from hf_sparse.compaction import make_dense

    model = _model("gpt2")  # Conv1D layers: the mask is in the logical (out, in) orientation whatever the storage
    pruner = prune_now(model, "2:4", transposable=True)
    before = {name: mask.clone() for name, mask in pruner.masks.items()}
    assert len(_bool_tensors(pruner)) >= len(before) > 0  # the dense layers' masks are the pruner's
    make_compact(model, pruner)
    assert all(layer.compact for layer in pruner.layers)
    assert _bool_tensors(pruner) == []
    first = pruner.layers[0].name
    assert pruner.masks[first] is not pruner.masks[first]  # decoded on each read, not stored
    for name, mask in before.items():
        assert torch.equal(pruner.masks[name], mask), name
    with pytest.raises(ValueError, match="make it dense first"):
        pruner.masks[first] = before[first]
    make_dense(model, pruner, {first})
    assert torch.equal(pruner.masks[first], before[first])
    layer = pruner.layers[0]
    with torch.no_grad():
        layer.module.weight.add_(1.0)  # every stored weight moves, pruned ones included
    pruner.apply()
    assert torch.equal(layer.weight.detach() != 0, before[first])  # the pruner masks it again


def test_load_best_model_from_before_the_switch(tmp_path):
    """The best checkpoint predates the switch: the compact layers go back to dense, with that checkpoint's masks."""

    class Probe(TrainerCallback):  # makes step 4 (3:4 masks, dense layers) the best checkpoint
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_probe"] = abs(state.global_step - 4)

    trainer = _run(
        tmp_path,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        load_best_model_at_end=True,
        metric_for_best_model="eval_probe",
        greater_is_better=False,
        callbacks=[Probe()],
        evaluate=True,
    )
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    assert trainer.pruner.level == 3 and not any(layer.compact for layer in trainer.pruner.layers)
    trainer.save_model(str(tmp_path / "out"))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert str(loaded.bert.encoder.layer[0].output.dense.pattern) == "3:4"


# ---------------------------------------------------------------------- never slower: the compact fallback
TIMED = dict(compact_fallback="always", compact_fallback_steps=2)  # warm-up 3 + 2 timed steps per path: 10 steps


class _Forms(TrainerCallback):
    """Records, per optimizer step, whether the pruned layers are compact; ``slow`` (a form, True = compact): sleeps
    inside the timed steps (3-4 compact, 8-9 dense) taken in that form, a real slowdown the comparison measures,
    larger than the noise of a loaded CPU, so its outcome is certain."""

    def __init__(self, slow: bool | None = None, seconds: float = 2.0) -> None:
        self.slow, self.seconds, self.forms = slow, seconds, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        compact = any(isinstance(module, SparseLinear) for module in model.modules())
        self.forms.append(compact)
        if compact == self.slow and state.global_step in (3, 4, 8, 9):
            time.sleep(self.seconds)


def _decisions(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "hf_sparse.compact_fallback" and "ms/step" in r.message
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, optim, plain, slow, choice",
    [
        ("bert", "adamw_torch", False, True, "dense"),
        ("bert", "adamw_torch_fused", True, False, "compact"),
        ("gpt2", "sgd", False, True, "dense"),  # Conv1D: state scattered back in the stored (in, out) layout
    ],
    ids=["bert-adamw-dense-wins", "bert-fused-adamw-Trainer-compact-wins", "gpt2-sgd-momentum-dense-wins"],
)
def test_fallback_times_both_paths_keeps_the_faster_and_trains_as_masked_dense(
    tmp_path, caplog, family, optim, plain, slow, choice
):
    """Steps 0-4 compact (3 warm-up, 2 timed), 5-9 masked dense (the same), then the faster; every step trains as the
    masked dense run does, bit for bit."""
    extra = {"optim_args": "momentum=0.9"} if optim == "sgd" else {}
    kwargs = dict(family=family, plain=plain, optim=optim, schedule=ONESHOT, max_steps=12, **extra)
    forms = _Forms(slow=slow)
    with caplog.at_level(logging.INFO, logger="hf_sparse"):
        timed = _run(tmp_path / "timed", fallback=TIMED, callbacks=[forms], **kwargs)
    assert forms.forms == [True] * 5 + [False] * 5 + [choice == "compact"] * 2
    decisions = _decisions(caplog)
    assert (
        len(decisions) == 1 and f"with the {'masked dense' if choice == 'dense' else 'compact'} layers" in decisions[0]
    )
    fallback = next(c for c in timed.callback_handler.callbacks if isinstance(c, SparsityCallback)).fallback
    assert fallback.choice == choice
    assert fallback.timings["compact"].steps == fallback.timings["dense"].steps == 2
    _assert_same_training(timed, _run(tmp_path / "dense", compact=False, **kwargs))
    optimizer = getattr(timed.optimizer, "optimizer", timed.optimizer)
    for layer in _pruner(timed).layers:  # the optimizer state follows the chosen form
        nnz = int(_pruner(timed).masks[layer.name].sum())
        moments = [v for v in optimizer.state[layer.module.weight].values() if v.dim() > 0]
        assert moments and all(
            v.numel() == (nnz if choice == "compact" else layer.module.weight.numel()) for v in moments
        )
        assert all(int(torch.count_nonzero(v)) <= nnz for v in moments)


@pytest.mark.slow
def test_resume_continues_the_fallback_exactly_without_measuring_again(tmp_path, caplog):
    """Dense wins (compact steps slowed). Checkpoint 6 is inside the measurement (dense warm-up): the resumed run
    times the rest and decides at the same step; checkpoint 12 is after the decision: the resumed run trains masked
    dense at once and measures nothing."""
    kwargs = dict(schedule=ONESHOT, fallback=TIMED, save_strategy="steps", save_steps=6, max_steps=14)
    whole = _run(tmp_path / "whole", callbacks=[_Forms(slow=True)], **kwargs)
    assert whole.sparsity_callback.fallback.choice == "dense"
    for cut, forms_after in [(6, [False] * 8), (12, [False] * 2)]:
        _run(tmp_path / f"cut{cut}", callbacks=[_Forms(slow=True), StopAt(cut)], **kwargs)
        caplog.clear()
        forms = _Forms(slow=True)
        with caplog.at_level(logging.INFO, logger="hf_sparse"):
            resumed = _run(
                tmp_path / f"cut{cut}",
                callbacks=[forms],
                resume=str(tmp_path / f"cut{cut}" / f"checkpoint-{cut}"),
                **kwargs,
            )
        assert forms.forms == forms_after, cut
        assert len(_decisions(caplog)) == (1 if cut == 6 else 0), cut
        assert resumed.sparsity_callback.fallback.choice == "dense"
        assert resumed.state.global_step == 14 and whole.losses[-2:] == resumed.losses[-2:], cut
        assert not any(layer.compact for layer in resumed.pruner.layers)
        resumed_params = dict(resumed.model.named_parameters())
        for name, p in whole.model.named_parameters():
            assert torch.equal(p, resumed_params[name]), (cut, name)


def test_torch_compile_comes_back_when_training_stops_on_an_exception(tmp_path):
    """A run that goes on eager (its checkpointed comparison chose the eager step) sets torch.compile aside from its
    first step; where training then stops on an exception, ``on_train_end`` does not run, and ``SparseTrainer.train``
    brings torch.compile back itself."""

    class Crash(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.eager = not torch_compile_runs()
            if state.global_step == 2:
                raise RuntimeError("a crash inside training")

    crash = Crash()
    config = SparsityConfig(score="magnitude", **ONESHOT, compact_fallback="always")
    trainer = SparseTrainer(
        model=_model(), args=trainer_args(tmp_path, max_steps=6), train_dataset=ToyClassification(),
        sparsity_config=config, callbacks=[crash],
    )  # fmt: skip
    state = {"start": 0, "declined": None, "choice": "eager", "rival": "eager", "timings": {}}
    state["timings"] = {"compact": [50.0, 2], "eager": [30.0, 2]}
    trainer.sparsity_callback.fallback.load_state_dict(state)
    with pytest.raises(RuntimeError, match="a crash inside training"):
        trainer.train()
    assert crash.eager  # the run was eager when it crashed
    assert torch_compile_runs()
