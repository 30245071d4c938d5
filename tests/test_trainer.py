"""A real Trainer loop on tiny models: masks on schedule, exact zeros, metrics, resume, accumulation, dtypes."""

import json
import os

import pytest
import torch
from conftest import ToyClassification, tiny_config
from helpers import StopAt, logical_weight, trainer_args
from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback

import hf_sparse
from hf_sparse import SparseTrainer, SparsityCallback, SparsityConfig
from hf_sparse.callback import PRUNER_STATE_NAME
from hf_sparse.formats.compressed import compress


def _args(tmp_path, **kwargs):
    return trainer_args(tmp_path, **kwargs)


def _model(family="bert", dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_config(family)).to(dtype)


def _check_final_masks(pruner):
    pattern = pruner.current_pattern()
    assert pruner.is_final
    for layer in pruner.layers:
        mask = pruner.masks[layer.name]
        if layer.compact:  # the masks were final: the layer holds its kept values only, at the mask's positions
            layer.module.validate(layer.name)
            assert torch.equal(layer.module.mask(), mask) and str(layer.module.pattern) == str(pattern), layer.name
            continue
        weight = layer.weight.detach()
        pruned = weight[~mask]
        assert (pruned == 0).all() and not torch.signbit(pruned).any(), layer.name
        compress(weight, mask, pattern)  # raises unless the mask follows the pattern exactly


@pytest.mark.parametrize(
    "pattern, extra",
    [
        ("2:4", {}),
        ("2:4", {"transposable": True}),
        ("64:2:8", {}),
        ("unstructured:0.6", {}),
        ("unstructured:0.6", {"global_unstructured": True}),
    ],
)
def test_sparse_trainer_reaches_the_pattern(tmp_path, pattern, extra):
    model = _model()
    config = SparsityConfig(
        score="magnitude", pattern=pattern, schedule="cubic", start=0, end=0.5, update_every=2, **extra
    )
    trainer = SparseTrainer(
        model=model, args=_args(tmp_path), train_dataset=ToyClassification(), sparsity_config=config
    )
    before = {layer.name: layer.weight.detach().clone() for layer in trainer.pruner.layers}
    trainer.train()
    _check_final_masks(trainer.pruner)
    sparsity = trainer.pruner.layer_sparsity()
    target = hf_sparse.parse_pattern(pattern).sparsity
    if extra.get("global_unstructured"):
        total = sum(logical_weight(layer).numel() for layer in trainer.pruner.layers)
        zeros = sum(int((logical_weight(layer) == 0).sum()) for layer in trainer.pruner.layers)
        assert zeros / total == pytest.approx(target, abs=1e-3)
    else:
        assert all(value == pytest.approx(target, abs=1e-3) for value in sparsity.values())
    assert any(not torch.equal(before[layer.name], logical_weight(layer)) for layer in trainer.pruner.layers)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all("sparsity" in h for h in logs)
    assert logs[-1]["sparsity"] == pytest.approx(target, abs=1e-3)
    assert any(k.startswith("sparsity/bert.encoder.layer.0") for h in logs for k in h)
    assert all(layer.compact for layer in trainer.pruner.layers)  # the masks were final at step 6 of 12
    # the classifier head and embeddings stay dense
    assert (model.classifier.weight != 0).all() and (model.bert.embeddings.word_embeddings.weight[1:] != 0).all()


def test_gradual_levels_and_flip_rate_logged(tmp_path):
    config = SparsityConfig(score="magnitude", pattern="2:8", schedule="linear", start=0, end=12, update_every=2)
    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=14, logging_steps=1),
        train_dataset=ToyClassification(),
        sparsity_config=config,
    )
    trainer.train()
    targets = [h["sparsity_target"] for h in trainer.state.log_history if "sparsity_target" in h]
    assert targets == sorted(targets) and targets[-1] == 0.75
    assert set(targets) <= {1 - k / 8 for k in range(2, 8)}
    assert any("sparsity_flip_rate" in h for h in trainer.state.log_history)


