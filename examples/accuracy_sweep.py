"""What the accuracy sweep of ``run_accuracy.py`` runs (tasks, recipes, patterns, rows) and how its tables are made
from the finished runs' files (mean ± sample standard deviation over seeds, the difference to dense, budgets)."""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Task:
    """One benchmark task: how to run it and what its table reports."""

    title: str
    script: str  # run_glue.py or run_qa.py
    data: tuple[str, ...]  # folder (GLUE) or files (SQuAD) under --data_dir the run reads
    epochs: float  # the dense row's budget
    metrics: tuple[tuple[str, str], ...]  # (eval_results.json key, column title), the first one is the task's main
    args: tuple[str, ...]  # the task's fixed training flags
    train_size: int  # training examples (windows for SQuAD), to order runs longest first
    step_cost: float = 1.0  # time of one step relative to a GLUE step at max_seq_length 128
    scale: float = 100.0  # eval_results.json value -> table value (SQuAD metrics are already in percent)
    untouched: bool = False  # validation only: no recipe or setting was chosen by looking at it


_GLUE_ARGS = ("--max_seq_length", "128", "--learning_rate", "5e-5")
#: task name -> Task. MRPC and CoLA are the untouched validation tasks (issue 16: tune on SST-2 and SQuAD only).
TASKS: dict[str, Task] = {
    "sst2": Task("SST-2", "run_glue.py", ("glue/SST-2",), 1.0, (("eval_accuracy", "accuracy"),), _GLUE_ARGS, 67349),
    "mrpc": Task(
        "MRPC",
        "run_glue.py",
        ("glue/MRPC",),
        5.0,
        (("eval_accuracy", "accuracy"), ("eval_f1", "F1")),
        _GLUE_ARGS,
        3668,
        untouched=True,
    ),
    "cola": Task(
        "CoLA",
        "run_glue.py",
        ("glue/CoLA",),
        3.0,
        (("eval_matthews_correlation", "Matthews corr."),),
        _GLUE_ARGS,
        8551,
        untouched=True,
    ),
    "squad": Task(
        "SQuAD v1.1",
        "run_qa.py",
        ("squad/train-v1.1.reconstructed.json", "squad/dev-v1.1.json"),
        1.0,
        (("eval_f1", "F1"), ("eval_exact_match", "EM")),
        ("--max_seq_length", "384", "--doc_stride", "128", "--learning_rate", "1e-4"),
        61000,
        step_cost=3.0,
        scale=1.0,
    ),
}
DEFAULT_TASKS = ("sst2", "mrpc", "cola")

