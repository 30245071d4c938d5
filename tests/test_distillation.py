"""Distillation from a dense teacher: the loss against hand-computed values, and SparseTrainer's use of it."""

import copy
import math

import pytest
import torch
from conftest import ToyClassification, random_ids, tiny_config
from transformers import AutoModelForSequenceClassification, TrainingArguments
from transformers.modeling_outputs import QuestionAnsweringModelOutput, SequenceClassifierOutput

from hf_sparse import SparseTrainer, SparsityConfig
from hf_sparse.distillation import distillation_loss, soft_cross_entropy


def test_soft_cross_entropy_matches_hand_computed_kl():
    # teacher p = (3/4, 1/4) at T=1, student uniform: KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert soft_cross_entropy(student, teacher, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # T=2 halves the logits: p = (sqrt3, 1) / (sqrt3 + 1); the loss is scaled by T**2 = 4
    p = math.sqrt(3.0) / (math.sqrt(3.0) + 1.0)
    expected_t2 = 4.0 * (p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p)))
    assert soft_cross_entropy(student, teacher, 2.0).item() == pytest.approx(expected_t2, rel=1e-6)


def test_soft_cross_entropy_is_zero_only_for_equal_distributions():
    logits = torch.randn(5, 7)
    assert soft_cross_entropy(logits, logits, 3.0).item() == pytest.approx(0.0, abs=1e-6)
    assert soft_cross_entropy(logits + 5.0, logits, 3.0).item() == pytest.approx(0.0, abs=1e-5)  # shift-invariant
    assert soft_cross_entropy(torch.randn(5, 7), logits, 3.0).item() > 1e-3


def test_distillation_loss_averages_qa_heads_and_uses_mse_for_regression():
    s_start, s_end, t_start, t_end = (torch.randn(4, 30) for _ in range(4))
    qa = distillation_loss(
        QuestionAnsweringModelOutput(start_logits=s_start, end_logits=s_end),
        QuestionAnsweringModelOutput(start_logits=t_start, end_logits=t_end),
        temperature=2.0,
    )
    expected = (soft_cross_entropy(s_start, t_start, 2.0) + soft_cross_entropy(s_end, t_end, 2.0)) / 2
    assert qa.item() == pytest.approx(expected.item(), rel=1e-6)
    s, t = torch.randn(6, 1), torch.randn(6, 1)
    reg = distillation_loss(SequenceClassifierOutput(logits=s), SequenceClassifierOutput(logits=t))
    assert reg.item() == pytest.approx(((s - t) ** 2).mean().item(), rel=1e-6)


def test_distillation_loss_errors_name_the_problem():
    with pytest.raises(ValueError, match="same head"):
        distillation_loss(SequenceClassifierOutput(logits=torch.randn(2, 3)), {"logits": torch.randn(2, 2)})
    with pytest.raises(ValueError, match="one of"):
        distillation_loss({"hidden": torch.randn(2)}, {"hidden": torch.randn(2)})
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss({"logits": torch.randn(2, 2)}, {"logits": torch.randn(2, 2)}, temperature=0.0)


def _model(seed=0):
    torch.manual_seed(seed)
    config = tiny_config("bert")
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    return AutoModelForSequenceClassification.from_config(config)


def _trainer(tmp_path, model, **kwargs):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    config = SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=2, end=2)
    return SparseTrainer(model=model, args=args, train_dataset=ToyClassification(), sparsity_config=config, **kwargs)


def test_alpha_zero_trains_exactly_like_no_teacher(tmp_path):
    plain = _trainer(tmp_path / "plain", _model())
    plain.train()
    teacher = _model(seed=1)
    distilled = _trainer(tmp_path / "kd", _model(), teacher_model=teacher, distill_alpha=0.0)
    distilled.train()
    for (name, a), b in zip(plain.model.state_dict().items(), distilled.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_full_distillation_pulls_the_student_towards_the_teacher(tmp_path):
    teacher = _model(seed=1)
    student = _model(seed=0)
    ids = random_ids(16, 12, seed=5)

    def gap() -> float:
        with torch.no_grad():
            return soft_cross_entropy(student(input_ids=ids).logits, teacher(input_ids=ids).logits, 1.0).item()

    before = gap()
    trainer = _trainer(tmp_path, student, teacher_model=copy.deepcopy(teacher), distill_alpha=1.0)
    trainer.train()
    student.eval()
    assert gap() < 0.5 * before


def test_bad_distillation_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="distill_alpha"):
        _trainer(tmp_path, _model(), teacher_model=_model(seed=1), distill_alpha=1.5)
    with pytest.raises(ValueError, match="distill_temperature"):
        _trainer(tmp_path, _model(), teacher_model=_model(seed=1), distill_temperature=-1.0)
