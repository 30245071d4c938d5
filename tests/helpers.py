"""Shared test helpers: pruned tiny models without a Trainer, and the TrainingArguments of the tiny Trainer runs."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hf_sparse import Pruner, SparsityConfig


def prune_now(model, pattern: str = "2:4", **kwargs) -> Pruner:
    """Prune ``model`` in place, one shot, by magnitude unless ``score`` says otherwise (no calibration data here);
    returns the pruner."""
    kwargs.setdefault("score", "magnitude")
    config = SparsityConfig(pattern=pattern, schedule="oneshot", start=0, end=0, **kwargs)
    pruner = Pruner(model, config)
    pruner.bind(1)
    pruner.update(0)
    return pruner


@torch.compile(backend="eager", fullgraph=True)
def _compiled_or_not(x: torch.Tensor) -> torch.Tensor:
    """``x + 1`` where torch.compile runs this, ``x + 2`` where it is set aside (its Python runs as written)."""
    return x + 1 if torch.compiler.is_compiling() else x + 2


def torch_compile_runs() -> bool:
    """Whether torch.compile'd functions run compiled now, or are set aside (``torch.compiler.set_stance``)."""
    return _compiled_or_not(torch.zeros(1)).item() == 1


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out.start_logits


def trainer_args(output_dir, **overrides):
    """``TrainingArguments`` of the tests' tiny CPU Trainer runs: 12 steps, batch 8, no saving, no reporting."""
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(output_dir),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        weight_decay=0.1,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


class StopAt(TrainerCallback):
    """Stops training after optimizer step ``step``: an interrupted run, to resume from its checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def logical_weight(layer) -> torch.Tensor:
    """A pruner layer's logical (out, in) weight, dense or compact."""
    return layer.module.dense_weight().detach() if layer.compact else layer.weight.detach()