#: pattern name in a row -> (sparsity flags, table text)
PATTERNS: dict[str, tuple[tuple[str, ...], str]] = {
    "2:4": (("--sparsity_pattern", "2:4"), "2:4"),
    "2:4T": (("--sparsity_pattern", "2:4", "--transposable_masks"), "2:4 transposable"),
    "64:2:8": (("--sparsity_pattern", "64:2:8"), "64:2:8"),
    "64:2:16": (("--sparsity_pattern", "64:2:16"), "64:2:16"),
    "128:2:8": (("--sparsity_pattern", "128:2:8"), "128:2:8"),
    "128:2:16": (("--sparsity_pattern", "128:2:16"), "128:2:16"),
    "unstructured:0.75": (("--sparsity_pattern", "unstructured:0.75"), "unstructured 75%"),
}
#: gradual magnitude pruning, every setting given: the baseline the activation-aware recipes are measured against
MAGNITUDE_SETTINGS = {"schedule": "cubic", "start": 0.0, "end": 0.5, "update_every": 100, "score": "magnitude"}
#: recipe name in a row -> (flags before the pattern's, table text)
RECIPES: dict[str, tuple[tuple[str, ...], str]] = {
    "gradual_magnitude": (
        tuple(f for key, value in MAGNITUDE_SETTINGS.items() for f in (f"--sparsity_{key}", str(value))),
        "gradual magnitude, cubic 0 → 50% of training, masks every 100 steps (baseline)",
    ),
    "prune_then_recover": (
        ("--recipe", "prune_then_recover"),
        "prune-then-recover: dense 40%, SparseGPT one-shot, recovery with self-distillation",
    ),
    "gradual_sparsegpt": (("--recipe", "gradual_sparsegpt"), "gradual SparseGPT, cubic 10 → 60%, every 100 steps"),
    "gradual_wanda": (("--recipe", "gradual_wanda"), "gradual Wanda, cubic 10 → 60%, every 100 steps"),
}
DEFAULT_RECIPES = ("gradual_magnitude", "prune_then_recover", "gradual_sparsegpt")
#: V = 128 rows share one set of kept columns per 128 rows instead of 64 (one gathered X tile feeds twice the rows in
#: the V:2:M kernel); not among the default rows, so a default sweep stays the tables' sweep: ``--rows '*/128:*'``
OPTIONAL_PATTERNS = ("128:2:8", "128:2:16")
#: every row, grouped by pattern (the order of the tables)
ALL_ROWS = ("dense", *(f"{r}/{p}" for p in PATTERNS for r in RECIPES))
DEFAULT_ROWS = tuple(
    row
    for row in ALL_ROWS
    if row == "dense" or (row.split("/")[0] in DEFAULT_RECIPES and row.split("/")[1] not in OPTIONAL_PATTERNS)
)
DEFAULT_SEEDS = (42, 43, 44)


def recipe_settings(recipe: str) -> dict[str, Any]:
    """The ``SparsityConfig`` fields a row's recipe sets, the pattern left out (rows set it)."""
    if recipe == "gradual_magnitude":
        return dict(MAGNITUDE_SETTINGS)
    from sparse_args import load_recipe

    return {k: v for k, v in load_recipe(recipe).items() if k != "pattern"}


def recipe_is_default(recipe: str) -> bool:
    """Whether ``recipe`` is what ``SparsityConfig()`` does (its settings are the defaults and it adds no
    distillation): the tables mark that row."""
    from hf_sparse import SparsityConfig

    if recipe != "gradual_magnitude":
        from sparse_args import load_recipe_distillation

        if load_recipe_distillation(recipe):
            return False
    defaults = SparsityConfig()
    return all(getattr(defaults, key) == value for key, value in recipe_settings(recipe).items())


def select_rows(patterns: list[str]) -> list[str]:
    """Rows named by ``patterns`` (names or shell patterns over :data:`ALL_ROWS`), in :data:`ALL_ROWS` order."""
    chosen = set()
    for pattern in patterns:
        hits = fnmatch.filter(ALL_ROWS, pattern)
        if not hits:
            raise SystemExit(f"--rows: {pattern!r} names no row; rows are {', '.join(ALL_ROWS)}")
        chosen.update(hits)
    return [row for row in ALL_ROWS if row in chosen]


# ---------------------------------------------------------------------------------------------------------- tables


