"""Model cards for sparse checkpoints, and uploading an already-loaded sparse model to the Hugging Face Hub.

A sparse checkpoint is only useful if its reader knows three things the weights do not say: that it needs
``import hf_sparse`` to load, which pattern and schedule produced it, and what it cost in accuracy. The card
rendered here says all three (metadata that ``huggingface_hub.ModelCard`` parses, a per-layer sparsity table, size
against dense, evaluation metrics, measured speed-up where known, and a PNG of sparsity and the evaluation metric
over training when matplotlib is installed).

Everything takes explicit arguments, so ``SparseTrainer.save_model`` / ``push_to_hub`` and the example scripts
call the same functions, and tests need no trainer. :func:`push_to_hub` goes through ``HfApi.create_commit`` only
(one commit with every file), so the network boundary is a single method.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "PLOT_FILENAME",
    "HubUnreachableError",
    "dense_weight_bytes",
    "directory_weight_bytes",
    "find_template",
    "history_from_log_history",
    "layer_table_from_model",
    "model_card_kwargs_from_trainer",
    "push_to_hub",
    "render_model_card",
    "save_training_plot",
    "write_model_card",
    "written_pattern",
]

#: Name of the plot written next to README.md; the card links it relatively so it shows on the Hub.
PLOT_FILENAME = "sparsity_history.png"
_TEMPLATE_NAME = "README_TEMPLATE.md"
#: Eval metrics tried, in order, when no metric is named for the plot and the card summary.
_METRIC_PRIORITY = ("f1", "exact_match", "accuracy", "matthews_correlation", "pearson", "spearmanr", "exact", "loss")
_NON_METRICS = {"runtime", "samples_per_second", "steps_per_second", "epoch", "samples", "step", "total_flos"}
_TASK_PIPELINES = {
    "question-answering": ("question-answering", "AutoModelForQuestionAnswering"),
    "text-classification": ("text-classification", "AutoModelForSequenceClassification"),
    "token-classification": ("token-classification", "AutoModelForTokenClassification"),
    "text-generation": ("text-generation", "AutoModelForCausalLM"),
    "fill-mask": ("fill-mask", "AutoModelForMaskedLM"),
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ---------------------------------------------------------------------------------------------- helpers (sizes)


def directory_weight_bytes(path: str | os.PathLike) -> int:
    """Bytes of the weight files (``*.safetensors``, ``*.bin``) in a saved model directory."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.suffix in {".safetensors", ".bin"} and p.is_file())


def _logical_shape(module) -> tuple[int, ...] | None:
    """The dense ``(out, in)`` shape of a compressed layer (``SparseLinear``), ``None`` for any other module."""
    shape = getattr(module, "logical_shape", None)
    shape = shape() if callable(shape) else shape
    return tuple(shape) if shape is not None and hasattr(module, "compressed_tensors") else None


def dense_weight_bytes(model) -> int:
    """Bytes a dense checkpoint of ``model`` would take: its state dict, unshared, compressed layers at full size.

    It is the denominator of the card's "size against dense". A compressed layer (one with ``logical_shape`` and
    ``compressed_tensors``) counts as a dense ``(out, in)`` weight of its values' dtype, not as what it stores.
    """
    compressed = [module for module in model.modules() if _logical_shape(module) is not None]
    seen: set[int] = set()
    total = 0
    for module in compressed:
        total += math.prod(_logical_shape(module)) * module.compressed_tensors()["weight"].element_size()
        seen.update(t.data_ptr() for t in module.compressed_tensors().values())
    for tensor in model.state_dict().values():
        key = tensor.data_ptr() if tensor.numel() else id(tensor)
        if key in seen:
            continue  # tied weights are written once; compressed tensors were counted above
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def layer_table_from_model(model, *, pattern: str | None = None, min_sparsity: float = 0.2) -> dict[str, dict]:
    """Per-layer sparsity measured on a model: ``name -> {"pattern", "sparsity", "shape"}``.

    The same shape as ``Pruner.sparsity_report()``, for a model that was loaded rather than trained here. If the
    model has compressed layers, they are the table (with their mask's sparsity and pattern). Otherwise (a dense
    model with masked weights) every 2-D weight with at least ``min_sparsity`` zeros is listed; the threshold
    keeps out embeddings whose only zeros are a padding row.
    """
    table = {}
    for name, module in model.named_modules():
        shape = _logical_shape(module)
        if shape is not None:
            table[name] = {
                "pattern": str(getattr(module, "pattern", pattern) or "?"),
                "sparsity": 1.0 - float(module.mask().float().mean()),
                "shape": list(shape),
            }
    if table:
        return table
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(weight, "dim") or weight.dim() != 2 or weight.is_meta:
            continue
        sparsity = float((weight == 0).float().mean())
        if sparsity >= min_sparsity:
            table[name] = {"pattern": pattern or "?", "sparsity": sparsity, "shape": list(weight.shape)}
    return table


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "not recorded"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return str(n)  # pragma: no cover