def test_gradient_accumulation_and_clipping(tmp_path):
    config = SparsityConfig(score="magnitude", pattern="64:2:8", schedule="oneshot", start=0)
    seen = []

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            layer = model.bert.encoder.layer[0].intermediate.dense
            seen.append(bool((layer.weight.grad[layer.weight == 0] == 0).all()))

    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=0.5),
        train_dataset=ToyClassification(),
        sparsity_config=config,
        callbacks=[Probe()],
    )
    trainer.train()
    assert seen and all(seen)  # gradients at pruned positions are zero before the optimizer (and clipping) sees them
    _check_final_masks(trainer.pruner)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights(tmp_path, dtype):
    config = SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0)
    trainer = SparseTrainer(
        model=_model(dtype=dtype),
        args=_args(tmp_path, max_steps=4),
        train_dataset=ToyClassification(),
        sparsity_config=config,
    )
    trainer.train()
    _check_final_masks(trainer.pruner)
    trainer.save_model(str(tmp_path / "out"))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert loaded.bert.encoder.layer[0].output.dense.weight.dtype == dtype


def test_bf16_autocast(tmp_path):
    config = SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0)
    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=4, bf16=True),
        train_dataset=ToyClassification(),
        sparsity_config=config,
    )
    trainer.train()
    _check_final_masks(trainer.pruner)


def test_torch_compile(tmp_path):
    config = SparsityConfig(score="magnitude", pattern="2:4", schedule="linear", start=0, end=4, update_every=2)
    args = _args(tmp_path, max_steps=6, torch_compile=True, torch_compile_backend="aot_eager")
    trainer = SparseTrainer(model=_model(), args=args, train_dataset=ToyClassification(), sparsity_config=config)
    trainer.train()
    _check_final_masks(trainer.pruner)


class _MaskRecord(TrainerCallback):
    """The masks each optimizer step ran with, by ``state.global_step`` after the step (``None`` while dense)."""

    def __init__(self) -> None:
        self.pruner = None  # a callable: the pruner exists only once the trainer does (the callback's: once training)
        self.masks: dict[int, dict[str, torch.Tensor | None]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        masks = self.pruner().masks
        self.masks[state.global_step] = {n: None if m is None else m.clone() for n, m in masks.items()}


def _resume_run(tmp_path, trainer_cls, stop_at=None, resume=None):
    config = SparsityConfig(score="magnitude", pattern="2:8", schedule="cubic", start=2, end=14, update_every=3)
    args = _args(tmp_path, max_steps=18, save_strategy="steps", save_steps=7, dataloader_drop_last=True)
    record = _MaskRecord()
    callbacks = [record, StopAt(stop_at)] if stop_at else [record]
    if trainer_cls is SparseTrainer:
        trainer = SparseTrainer(
            model=_model(), args=args, train_dataset=ToyClassification(), sparsity_config=config, callbacks=callbacks
        )
        pruner = lambda: trainer.pruner  # noqa: E731
    else:
        callback = SparsityCallback(config)
        trainer = Trainer(
            model=_model(), args=args, train_dataset=ToyClassification(), callbacks=[*callbacks, callback]
        )
        pruner = lambda: callback.pruner  # noqa: E731
    record.pruner = pruner
    trainer.train(resume_from_checkpoint=resume)
    return trainer, pruner(), record.masks


@pytest.mark.slow
@pytest.mark.parametrize("trainer_cls", [SparseTrainer, Trainer], ids=["SparseTrainer", "Trainer+callback"])
def test_resume_is_exact(tmp_path, trainer_cls):
    whole, whole_pruner, whole_masks = _resume_run(tmp_path / "whole", trainer_cls)
    _resume_run(tmp_path / "cut", trainer_cls, stop_at=7)
    checkpoint = tmp_path / "cut" / "checkpoint-7"
    assert (checkpoint / PRUNER_STATE_NAME).is_file()
    # the masks at step 7 are an intermediate level (from the update at step 5): resuming must restore them. Step 7
    # must run with them too, not only the steps after the next update (step 8), which recomputes the masks from
    # the weights and so would hide a resume that dropped them: compare the masks of every resumed step.
    resumed, resumed_pruner, resumed_masks = _resume_run(tmp_path / "cut", trainer_cls, resume=str(checkpoint))
    assert resumed.state.global_step == whole.state.global_step == 18
    assert sorted(resumed_masks) == list(range(8, 19))
    for step, masks in resumed_masks.items():
        for name, mask in masks.items():
            expected = whole_masks[step][name]
            assert mask is not None and expected is not None and torch.equal(mask, expected), (step, name)
    assert (
        resumed_pruner.level == whole_pruner.level and resumed_pruner.last_update_step == whole_pruner.last_update_step
    )
    for a, b in zip(whole_pruner.layers, resumed_pruner.layers, strict=True):
        assert torch.equal(whole_pruner.masks[a.name], resumed_pruner.masks[b.name]), a.name
    for (name, p), (_, q) in zip(whole.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


class _CountSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps += 1


@pytest.mark.parametrize(
    "changed, match",
    [
        ({"targets": [r"intermediate\.dense"]}, r"targets=None but this run uses targets=\['intermediate"),
        ({"ignore": [r"attention"]}, r"ignore=None but this run uses ignore=\['attention'\]"),
        ({"pattern": "2:4"}, r"pattern='2:8' but this run uses pattern='2:4'"),
    ],
    ids=["targets", "ignore", "pattern"],
)
def test_resume_with_other_layers_or_pattern_is_refused_before_training(tmp_path, changed, match):
    """A resumed run whose SparsityConfig prunes other layers (or to another pattern) than the checkpoint's masks
    were saved for stops at resume, before any step, naming the fields, rather than failing in save_model."""
    saved = dict(pattern="2:8", schedule="oneshot", start=0)
    args = _args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    first = SparseTrainer(
        model=_model(),
        args=args,
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(score="magnitude", **saved),
        callbacks=[StopAt(2)],
    )
    first.train()
    counter = _CountSteps()
    resumed = SparseTrainer(
        model=_model(),
        args=args,
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(score="magnitude", **{**saved, **changed}),
        callbacks=[counter],
    )
    with pytest.raises(ValueError, match=match) as error:
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "Resume with the SparsityConfig the checkpoint was trained with" in str(error.value)
    assert counter.steps == 0


def test_resume_with_masks_for_layers_this_model_lacks_is_refused():
    from hf_sparse import Pruner

    config = SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0)
    two_blocks = Pruner(_model(), config)
    two_blocks.bind(1)
    two_blocks.update(0)
    one_block_config = tiny_config("bert")
    one_block_config.num_hidden_layers = 1
    one_block = Pruner(AutoModelForSequenceClassification.from_config(one_block_config), config)
    one_block.bind(1)
    with pytest.raises(
        ValueError, match=r"masks for 6 layer\(s\) this run does not prune \(bert\.encoder\.layer\.1\."
    ):
        one_block.load_state_dict(*two_blocks.state_dict())


def test_plain_trainer_callback_logs_and_saves_state(tmp_path):
    config = SparsityConfig(score="magnitude", pattern="64:2:8", schedule="oneshot", start=0)
    callback = SparsityCallback(config)
    args = _args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    trainer = Trainer(model=_model(), args=args, train_dataset=ToyClassification(), callbacks=[callback])
    trainer.train()
    assert any("sparsity" in h for h in trainer.state.log_history if "loss" in h)
    assert os.path.isfile(tmp_path / "checkpoint-4" / PRUNER_STATE_NAME)
    saved = json.loads((tmp_path / "checkpoint-4" / "hf_sparse_config.json").read_text())
    assert saved["pattern"] == "64:2:8"
    hf_sparse.save_pretrained(trainer.model, tmp_path / "out", callback.pruner)
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "out") is not None


