"""Sparsity command-line flags shared by ``run_glue.py`` and ``run_qa.py``, and the recipe files that set them.

Every flag maps onto one ``hf_sparse.SparsityConfig`` field. Flags default to ``None`` ("not given") so that a
``--recipe`` file sets everything at once, any flag given on the command line overrides that recipe's value, and
whatever neither sets keeps ``SparsityConfig``'s own default. Without a pattern (from either) the run is dense and
uses a plain ``transformers.Trainer``, so the same script produces the dense baseline.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DistillationArguments",
    "SparsityArguments",
    "build_sparsity_config",
    "distillation_kwargs",
    "end_process_group",
    "load_recipe",
    "per_batch_mean_loss",
    "sparsity_config_kwargs",
    "trainer_class",
    "write_card",
]

#: command-line flag -> SparsityConfig field
FLAG_TO_CONFIG = {
    "sparsity_pattern": "pattern",
    "sparsity_schedule": "schedule",
    "sparsity_start": "start",
    "sparsity_end": "end",
    "sparsity_update_every": "update_every",
    "prune_targets": "targets",
    "prune_ignore": "ignore",
    "sparsity_score": "score",
    "transposable_masks": "transposable",
    "sparsity_obs_num_grads": "obs_num_grads",
    "sparsity_obs_damp": "obs_damp",
    "sparsity_obs_block_size": "obs_block_size",
    "sparsity_dynamic": "dynamic",
    "sparsity_masked_decay": "masked_decay",
    "sparsity_dense_finetune_start": "dense_finetune_start",
}


@dataclass
class SparsityArguments:
    """Sparsity flags; see ``hf_sparse.SparsityConfig`` for what each field does."""

    sparsity_pattern: str | None = field(
        default=None,
        metadata={"help": "Sparsity pattern: '2:4', '2:8', '64:2:8' (V:N:M), 'unstructured:0.75'. None = dense run."},
    )
    sparsity_schedule: str | None = field(
        default=None, metadata={"help": "How sparsity ramps up: 'oneshot', 'linear' or 'cubic'."}
    )
    sparsity_start: str | None = field(
        default=None,
        metadata={"help": "When pruning starts: a float in [0, 1] is a fraction of training, an integer a step."},
    )
    sparsity_end: str | None = field(
        default=None,
        metadata={"help": "When the final sparsity is reached: fraction of training (float) or step (integer)."},
    )
    sparsity_update_every: int | None = field(default=None, metadata={"help": "Recompute masks every N steps."})
    prune_targets: list[str] | None = field(
        default=None, metadata={"help": "Regexes of module names to prune (default: the transformer blocks' Linear)."}
    )
    prune_ignore: list[str] | None = field(
        default=None, metadata={"help": "Regexes of module names never to prune (e.g. the classifier)."}
    )
    sparsity_score: str | None = field(default=None, metadata={"help": "Importance score: 'magnitude' or 'obs'."})
    transposable_masks: bool | None = field(
        default=None,
        metadata={"help": "Use transposable 2:4 masks (sparse input gradients too).", "nargs": "?", "const": True},
    )
    sparsity_obs_num_grads: int | None = field(
        default=None, metadata={"help": "OBS: optimizer-step gradients averaged into the Fisher before each update."}
    )
    sparsity_obs_damp: float | None = field(
        default=None, metadata={"help": "OBS: dampening relative to the mean diagonal of each layer's Fisher."}
    )
    sparsity_obs_block_size: int | None = field(
        default=None, metadata={"help": "OBS: Fisher block length along a row (a multiple of M; default M)."}
    )
    sparsity_dynamic: bool | None = field(
        default=None,
        metadata={
            "help": "Dynamic masks: recomputed from the dense weights every update_every steps for the whole run, "
            "straight-through gradients to pruned weights.",
            "nargs": "?",
            "const": True,
        },
    )
    sparsity_masked_decay: float | None = field(
        default=None, metadata={"help": "Dynamic masks: masked decay lambda in grad += lambda * (1 - mask) * W."}
    )
    sparsity_dense_finetune_start: str | None = field(
        default=None,
        metadata={
            "help": "Dynamic masks: drop the masks and train dense from here on (fraction of training or step); "
            "the saved model is then dense."
        },
    )
    recipe: str | None = field(
        default=None,
        metadata={
            "help": "JSON or YAML file setting the sparsity fields at once; flags given on the command line win."
        },
    )


@dataclass
class DistillationArguments:
    """Distillation from a dense teacher fine-tuned on the same task (``hf_sparse.SparseTrainer(teacher_model=...)``)."""

    distill_from: str | None = field(
        default=None,
        metadata={"help": "Folder of a dense model fine-tuned on this task (same head and tokenizer): the teacher."},
    )
    distill_alpha: float = field(
        default=0.5, metadata={"help": "Weight of the distillation loss: (1 - a) * task loss + a * KD loss."}
    )
    distill_temperature: float = field(default=2.0, metadata={"help": "Softmax temperature of the KD loss."})


def distillation_kwargs(args: DistillationArguments, auto_cls, dtype: Any, sparse: bool) -> dict[str, Any]:
    """``SparseTrainer`` keyword arguments for ``--distill_from`` (empty without it). The teacher is loaded with
    ``auto_cls.from_pretrained`` in the student's dtype."""
    if args.distill_from is None:
        return {}
    if not sparse:
        raise ValueError(
            "--distill_from needs a sparse run (--sparsity_pattern or --recipe): it is a SparseTrainer option"
        )
    teacher = auto_cls.from_pretrained(args.distill_from, dtype=dtype)
    logger.info("distilling from %s (alpha %s, T %s)", args.distill_from, args.distill_alpha, args.distill_temperature)
    return {
        "teacher_model": teacher,
        "distill_alpha": args.distill_alpha,
        "distill_temperature": args.distill_temperature,
    }