# ----------------------------------------------------------------------------------------------- history + plot


def _sparsity_key(keys) -> str | None:
    """The log key that holds the model's overall sparsity (``"sparsity"``, else ``"sparsity/mean"``-like ones)."""
    keys = [k for k in keys if "sparsity" in k.lower()]
    if "sparsity" in keys:
        return "sparsity"
    for word in ("mean", "overall", "total", "model", "global"):
        for k in keys:
            if word in k.lower():
                return k
    return min(keys, key=len) if keys else None  # shortest: per-layer keys carry the layer name


def history_from_log_history(log_history: Sequence[Mapping], *, metric_key: str | None = None) -> dict[str, Any]:
    """Extract ``{"sparsity": [[step, value], ...], "metric": [[step, value], ...], "metric_name": str}``.

    ``log_history`` is ``trainer.state.log_history``. Sparsity is whatever the pruner logged under ``sparsity``
    (or a ``sparsity/mean``-like key); the metric is ``metric_key`` (``eval_`` prefix optional), else the first
    eval metric found among f1, exact_match, accuracy, Matthews, Pearson, Spearman, loss.
    """
    sparsity, metric = [], []
    if metric_key is None:
        eval_keys = {k for entry in log_history for k in entry if k.startswith("eval_")}
        metric_key = next((f"eval_{m}" for m in _METRIC_PRIORITY if f"eval_{m}" in eval_keys), None)
    elif not metric_key.startswith("eval_"):
        metric_key = f"eval_{metric_key}"
    for entry in log_history:
        step = entry.get("step")
        if step is None:
            continue
        key = _sparsity_key(entry.keys())
        if key is not None and isinstance(entry[key], (int, float)):
            sparsity.append([int(step), float(entry[key])])
        if metric_key is not None and isinstance(entry.get(metric_key), (int, float)):
            metric.append([int(step), float(entry[metric_key])])
    return {"sparsity": sparsity, "metric": metric, "metric_name": metric_key}


def save_training_plot(history: Mapping[str, Any], path: str | os.PathLike) -> Path | None:
    """Plot sparsity (left axis) and the eval metric (right axis) against the step into a PNG at ``path``.

    Returns the path, or ``None`` (with a logged note) when matplotlib is not installed or there is nothing to
    plot: a card without a plot is better than a failed ``save_model``.
    """
    if not history or not (history.get("sparsity") or history.get("metric")):
        logger.info("no sparsity or eval metric was logged during training: the model card has no plot")
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: the model card has no plot (pip install matplotlib to get one)")
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    if history.get("sparsity"):
        steps, values = zip(*history["sparsity"], strict=True)
        ax.plot(steps, values, color="tab:blue", drawstyle="steps-post", label="sparsity")
    ax.set_xlabel("training step")
    ax.set_ylabel("sparsity", color="tab:blue")
    ax.set_ylim(0.0, 1.0)
    if history.get("metric"):
        ax2 = ax.twinx()
        steps, values = zip(*history["metric"], strict=True)
        name = (history.get("metric_name") or "metric").removeprefix("eval_")
        ax2.plot(steps, values, color="tab:orange", marker="o", label=name)
        ax2.set_ylabel(f"eval {name}", color="tab:orange")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------------ the card


def written_pattern(folder: str | os.PathLike) -> str | None:
    """The pattern(s) of the checkpoint in ``folder`` as its ``config.json`` names them (``"2:4"``, or
    ``"2:4, 64:2:8"`` for a mix); ``None`` for a checkpoint without an hf_sparse ``quantization_config``."""
    path = Path(folder) / "config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    qdict = saved.get("quantization_config") or {}
    if qdict.get("quant_method") != "hf_sparse":
        return None
    patterns = qdict.get("patterns") or [qdict.get("pattern")]
    return ", ".join(str(p) for p in patterns if p) or None


