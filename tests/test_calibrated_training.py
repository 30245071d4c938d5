"""Activation-aware scores inside a Trainer run (calibration batches from the training data, a mask update at every
step of a gradual ramp), and self-distillation from the model's own dense phase."""

import pytest
import torch
from conftest import ToyClassification, tiny_config
from helpers import logical_weight, trainer_args
from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback

from hf_sparse import SparseTrainer, SparsityCallback, SparsityConfig
from hf_sparse.formats.compressed import compress


def _model():
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_config("bert"))


class _CountCalibration(TrainerCallback):
    """Counts the calibration batches each mask update draws (wraps the source the sparsity callback set)."""

    def __init__(self, callback: SparsityCallback) -> None:
        self.callback = callback
        self.drawn: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        pruner = self.callback.pruner
        source = pruner.calibration
        if source is not None and not getattr(source, "counted", False):

            def counted():
                batches = list(source())
                self.drawn.append(len(batches))
                return batches

            counted.counted = True
            pruner.set_calibration(counted)


@pytest.mark.slow
@pytest.mark.parametrize("score, pattern", [("sparsegpt", "2:4"), ("wanda", "64:2:8")])
def test_gradual_activation_aware_pruning_with_a_plain_trainer(tmp_path, score, pattern):
    config = SparsityConfig(
        pattern=pattern, schedule="cubic", start=0, end=0.5, update_every=2, score=score, calibration_batches=3
    )
    callback = SparsityCallback(config)
    counter = _CountCalibration(callback)
    trainer = Trainer(
        model=_model(),
        args=trainer_args(tmp_path),
        train_dataset=ToyClassification(),
        callbacks=[callback, counter],
    )
    trainer.train()
    pruner = callback.pruner
    assert pruner.is_final
    for layer in pruner.layers:
        weight = logical_weight(layer)
        compress(weight, pruner.masks[layer.name], pruner.current_pattern())  # exact pattern
        assert (weight[~pruner.masks[layer.name]] == 0).all()
    # every update drew 3 batches of 8 from the training data: updates at steps 0, 2, 4 (and 6 for 64:2:8's ramp)
    assert counter.drawn[:-1] and all(n == 3 for n in counter.drawn)
    batch = next(iter(pruner.calibration()))
    assert batch["input_ids"].shape == (8, 12) and "labels" in batch


@pytest.mark.slow
def test_self_distillation_teacher_is_the_model_at_the_end_of_the_dense_phase(tmp_path):
    model = _model()
    config = SparsityConfig(pattern="2:4", schedule="oneshot", start=4, end=4, score="sparsegpt")
    snapshots = {}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 4:  # the weights with which step 4 (the pruning step) begins
                snapshots["dense"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    trainer = SparseTrainer(
        model=model,
        args=trainer_args(tmp_path),
        train_dataset=ToyClassification(),
        sparsity_config=config,
        self_distillation=True,
        distill_alpha=0.5,
        callbacks=[Record()],
    )
    assert trainer.teacher_model is None
    trainer.train()
    teacher = trainer.teacher_model
    assert teacher is not None and teacher is not model and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    for name, value in teacher.state_dict().items():
        torch.testing.assert_close(value, snapshots["dense"][name], rtol=0, atol=0)
    assert trainer.pruner.metrics()["sparsity"] == pytest.approx(0.5)


def test_self_distillation_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        SparseTrainer(
            model=_model(),
            args=trainer_args(tmp_path),
            sparsity_config=SparsityConfig(),
            teacher_model=_model(),
            self_distillation=True,
        )
    with pytest.raises(ValueError, match="needs a sparsity_config"):
        SparseTrainer(model=_model(), args=trainer_args(tmp_path), self_distillation=True)


def test_self_distillation_without_a_dense_phase_warns(tmp_path):
    trainer = SparseTrainer(
        model=_model(),
        args=trainer_args(tmp_path, max_steps=1),
        train_dataset=ToyClassification(),
        sparsity_config=SparsityConfig(pattern="2:4", schedule="oneshot", start=0, end=0),
        self_distillation=True,
    )
    with pytest.warns(UserWarning, match="before any fine-tuning"):
        trainer.train()
    assert trainer.teacher_model is not None


def test_a_run_without_calibration_data_stops_before_its_first_step(tmp_path):
    """The default score (SparseGPT) with no training dataloader to draw calibration batches from: the callback
    raises at train begin, naming the ways out, instead of at the first mask update hours later. With magnitude
    scores the same run starts."""
    from transformers import TrainerControl, TrainerState

    args = trainer_args(tmp_path)
    for config, starts in (
        (SparsityConfig(pattern="2:4"), False),
        (SparsityConfig(pattern="2:4", score="magnitude"), True),
    ):
        model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
        callback = SparsityCallback(config)
        callback.setup(model, 12)
        state, control = TrainerState(max_steps=12), TrainerControl()
        if starts:
            callback.on_train_begin(args, state, control, model=model)
            assert not callback.pruner.masks_final
        else:
            with pytest.raises(RuntimeError, match="needs calibration batches.*score='magnitude'"):
                callback.on_train_begin(args, state, control, model=model)
