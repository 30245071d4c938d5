"""Knowledge distillation from a dense teacher: the standard way to win back accuracy lost to pruning.

The sparse student is trained on ``(1 - alpha) * task_loss + alpha * kd_loss``, where ``kd_loss`` compares the
student's outputs with those of a dense, already fine-tuned teacher on the same batch (Hinton et al. 2015; used for
pruned BERT by oBERT, Kurtic et al. 2022, and by Sanh et al.'s movement pruning):

* classification logits (and the start/end logits of extractive QA, and token logits): KL divergence between the
  temperature-softened distributions, multiplied by ``T**2`` so its gradient scale does not depend on ``T``;
* a single regression output (STS-B): mean squared error.

Positions where the labels say "ignore" are not masked out: the teacher's distribution is informative everywhere,
and the QA and classification heads have no ignored positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOGIT_KEYS", "distillation_loss", "soft_cross_entropy"]

#: model-output fields that are distilled when both student and teacher return them
LOGIT_KEYS: tuple[str, ...] = ("logits", "start_logits", "end_logits")


def soft_cross_entropy(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """``T**2 * KL(softmax(teacher / T) || softmax(student / T))`` over the last dimension, averaged over the rest.

    Computed in float32 whatever the logits' dtype (bf16 log-softmax loses the small probabilities that carry the
    teacher's "dark knowledge").
    """
    t = temperature
    s_log = F.log_softmax(student.float() / t, dim=-1)
    t_log = F.log_softmax(teacher.float() / t, dim=-1)
    kl = (t_log.exp() * (t_log - s_log)).sum(-1)
    return kl.mean() * (t * t)


def distillation_loss(student_outputs: Any, teacher_outputs: Any, temperature: float = 2.0) -> Tensor:
    """Mean distillation loss over the logit fields (:data:`LOGIT_KEYS`) both outputs carry.

    Raises ``ValueError`` when they share none, or when a shared field differs in shape (teacher and student must
    have the same head: same ``num_labels``, same tokenizer).
    """
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")
    student_map = student_outputs if isinstance(student_outputs, Mapping) else {}
    teacher_map = teacher_outputs if isinstance(teacher_outputs, Mapping) else {}
    keys = [k for k in LOGIT_KEYS if student_map.get(k) is not None and teacher_map.get(k) is not None]
    if not keys:
        raise ValueError(
            f"distillation needs model outputs with one of {LOGIT_KEYS}; the student returned "
            f"{sorted(student_map)} and the teacher {sorted(teacher_map)}"
        )
    losses = []
    for key in keys:
        s, t = student_map[key], teacher_map[key].detach()
        if s.shape != t.shape:
            raise ValueError(
                f"distillation: student {key} has shape {tuple(s.shape)} but the teacher's is {tuple(t.shape)}; "
                "use a teacher with the same head (num_labels) and tokenizer"
            )
        if s.shape[-1] == 1:  # regression head
            losses.append(F.mse_loss(s.float(), t.float()))
        else:
            losses.append(soft_cross_entropy(s, t, temperature))
    return torch.stack(losses).mean()