def find_template(template: str | os.PathLike | None = None) -> Path:
    """The card template: ``template`` if given, else the package's copy, else ``model_cards/`` of a checkout."""
    candidates = [Path(template)] if template is not None else []
    here = Path(__file__).resolve().parent
    candidates += [here / "data" / "model_card_template.md", here.parent / "model_cards" / _TEMPLATE_NAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"model card template not found (looked at {', '.join(map(str, candidates))}); pass template=PATH or "
        "reinstall hf_sparse so that its data files are present"
    )


def _pattern_info(pattern: str | None) -> tuple[str | None, list[str]]:
    if not pattern:
        return None, []
    parts = str(pattern).split(":")
    if parts[0].lower() == "unstructured":
        return f"unstructured, {float(parts[1]):.0%} of each layer's weights are zero", ["unstructured-sparsity"]
    if len(parts) == 3:
        v, n, m = parts
        return (
            f"VENOM V:N:M: each block of {v} rows keeps the same 4 of every {m} columns, each row {n} of those 4",
            ["n:m", "v:n:m", "venom", f"sparsity-{pattern}"],
        )
    if len(parts) == 2:
        n, m = parts
        return f"{n} of every {m} consecutive weights kept in each row", ["n:m", f"sparsity-{pattern}"]
    return None, []


