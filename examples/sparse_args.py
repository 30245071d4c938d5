"""Sparsity command-line flags shared by ``run_glue.py`` and ``run_qa.py``, and the recipe files that set them.

Every flag maps onto one ``hf_sparse.SparsityConfig`` field. Flags default to ``None`` ("not given") so that a
``--recipe`` file sets everything at once, any flag given on the command line overrides that recipe's value, and
whatever neither sets keeps ``SparsityConfig``'s own default. Without a pattern (from either) the run is dense and
uses a plain ``transformers.Trainer``, so the same script produces the dense baseline.

``--recipe`` takes a file, or the name of one shipped in ``examples/recipes/`` (``--recipe prune_then_recover``).
A recipe may carry a ``distillation:`` section (``self_distill``, ``alpha``, ``temperature``) next to its
``sparsity:`` one; the ``--self_distill`` / ``--distill_alpha`` / ``--distill_temperature`` flags win over it.
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
    "available_recipes",
    "build_sparsity_config",
    "distillation_kwargs",
    "end_process_group",
    "load_recipe",
    "load_recipe_distillation",
    "merge_distillation",
    "per_batch_mean_loss",
    "resolve_recipe",
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
    "sparsity_calibration_batches": "calibration_batches",
    "sparsity_sparsegpt_damp": "sparsegpt_damp",
    "sparsity_kernels": "kernels",
    "sparsity_compact": "compact",
}
#: recipe ``distillation:`` key -> DistillationArguments field
RECIPE_DISTILLATION = {"self_distill": "self_distill", "alpha": "distill_alpha", "temperature": "distill_temperature"}
#: where ``--recipe NAME`` looks
RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


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
    sparsity_score: str | None = field(
        default=None,
        metadata={"help": "Importance score: 'magnitude', 'obs', or activation-aware 'wanda' / 'sparsegpt'."},
    )
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
    sparsity_calibration_batches: int | None = field(
        default=None,
        metadata={"help": "wanda/sparsegpt: training batches run through the model before each mask update."},
    )
    sparsity_sparsegpt_damp: float | None = field(
        default=None, metadata={"help": "sparsegpt: dampening relative to the mean diagonal of each layer's X^T X."}
    )
    sparsity_kernels: str | None = field(
        default=None,
        metadata={
            "help": "'auto': on CUDA, load (build on first use) the CUDA kernels at train start; 'never': do not. "
            "Compact 2:4 / V:2:M layers run on the kernels whatever this says: add --sparsity_compact false to "
            "train without the extension.",
            "choices": ["auto", "never"],
        },
    )
    sparsity_compact: bool | None = field(
        default=None,
        metadata={
            "help": "Turn pruned layers compact once their masks are final (default true); false keeps them dense "
            "and masked for the whole run.",
            "nargs": "?",
            "const": True,
        },
    )
    recipe: str | None = field(
        default=None,
        metadata={
            "help": "A recipe name from examples/recipes (prune_then_recover, gradual_sparsegpt, ...) or a JSON/YAML "
            "file setting the sparsity (and distillation) fields at once; flags given on the command line win."
        },
    )


@dataclass
class DistillationArguments:
    """Distillation from a dense teacher fine-tuned on the same task (``hf_sparse.SparseTrainer(teacher_model=...)``)."""

    distill_from: str | None = field(
        default=None,
        metadata={"help": "Folder of a dense model fine-tuned on this task (same head and tokenizer): the teacher."},
    )
    self_distill: bool | None = field(
        default=None,
        metadata={
            "help": "Self-distillation: the teacher is a frozen copy of this model taken when pruning begins (the end "
            "of the dense phase, SparsityConfig.start); no separate teacher run.",
            "nargs": "?",
            "const": True,
        },
    )
    distill_alpha: float | None = field(
        default=None, metadata={"help": "Weight of the distillation loss: (1 - a) * task loss + a * KD loss (0.5)."}
    )
    distill_temperature: float | None = field(
        default=None, metadata={"help": "Softmax temperature of the KD loss (2.0)."}
    )


#: DistillationArguments defaults when neither a flag nor the recipe sets them
DISTILLATION_DEFAULTS = {"self_distill": False, "distill_alpha": 0.5, "distill_temperature": 2.0}


def distillation_kwargs(args: DistillationArguments, auto_cls, dtype: Any, sparse: bool) -> dict[str, Any]:
    """``SparseTrainer`` keyword arguments for ``--distill_from`` or ``--self_distill`` (empty without either). The
    teacher of ``--distill_from`` is loaded with ``auto_cls.from_pretrained`` in the student's dtype."""
    if args.distill_from is None and not args.self_distill:
        return {}
    if not sparse:
        raise ValueError(
            f"{'--self_distill' if args.self_distill else '--distill_from'} needs a sparse run (--sparsity_pattern or "
            "--recipe): it is a SparseTrainer option"
        )
    if args.distill_from is not None and args.self_distill:
        raise ValueError("give --distill_from or --self_distill, not both")
    alpha = args.distill_alpha if args.distill_alpha is not None else DISTILLATION_DEFAULTS["distill_alpha"]
    temperature = args.distill_temperature
    temperature = temperature if temperature is not None else DISTILLATION_DEFAULTS["distill_temperature"]
    kwargs: dict[str, Any] = {"distill_alpha": alpha, "distill_temperature": temperature}
    if args.self_distill:
        logger.info("self-distillation from the dense phase (alpha %s, T %s)", alpha, temperature)
        return {"self_distillation": True, **kwargs}
    teacher = auto_cls.from_pretrained(args.distill_from, dtype=dtype)
    logger.info("distilling from %s (alpha %s, T %s)", args.distill_from, alpha, temperature)
    return {"teacher_model": teacher, **kwargs}


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