def collect(output_dir: Path) -> list[dict[str, Any]]:
    """One record per finished run under ``output_dir``: task, row, seed, metrics, epochs, steps, wall_s."""
    records = []
    for results in sorted(output_dir.glob("*/*/eval_results.json")):
        run_dir = results.parent
        info_path = run_dir / "run_info.json"
        if not info_path.is_file():
            continue
        info = json.loads(info_path.read_text(encoding="utf-8"))
        state_path = run_dir / "trainer_state.json"
        state = json.loads(state_path.read_text(encoding="utf-8")) if state_path.is_file() else {}
        records.append(
            {
                "task": info["task"],
                "row": info["row"],
                "seed": info["seed"],
                "metrics": json.loads(results.read_text(encoding="utf-8")),
                "epochs": info["epochs"],
                "steps": state.get("global_step"),
                "wall_s": info.get("wall_s"),
            }
        )
    return records


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def aggregate(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{task: {row: {"seeds", "metrics": {column: (mean, std)}, "delta": {column: mean - dense mean},
    "epochs", "steps", "wall_s"}}}`` over the seeds each (task, row) has, rows in :data:`ALL_ROWS` order.
    Metric values are scaled as the tables show them (percent); ``delta`` is absent without a dense row."""
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rec in records:
        grouped.setdefault(rec["task"], {}).setdefault(rec["row"], []).append(rec)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for task in [t for t in TASKS if t in grouped]:
        spec = TASKS[task]
        table: dict[str, dict[str, Any]] = {}
        for row in [r for r in ALL_ROWS if r in grouped[task]]:
            recs = sorted(grouped[task][row], key=lambda r: r["seed"])
            metrics = {}
            for key, title in spec.metrics:
                values = [spec.scale * r["metrics"][key] for r in recs if key in r["metrics"]]
                if values:
                    metrics[title] = mean_std(values)
            steps = sorted({r["steps"] for r in recs if r["steps"] is not None})
            walls = [r["wall_s"] for r in recs if r["wall_s"] is not None]
            table[row] = {
                "seeds": [r["seed"] for r in recs],
                "metrics": metrics,
                "epochs": sorted({r["epochs"] for r in recs}),
                "steps": steps,
                "wall_s": sum(walls) / len(walls) if walls else None,
            }
        dense = table.get("dense")
        for row, entry in table.items():
            if dense is not None and row != "dense":
                entry["delta"] = {
                    title: mean - dense["metrics"][title][0]
                    for title, (mean, _) in entry["metrics"].items()
                    if title in dense["metrics"]
                }
        out[task] = table
    return out


def _signed(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def render_markdown(tables: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The tables of :func:`aggregate` as markdown, one per task."""
    parts = []
    for task, table in tables.items():
        spec = TASKS[task]
        seeds = sorted({s for entry in table.values() for s in entry["seeds"]})
        mark = " — **untouched validation** (no recipe or setting was chosen on it)" if spec.untouched else ""
        parts.append(f"#### {spec.title}{mark}\n")
        parts.append(
            f"Seeds {', '.join(map(str, seeds))}; mean ± sample standard deviation over the seeds of each row.\n"
        )
        titles = [title for _, title in spec.metrics]
        head = ["row", "recipe", "pattern", "budget", *(f"{t} | vs dense" for t in titles), "seeds", "wall s"]
        parts.append("| " + " | ".join(head) + " |")
        parts.append("| --- | --- | --- | --- |" + " ---: | ---: |" * len(titles) + " ---: | ---: |")
        for row, entry in table.items():
            if row == "dense":
                recipe_text, pattern_text = "dense", "—"
            else:
                recipe, pattern = row.split("/", 1)
                recipe_text = RECIPES[recipe][1] + (" (`SparsityConfig` default)" if recipe_is_default(recipe) else "")
                pattern_text = PATTERNS[pattern][1]
            epochs = "/".join(f"{e:g}" for e in entry["epochs"])
            steps = "/".join(str(s) for s in entry["steps"]) or "?"
            cells = [f"`{row}`", recipe_text, pattern_text, f"{epochs} ep ({steps} steps)"]
            for title in titles:
                if title not in entry["metrics"]:
                    cells += ["—", "—"]
                    continue
                mean, std = entry["metrics"][title]
                cells.append(f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else ""))
                delta = entry.get("delta", {}).get(title)
                cells.append("—" if delta is None else _signed(delta))
            wall = entry["wall_s"]
            cells += [str(len(entry["seeds"])), "—" if wall is None else f"{wall:.0f}"]
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


def report(output_dir: Path) -> str:
    """Aggregate every finished run under ``output_dir``, write ``tables.md`` there and return it."""
    text = render_markdown(aggregate(collect(output_dir)))
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "tables.md").write_text(text, encoding="utf-8")
    return text