def test_untileable_layer_is_left_dense_with_one_warning(tmp_path):
    config = tiny_config("bert")
    config.intermediate_size = 96  # 96 rows: not a multiple of v=64
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with pytest.warns(
        UserWarning, match=r"cannot tile 2 layer\(s\).*layer\.0\.intermediate\.dense.*out_features=96"
    ) as record:
        trainer = SparseTrainer(
            model=model,
            args=_args(tmp_path),
            train_dataset=ToyClassification(),
            sparsity_config=SparsityConfig(score="magnitude", pattern="64:2:8"),
        )
    assert len([r for r in record if "cannot tile" in str(r.message)]) == 1
    names = {layer.name for layer in trainer.pruner.layers}
    assert "bert.encoder.layer.0.intermediate.dense" not in names and "bert.encoder.layer.0.output.dense" in names


def test_untileable_layer_targeted_explicitly_raises(tmp_path):
    config = tiny_config("bert")
    config.intermediate_size = 96
    model = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match=r"layer\.0\.intermediate\.dense.*targeted explicitly"):
        SparseTrainer(
            model=model,
            args=_args(tmp_path),
            train_dataset=ToyClassification(),
            sparsity_config=SparsityConfig(score="magnitude", pattern="64:2:8", targets=[r"intermediate\.dense"]),
        )