def _parse_point(value: Any) -> Any:
    """'0.1' -> 0.1 (a fraction of training), '100' -> 100 (a step); numbers from a recipe pass through."""
    if not isinstance(value, str):
        return value
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"sparsity start/end '{value}' is neither a fraction of training (e.g. 0.1) nor a step (e.g. 500)"
        ) from None


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """Read a recipe (JSON, or YAML if PyYAML is installed) into ``SparsityConfig`` field names.

    Keys may be the config's names (``pattern``, ``start``) or the flags' (``sparsity_pattern``, ``prune_targets``);
    the sparsity keys may also sit under a top-level ``sparsity:`` section. Unknown keys are an error, so a typo
    does not silently train the wrong model.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in {".yaml", ".yml"}:
        try:
            import yaml
        except ImportError:
            raise ImportError(f"{path} is YAML: pip install pyyaml, or write the recipe as JSON") from None
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, dict) and isinstance(data.get("sparsity"), dict):
        data = data["sparsity"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe must be a mapping of sparsity settings, got {type(data).__name__}")
    allowed = set(FLAG_TO_CONFIG) | set(FLAG_TO_CONFIG.values())
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown recipe keys {unknown}; allowed: {sorted(FLAG_TO_CONFIG.values())}")
    return {FLAG_TO_CONFIG.get(k, k): v for k, v in data.items()}


def sparsity_config_kwargs(args: SparsityArguments) -> dict[str, Any] | None:
    """Merge recipe and flags into ``SparsityConfig`` keyword arguments; ``None`` for a dense run."""
    merged = load_recipe(args.recipe) if args.recipe else {}
    for f in fields(args):
        value = getattr(args, f.name)
        if f.name in FLAG_TO_CONFIG and value is not None:
            merged[FLAG_TO_CONFIG[f.name]] = value
    if merged.get("pattern") in (None, "", "dense", "none"):
        if len(merged) > 1 or (merged and "pattern" not in merged):
            logger.warning("sparsity settings %s given without a pattern: this run is dense", sorted(merged))
        return None
    for key in ("start", "end", "dense_finetune_start"):
        if key in merged:
            merged[key] = _parse_point(merged[key])
    return merged


def build_sparsity_config(kwargs: dict[str, Any]):
    """``hf_sparse.SparsityConfig(**kwargs)``; its validation names the bad value and what is allowed."""
    import hf_sparse

    return hf_sparse.SparsityConfig(**kwargs)


def parse_args_and_setup(model_cls, data_cls, argv: list[str] | None, logger: logging.Logger):
    """The start both example scripts share: parse the four argument groups (from argv, or from a single JSON/YAML
    file of all arguments, as the Transformers examples do), set up logging, build the sparsity config, seed.

    Returns ``(model_args, data_args, training_args, sparsity_config, distill_args)``; ``sparsity_config`` is
    ``None`` for a dense run.
    """
    import sys

    import datasets
    import transformers
    from transformers import HfArgumentParser, TrainingArguments, set_seed

    parser = HfArgumentParser((model_cls, data_cls, TrainingArguments, SparsityArguments, DistillationArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        loader = parser.parse_json_file if argv[0].endswith(".json") else parser.parse_yaml_file
        model_args, data_args, training_args, sparse_args, distill_args = loader(os.path.abspath(argv[0]))
    else:
        model_args, data_args, training_args, sparse_args, distill_args = parser.parse_args_into_dataclasses(args=argv)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    sparsity_kwargs = sparsity_config_kwargs(sparse_args)
    sparsity_config = build_sparsity_config(sparsity_kwargs) if sparsity_kwargs is not None else None
    logger.info("sparsity: %s", sparsity_kwargs or "none (dense run)")
    set_seed(training_args.seed)
    return model_args, data_args, training_args, sparsity_config, distill_args


def per_batch_mean_loss(model):
    """Tell ``Trainer`` that this model's loss is a per-batch mean, so it scales for gradient accumulation and for
    several processes itself.

    Sequence-classification and QA heads of the BERT family take ``**kwargs`` in ``forward``, so ``Trainer``
    (transformers 5) assumes they normalise by ``num_items_in_batch``; they do not (they average over the batch).
    ``Trainer`` then skips its division by the accumulation steps and multiplies the loss by the number of processes
    (``average_tokens_across_devices``): gradients come out ``k``-fold too large with ``k`` accumulation steps and
    doubled on two GPUs, which changes what gradient clipping does. ``accepts_loss_kwargs = False`` is the switch
    ``Trainer`` reads.
    """
    model.accepts_loss_kwargs = False
    return model


def trainer_class(sparse: bool):
    """``hf_sparse.SparseTrainer`` for a sparse run, ``transformers.Trainer`` for the dense baseline."""
    if not sparse:
        from transformers import Trainer

        return Trainer
    import hf_sparse

    if not hasattr(hf_sparse, "SparseTrainer"):
        raise ImportError("this hf_sparse has no SparseTrainer: install a release with training support")
    return hf_sparse.SparseTrainer


def end_process_group() -> None:
    """Destroy the process group ``torchrun`` runs start (``Trainer`` creates it): a process that exits with its
    group alive can abort at exit (SIGABRT, "terminate called without an active exception") after its work is
    done, because the backend's threads still hold work whose tensors are freed while Python shuts down."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def write_card(
    trainer, output_dir: str, *, sparse: bool, dense_bytes: int | None, model_name: str | None = None, **card_kwargs
) -> None:
    """Write the hf_sparse model card next to a sparse checkpoint (a dense run keeps Transformers' own card)."""
    if not sparse or not trainer.is_world_process_zero():
        return
    from hf_sparse.hub import model_card_kwargs_from_trainer, write_model_card

    kwargs = model_card_kwargs_from_trainer(trainer, dense_bytes=dense_bytes, **card_kwargs)
    try:
        path = write_model_card(output_dir, model_name=model_name or Path(output_dir).resolve().name, **kwargs)
    except Exception as exc:  # a card is documentation: never lose a finished training run over it
        logger.warning("could not write the model card: %s", exc)
        return
    logger.info("model card written to %s", path)