def available_recipes() -> list[str]:
    """Names of the recipes shipped in ``examples/recipes``."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.*") if p.suffix in {".yaml", ".yml", ".json"})


def resolve_recipe(recipe: str | os.PathLike) -> Path:
    """A recipe file: ``recipe`` itself if it exists, else the shipped recipe of that name."""
    path = Path(recipe)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for suffix in (".yaml", ".yml", ".json"):
            candidate = RECIPES_DIR / f"{recipe}{suffix}"
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"recipe {str(recipe)!r}: no such file, nor a shipped recipe {available_recipes()}")


def _read_recipe(path: str | os.PathLike) -> tuple[Path, Any]:
    path = resolve_recipe(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in {".yaml", ".yml"}:
        try:
            import yaml
        except ImportError:
            raise ImportError(f"{path} is YAML: pip install pyyaml, or write the recipe as JSON") from None
        return path, yaml.safe_load(text)
    return path, json.loads(text)


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """Read a recipe (JSON, or YAML if PyYAML is installed; a file or a shipped recipe's name) into
    ``SparsityConfig`` field names.

    Keys may be the config's names (``pattern``, ``start``) or the flags' (``sparsity_pattern``, ``prune_targets``);
    the sparsity keys may also sit under a top-level ``sparsity:`` section (next to an optional ``distillation:``
    one, see :func:`load_recipe_distillation`). Unknown keys are an error, so a typo does not silently train the
    wrong model.
    """
    path, data = _read_recipe(path)
    if isinstance(data, dict) and isinstance(data.get("sparsity"), dict):
        other = sorted(set(data) - {"sparsity", "distillation"})
        if other:
            raise ValueError(f"{path}: unknown recipe sections {other}; allowed: sparsity, distillation")
        data = data["sparsity"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe must be a mapping of sparsity settings, got {type(data).__name__}")
    from hf_sparse.config import check_known_keys

    check_known_keys(data, set(FLAG_TO_CONFIG) | set(FLAG_TO_CONFIG.values()), f"recipe {path}")
    return {FLAG_TO_CONFIG.get(k, k): v for k, v in data.items()}


def load_recipe_distillation(path: str | os.PathLike) -> dict[str, Any]:
    """A recipe's ``distillation:`` section as ``DistillationArguments`` field names (empty when it has none)."""
    path, data = _read_recipe(path)
    section = data.get("distillation") if isinstance(data, dict) else None
    if section is None:
        return {}
    unknown = sorted(set(section) - set(RECIPE_DISTILLATION)) if isinstance(section, dict) else None
    if unknown is None or unknown:
        raise ValueError(
            f"{path}: distillation keys {unknown or section!r} unknown; allowed: {sorted(RECIPE_DISTILLATION)}"
        )
    return {RECIPE_DISTILLATION[k]: v for k, v in section.items()}


def merge_distillation(args: DistillationArguments, recipe: str | None) -> DistillationArguments:
    """Fill the distillation flags not given on the command line from the recipe's ``distillation:`` section."""
    from_recipe = load_recipe_distillation(recipe) if recipe else {}
    for name, value in from_recipe.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.self_distill is None:
        args.self_distill = DISTILLATION_DEFAULTS["self_distill"]
    return args


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
    distill_args = merge_distillation(distill_args, sparse_args.recipe)
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