def test_no_matching_layer_raises(tmp_path):
    with pytest.raises(ValueError, match="no layer matched"):
        SparseTrainer(
            model=_model(),
            args=_args(tmp_path),
            train_dataset=ToyClassification(),
            sparsity_config=SparsityConfig(score="magnitude", pattern="2:4", targets=["nothing_is_called_this"]),
        )


def test_wrong_sparsity_config_type(tmp_path):
    with pytest.raises(TypeError, match="SparsityConfig"):
        SparseTrainer(model=_model(), args=_args(tmp_path), train_dataset=ToyClassification(), sparsity_config="2:4")


@pytest.mark.parametrize("steps", [{"max_steps": 0}, {"max_steps": -1, "num_train_epochs": 0}])
def test_a_run_of_no_steps_says_so(tmp_path, steps):
    trainer = SparseTrainer(
        model=_model(),
        args=_args(tmp_path, **steps),
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(score="magnitude", pattern="2:4"),
    )
    with pytest.raises(ValueError, match="this training run has 0 optimizer steps.*set max_steps >= 1"):
        trainer.train()


def test_load_best_model_restores_its_masks(tmp_path):
    """With load_best_model_at_end, the best checkpoint can be from mid-ramp: its masks must come back with it."""
    config = SparsityConfig(score="magnitude", pattern="2:8", schedule="linear", start=0, end=10, update_every=2)
    args = _args(
        tmp_path,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        load_best_model_at_end=True,
        metric_for_best_model="eval_sparsity_probe",
        greater_is_better=False,
    )

    class Probe(TrainerCallback):  # makes step 4 the "best" checkpoint: the lowest value is logged there
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_sparsity_probe"] = abs(state.global_step - 4)

    trainer = SparseTrainer(
        model=_model(),
        args=args,
        train_dataset=ToyClassification(),
        eval_dataset=ToyClassification(16),
        sparsity_config=config,
        callbacks=[Probe()],
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    assert trainer.pruner.level > 2  # the mid-ramp level of step 4, not the final 2:8
    trainer.save_model(str(tmp_path / "out"))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert str(loaded.bert.encoder.layer[0].output.dense.pattern) == f"{trainer.pruner.level}:8"


def test_remove_hooks_stops_gradient_masking():
    from hf_sparse import Pruner

    model = _model()
    pruner = Pruner(model, SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0))
    pruner.bind(1)
    pruner.update(0)
    layer = model.bert.encoder.layer[0].output.dense

    def grad_at_pruned():
        model.zero_grad()
        model(input_ids=ToyClassification()[0]["input_ids"][None], labels=torch.tensor([1])).loss.backward()
        return layer.weight.grad[layer.weight == 0]

    assert (grad_at_pruned() == 0).all()
    pruner.remove_hooks()
    assert (grad_at_pruned() != 0).any()


def test_floating_point_ops_counts_the_model_once_per_form_of_its_layers(tmp_path):
    """``SparseTrainer``'s flos are ``Trainer``'s formula (6 x input tokens x non-embedding parameters) on the model as
    it is: every parameter while the masks still move, the kept values once the layers are compact, and the model is
    walked once per form of its layers, not on every step; ``total_flos`` sums them."""

    def non_embedding_parameters(model):
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)

    model = _model()
    dense = non_embedding_parameters(model)
    config = SparsityConfig(score="magnitude", pattern="2:4", schedule="cubic", start=0, end=0.5, update_every=1)
    trainer = SparseTrainer(
        model=model, args=_args(tmp_path, max_steps=6), train_dataset=ToyClassification(), sparsity_config=config
    )
    inputs = {"input_ids": torch.zeros(2, 7, dtype=torch.long)}
    assert trainer.floating_point_ops(inputs) == 6 * 14 * dense
    walks = []
    count = type(model).num_parameters
    model.num_parameters = lambda *a, **k: walks.append(k) or count(model, *a, **k)
    trainer.train()
    assert all(layer.compact for layer in trainer.pruner.layers)
    kept = non_embedding_parameters(model)
    assert kept < dense
    assert trainer.floating_point_ops(inputs) == 6 * 14 * kept
    assert walks == [{"exclude_embeddings": True}]  # once, at the first step after the layers turned compact
    tokens = 8 * 12  # a step: 8 sequences of 12 tokens
    assert 6 * 6 * tokens * kept < trainer.state.total_flos < 6 * 6 * tokens * dense
    assert (trainer.state.total_flos - 6 * 6 * tokens * kept) % (6 * tokens * (dense - kept)) == 0