def _fmt_metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def _metric_items(metrics: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    items = []
    for key, value in (metrics or {}).items():
        short = key.split("_", 1)[1] if key.split("_", 1)[0] in {"eval", "test", "predict"} and "_" in key else key
        if short in _NON_METRICS or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        items.append((key, value))
    return items


def _schedule_rows(schedule: str | Mapping | None) -> list[tuple[str, str]]:
    if schedule is None:
        return []
    if isinstance(schedule, str):
        return [("Schedule", schedule)]
    names = {
        "schedule": "Schedule",
        "start": "Start",
        "end": "End",
        "update_every": "Update every (steps)",
        "score": "Score",
        "transposable": "Transposable masks",
    }
    return [(label, str(schedule[key])) for key, label in names.items() if schedule.get(key) is not None]


def _layer_rows(layer_table: Mapping[str, Mapping] | Sequence[Mapping] | None) -> tuple[list[dict], str]:
    if not layer_table:
        return [], "not recorded"
    if isinstance(layer_table, Mapping):
        layer_table = [{"name": name, **info} for name, info in layer_table.items()]
    rows, zeros, total = [], 0.0, 0
    for info in layer_table:
        shape = list(info.get("shape") or [])
        sparsity = float(info.get("sparsity", 0.0))
        numel = math.prod(shape) if shape else 0
        zeros, total = zeros + sparsity * numel, total + numel
        rows.append(
            {
                "name": info["name"],
                "shape": " × ".join(map(str, shape)) or "?",
                "pattern": info.get("pattern", "?"),
                "sparsity": f"{sparsity:.2%}",
            }
        )
    if total:
        overall = f"{zeros / total:.2%}"
    else:
        overall = f"{sum(float(i.get('sparsity', 0.0)) for i in layer_table) / len(layer_table):.2%} (layer mean)"
    return rows, overall


def _dense_reason(schedule: str | Mapping | None) -> str | None:
    """Why a checkpoint trained with a sparsity configuration holds no pruned layer."""
    if not isinstance(schedule, Mapping):
        return None
    if schedule.get("dense_finetune_start") is not None:
        return "the sparsity configuration below ends with dense fine-tuning, which drops the masks"
    return "training ended before the sparsity schedule below pruned any layer"


def _speedup_text(speedup: float | str | Mapping[str, Any] | None) -> str:
    if speedup is None:
        return "not measured"
    if isinstance(speedup, (int, float)):
        return f"{speedup:.2f}× against dense"
    if isinstance(speedup, Mapping):
        return "; ".join(f"{k}: {v:.2f}×" if isinstance(v, (int, float)) else f"{k}: {v}" for k, v in speedup.items())
    return str(speedup)


def render_model_card(
    *,
    base_model: str | None,
    task: str | None,
    dataset: str | None,
    pattern: str | None,
    schedule: str | Mapping[str, Any] | None,
    layer_table: Mapping[str, Mapping] | Sequence[Mapping] | None,
    checkpoint_bytes: int | None,
    dense_bytes: int | None,
    metrics: Mapping[str, Any] | None,
    speedup: float | str | Mapping[str, Any] | None = None,
    history: Mapping[str, Any] | None = None,
    plot_filename: str | None = None,
    repo_id: str | None = None,
    model_name: str | None = None,
    dataset_id: str | None = None,
    license: str | None = None,
    tags: Sequence[str] = (),
    template: str | os.PathLike | None = None,
) -> str:
    """Render the model card (YAML metadata + markdown) and return it as a string.

    ``pattern`` is the pattern the checkpoint's layers hold (``None``: a dense checkpoint, and the card says no
    layer is pruned); where ``schedule`` names another final pattern, the card says training ended before it.
    ``task`` is a pipeline name (``"text-classification"``, ``"question-answering"``; it picks the ``AutoModel``
    class in the loading snippet) or free text. ``schedule`` is a schedule name or ``SparsityConfig.to_dict()``.
    ``layer_table`` is ``Pruner.sparsity_report()`` (or a list of rows with a ``name``). ``metrics`` go into
    the table as given (e.g. ``eval_accuracy``); with ``dataset_id`` (a Hub dataset id such as ``nyu-mll/glue``)
    they also go into the ``model-index`` metadata. ``history`` (:func:`history_from_log_history`) only sets the
    plot's caption; write the plot with :func:`save_training_plot` and pass its file name as ``plot_filename``.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    from ._version import __version__

    pattern = str(pattern) if pattern is not None else None
    target = str(schedule.get("pattern")) if isinstance(schedule, Mapping) and schedule.get("pattern") else None
    pattern_description, pattern_tags = _pattern_info(pattern)
    pipeline_tag, auto_class = _TASK_PIPELINES.get(task or "", (None, "AutoModel"))
    metric_items = _metric_items(metrics)
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else None) or "sparse-model"

    base_is_repo = bool(base_model) and _REPO_ID.match(base_model) is not None and not os.path.exists(base_model)
    eval_results = None
    if dataset_id and metric_items and pipeline_tag:
        eval_results = [
            EvalResult(
                task_type=pipeline_tag,
                dataset_type=dataset_id,
                dataset_name=dataset or dataset_id,
                metric_type=key.removeprefix("eval_"),
                metric_value=value,
            )
            for key, value in metric_items
            if not key.endswith("loss")  # a loss is not a benchmark result
        ] or None
    all_tags = ["hf_sparse", *(["sparsity", "pruning"] if pattern else []), *pattern_tags, *tags]
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model if base_is_repo else None,
        datasets=[dataset_id] if dataset_id else None,
        license=license,
        pipeline_tag=pipeline_tag,
        tags=list(dict.fromkeys(all_tags)),
        eval_results=eval_results,
        model_name=model_name if eval_results else None,
    )
    # a dense checkpoint has no pruned layer, whatever sparsity_report() lists as targeted
    layers, overall = _layer_rows(layer_table) if pattern is not None else ([], "none (no layer is pruned)")
    ratio = f"{checkpoint_bytes / dense_bytes:.2f}×" if checkpoint_bytes and dense_bytes else "not recorded"
    schedule_dict = dict(schedule) if isinstance(schedule, Mapping) else None
    metric_label = ((history or {}).get("metric_name") or "the eval metric").removeprefix("eval_")
    card = ModelCard.from_template(
        card_data,
        template_path=str(find_template(template)),
        hf_sparse_version=__version__,
        title=model_name,
        base_model_text=base_model if base_model else None,
        base_model_link=f"https://huggingface.co/{base_model}" if base_is_repo else None,
        task=task,
        dataset=dataset,
        pattern=pattern,
        pattern_description=pattern_description,
        target_pattern=target if pattern is not None and target != pattern else None,
        dense_reason=_dense_reason(schedule) if pattern is None else None,
        repo_id=repo_id or "path/to/this/model",
        auto_class=auto_class,
        schedule_rows=_schedule_rows(schedule),
        n_layers=len(layers),
        overall_sparsity=overall,
        layers=layers,
        checkpoint_size=_human_bytes(checkpoint_bytes),
        dense_size=_human_bytes(dense_bytes),
        size_ratio=ratio,
        speedup_text=_speedup_text(speedup),
        plot_filename=plot_filename,
        metric_label=metric_label,
        metric_rows=[(k, _fmt_metric(v)) for k, v in metric_items],
        sparsity_config_json=json.dumps(schedule_dict, indent=2, sort_keys=True, default=str)
        if schedule_dict
        else None,
    )
    return str(card)


def write_model_card(
    output_dir: str | os.PathLike, *, history: Mapping[str, Any] | None = None, plot: bool = True, **card_kwargs
) -> Path:
    """Write ``README.md`` (and ``sparsity_history.png`` when possible) into ``output_dir``; returns the README path.

    ``card_kwargs`` are :func:`render_model_card`'s; ``checkpoint_bytes`` defaults to the weight files already
    in ``output_dir``, so call this after ``save_model``. Where ``output_dir`` holds a ``config.json``, the card
    gives the pattern that checkpoint holds (from its ``quantization_config``; none: dense), whatever ``pattern``
    says, so that the card never contradicts the weights beside it.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file():
        written = written_pattern(out)
        if card_kwargs.get("pattern") is not None and str(card_kwargs["pattern"]) != str(written):
            logger.info("the card gives %s, the pattern of the checkpoint in %s", written or "dense", out)
        card_kwargs["pattern"] = written
    plot_path = save_training_plot(history, out / PLOT_FILENAME) if plot and history else None
    card_kwargs.setdefault("checkpoint_bytes", directory_weight_bytes(out) or None)
    text = render_model_card(history=history, plot_filename=plot_path.name if plot_path else None, **card_kwargs)
    readme = out / "README.md"
    readme.write_text(text, encoding="utf-8")
    return readme


def model_card_kwargs_from_trainer(
    trainer,
    *,
    base_model: str | None = None,
    task: str | None = None,
    dataset: str | None = None,
    dataset_id: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    dense_bytes: int | None = None,
    speedup: float | str | Mapping[str, Any] | None = None,
    metric_key: str | None = None,
) -> dict[str, Any]:
    """Collect :func:`write_model_card`'s arguments from a trained ``SparseTrainer`` (or a plain ``Trainer``).

    Reads the pattern the pruner's masks are at (what ``save_model`` writes; ``None`` when nothing was pruned),
    ``trainer.pruner.sparsity_report()``, the sparsity config (``trainer.sparsity_config``, else
    ``trainer.pruner.config``), and ``trainer.state.log_history`` for the metrics (the last eval, unless
    ``metrics`` is given) and the plot. ``metric_key`` defaults to ``args.metric_for_best_model``.
    """
    pruner = getattr(trainer, "pruner", None)
    config = getattr(trainer, "sparsity_config", None) or getattr(pruner, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else (dict(config) if config else None)
    log_history = list(getattr(trainer.state, "log_history", []) or [])
    if metrics is None:
        evals = [e for e in log_history if any(k.startswith("eval_") for k in e)]
        metrics = {k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else None
    model = trainer.model
    reached = pruner.current_pattern() if pruner is not None and hasattr(pruner, "current_pattern") else None
    return {
        "base_model": base_model or getattr(getattr(model, "config", None), "_name_or_path", None) or None,
        "task": task,
        "dataset": dataset,
        "dataset_id": dataset_id,
        "pattern": str(reached) if reached is not None else None,
        "schedule": config_dict,
        "layer_table": pruner.sparsity_report() if pruner is not None and hasattr(pruner, "sparsity_report") else None,
        "dense_bytes": dense_bytes,
        "metrics": metrics,
        "speedup": speedup,
        "history": history_from_log_history(log_history, metric_key=metric_key or trainer.args.metric_for_best_model),
    }


# ------------------------------------------------------------------------------------------------------- upload


def push_to_hub(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    card: str | Any | None = "auto",
    pruner=None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    token: str | bool | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    extra_files: Mapping[str, str | os.PathLike | bytes] | None = None,
    max_shard_size: str | int = "5GB",
    api=None,
):
    """Upload a (sparse) model to ``repo_id`` in one commit; returns the ``CommitInfo``.

    The model is written with ``model.save_pretrained``: for a model loaded from an hf_sparse checkpoint that
    gives the compressed weights and ``config.json`` with its ``quantization_config``. A model pruned in place
    (plain ``nn.Linear`` layers with masks, as during training) needs its ``pruner``: it is then written with
    ``hf_sparse.save_pretrained(model, folder, pruner)``, else it would go up dense. The tokenizer (or any
    processor) is written with its own ``save_pretrained``, and ``README.md`` from ``card``: a string or
    ``ModelCard``; ``"auto"`` for a card built from what was saved (pattern and schedule from the saved
    ``quantization_config``, per-layer sparsity from ``pruner.sparsity_report()`` or measured on the model); or
    ``None`` for none. ``extra_files`` maps paths in the repo to local files or bytes (e.g. the training plot).
    The files are written to a local folder first; then the repo is created if missing and the upload is one
    ``api.create_commit`` call (``api`` defaults to ``HfApi(token=token)``). If the Hub cannot be reached
    (``HF_HUB_OFFLINE=1``, no network, a wrong endpoint) this raises :class:`HubUnreachableError`, which names that
    folder: it is kept, ready for ``huggingface_hub.upload_folder``. On success or any other error it is removed.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = api or HfApi(token=token)
    folder = Path(tempfile.mkdtemp(prefix="hf_sparse_push_"))
    keep = False
    try:
        _write_upload(model, folder, repo_id, tokenizer, card, pruner, extra_files, max_shard_size)
        operations = [
            CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        ]
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload sparse model (hf_sparse)",
            commit_description=commit_description,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )
    except _network_errors() as err:
        keep = True
        endpoint = getattr(api, "endpoint", None) or "the Hugging Face Hub"
        raise HubUnreachableError(
            f"push_to_hub: cannot reach {endpoint} ({type(err).__name__}: {err}); nothing was uploaded to "
            f"{repo_id!r}. The files are saved in {folder}: upload them when online with "
            f"huggingface_hub.upload_folder(repo_id={repo_id!r}, folder_path={str(folder)!r})"
        ) from err
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


class HubUnreachableError(ConnectionError):
    """:func:`push_to_hub` could not reach the Hub; the message names the local folder that holds the files."""


def _network_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub is out of reach: ``OfflineModeIsEnabled`` (a ``ConnectionError``),
    and its HTTP client's transport errors (httpx / httpx2, or requests in older releases)."""
    import importlib

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests.exceptions", ("ConnectionError", "Timeout")),
    ):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        errors.extend(getattr(found, name) for name in names if hasattr(found, name))
    return tuple(errors)


def _write_upload(model, folder: Path, repo_id: str, tokenizer, card, pruner, extra_files, max_shard_size) -> None:
    """Everything :func:`push_to_hub` uploads, written into ``folder``."""
    if pruner is not None:
        from hf_sparse.serialization import save_pretrained

        save_pretrained(model, folder, pruner, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for path_in_repo, source in (extra_files or {}).items():
        target = folder / path_in_repo
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, bytes):
            target.write_bytes(source)
        else:
            shutil.copyfile(source, target)
    if isinstance(card, str) and card == "auto":
        card = _auto_card(model, folder, repo_id, pruner)
    if card is not None:
        (folder / "README.md").write_text(str(card), encoding="utf-8")  # str(ModelCard) is its file text


def _auto_card(model, folder: Path, repo_id: str, pruner=None) -> str:
    """A card for a model with no training record: what the saved ``config.json`` and the weights say."""
    saved = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    qdict = saved.get("quantization_config") or {}
    pattern = written_pattern(folder)
    schedule = qdict.get("sparsity_config") if isinstance(qdict.get("sparsity_config"), Mapping) else None
    architectures = list(saved.get("architectures") or [])
    suffixes = {task: cls.removeprefix("AutoModel") for task, (_, cls) in _TASK_PIPELINES.items()}
    task = next((t for t, sfx in suffixes.items() if any(a.endswith(sfx) for a in architectures)), None)
    if pruner is not None and hasattr(pruner, "sparsity_report"):
        layer_table = pruner.sparsity_report()
    else:
        layer_table = layer_table_from_model(model, pattern=pattern)
    return render_model_card(
        base_model=None,  # a loaded model's _name_or_path is where it was loaded from, not what it was tuned from
        task=task,
        dataset=None,
        pattern=pattern,
        schedule=schedule,
        layer_table=layer_table,
        checkpoint_bytes=directory_weight_bytes(folder) or None,
        dense_bytes=dense_weight_bytes(model),
        metrics=None,
        repo_id=repo_id,
    )
