"""``examples/run_accuracy.py`` and ``examples/accuracy_sweep.py``: the table arithmetic on hand-written results, the run plan, and the scheduler on tiny
commands (no training here: the end-to-end check of every row is the CPU smoke command in examples/README.md)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import accuracy_sweep  # noqa: E402
import run_accuracy  # noqa: E402
from accuracy_sweep import aggregate, collect, render_markdown, select_rows  # noqa: E402
from run_accuracy import Run, Scheduler  # noqa: E402


def _rec(task, row, seed, metrics, epochs=5.0, steps=575, wall=60.0):
    return {
        "task": task,
        "row": row,
        "seed": seed,
        "metrics": metrics,
        "epochs": epochs,
        "steps": steps,
        "wall_s": wall,
    }


RECORDS = [
    _rec("mrpc", "dense", 42, {"eval_accuracy": 0.80, "eval_f1": 0.86}),
    _rec("mrpc", "dense", 43, {"eval_accuracy": 0.78, "eval_f1": 0.85}),
    _rec("mrpc", "dense", 44, {"eval_accuracy": 0.79, "eval_f1": 0.87}),
    _rec("mrpc", "gradual_magnitude/2:4", 42, {"eval_accuracy": 0.77, "eval_f1": 0.84}, 10.0, 1150, 100.0),
    _rec("mrpc", "gradual_magnitude/2:4", 43, {"eval_accuracy": 0.76, "eval_f1": 0.86}, 10.0, 1150, 120.0),
    _rec("sst2", "prune_then_recover/64:2:8", 42, {"eval_accuracy": 0.85}, 2.0, 4210, 300.0),
]


def test_aggregate_means_std_and_delta():
    tables = aggregate(RECORDS)
    assert list(tables) == ["sst2", "mrpc"]  # the order of run_accuracy.TASKS
    dense = tables["mrpc"]["dense"]
    # accuracy 80, 78, 79 -> mean 79, sample std 1; F1 86, 85, 87 -> mean 86, std 1
    assert dense["metrics"]["accuracy"] == pytest.approx((79.0, 1.0))
    assert dense["metrics"]["F1"] == pytest.approx((86.0, 1.0))
    assert dense["seeds"] == [42, 43, 44] and dense["epochs"] == [5.0] and dense["steps"] == [575]
    sparse = tables["mrpc"]["gradual_magnitude/2:4"]
    # accuracy 77, 76 -> 76.5 ± sqrt(0.5); F1 84, 86 -> 85 ± sqrt(2)
    assert sparse["metrics"]["accuracy"] == pytest.approx((76.5, 0.5**0.5))
    assert sparse["metrics"]["F1"] == pytest.approx((85.0, 2**0.5))
    assert sparse["delta"] == pytest.approx({"accuracy": -2.5, "F1": -1.0})
    assert sparse["wall_s"] == pytest.approx(110.0)
    one = tables["sst2"]["prune_then_recover/64:2:8"]
    assert one["metrics"]["accuracy"][0] == pytest.approx(85.0) and one["metrics"]["accuracy"][1] is None
    assert "delta" not in one  # no dense row for SST-2 in these records


def test_render_marks_untouched_tasks_and_budgets():
    text = render_markdown(aggregate(RECORDS))
    mrpc = text[text.index("#### MRPC") :]
    sst2 = text[text.index("#### SST-2") : text.index("#### MRPC")]
    assert "untouched validation" in mrpc.splitlines()[0] and "untouched" not in sst2
    assert "| `dense` | dense | — | 5 ep (575 steps) | 79.00 ± 1.00 | — | 86.00 ± 1.00 | — | 3 | 60 |" in mrpc
    row = next(line for line in mrpc.splitlines() if line.startswith("| `gradual_magnitude/2:4`"))
    assert "| 2:4 | 10 ep (1150 steps) | 76.50 ± 0.71 | −2.50 | 85.00 ± 1.41 | −1.00 | 2 | 110 |" in row
    assert "| 85.00 | — |" in sst2  # one seed: no std, no dense to compare with


def test_collect_reads_run_folders(tmp_path):
    run = tmp_path / "cola" / "dense-seed42"
    run.mkdir(parents=True)
    (run / "eval_results.json").write_text(json.dumps({"eval_matthews_correlation": 0.41}))
    (run / "run_info.json").write_text(json.dumps({"task": "cola", "row": "dense", "seed": 42, "epochs": 3.0}))
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 804}))
    unfinished = tmp_path / "cola" / "gradual_magnitude-2_4-seed42"
    unfinished.mkdir()
    (unfinished / "run_info.json").write_text(json.dumps({"task": "cola", "row": "gradual_magnitude/2:4"}))
    records = collect(tmp_path)
    assert records == [_rec("cola", "dense", 42, {"eval_matthews_correlation": 0.41}, 3.0, 804, None)]


def test_select_rows():
    assert select_rows(["*/2:4"]) == [f"{r}/2:4" for r in accuracy_sweep.RECIPES]
    assert select_rows(["prune_then_recover/64:2:*", "dense"]) == [
        "dense",
        "prune_then_recover/64:2:8",
        "prune_then_recover/64:2:16",
    ]
    assert len(accuracy_sweep.DEFAULT_ROWS) == 16
    assert not [row for row in accuracy_sweep.DEFAULT_ROWS if "128:" in row]  # V = 128 rows only when asked for
    assert select_rows(["gradual_sparsegpt/128:*"]) == ["gradual_sparsegpt/128:2:8", "gradual_sparsegpt/128:2:16"]
    with pytest.raises(SystemExit, match="names no row"):
        select_rows(["magnitude/2:4"])


def test_plan_budgets_flags_and_order(tmp_path):
    for task in ("MRPC", "CoLA"):
        (tmp_path / "glue" / task).mkdir(parents=True)
        for name in ("train.tsv", "dev.tsv"):
            (tmp_path / "glue" / task / name).write_text("")
    args = run_accuracy.parse_args(
        f"--model_name_or_path m --data_dir {tmp_path} --output_dir {tmp_path / 'out'} --tasks mrpc cola "
        "--seeds 43 42 --rows dense */2:4T --kernels never".split()
    )
    runs = run_accuracy.plan_runs(args, cuda=True)
    assert [r.seed for r in runs] == [43] * 10 + [42] * 10  # seeds in the order given
    first = runs[:10]
    assert [r.cost for r in first] == sorted((r.cost for r in first), reverse=True)  # longest first
    by_key = {(r.task, r.row, r.seed): r for r in runs}
    dense, ptr = by_key[("mrpc", "dense", 42)], by_key[("mrpc", "prune_then_recover/2:4T", 42)]
    assert (dense.epochs, ptr.epochs) == (5.0, 10.0)  # sparse rows: twice the dense budget
    assert by_key[("cola", "gradual_magnitude/2:4T", 43)].epochs == 6.0
    flags = ptr.command[ptr.command.index("--output_dir") :]
    assert flags[1] == str(tmp_path / "out" / "mrpc" / "prune_then_recover-2_4T-seed42")
    assert flags[2:] == ["--bf16", "--recipe", "prune_then_recover", "--sparsity_pattern", "2:4",
                         "--transposable_masks", "--sparsity_kernels", "never", "--sparsity_compact", "false"]  # fmt: skip
    assert "--sparsity_pattern" not in dense.command and "--sparsity_kernels" not in dense.command
    with pytest.raises(SystemExit, match="cp -r ../shared/data/glue/SST-2"):
        run_accuracy.task_data_args("sst2", tmp_path, None)


def _tiny_run(tmp_path: Path, name: str, body: str) -> Run:
    out = tmp_path / name
    code = f"import json, time, pathlib; d = pathlib.Path({str(out)!r}); {body}"
    return Run("mrpc", "dense", 42, 1.0, out, [sys.executable, "-c", code], 1.0)


def test_scheduler_skips_finished_runs_and_bounds_parallelism(tmp_path):
    finish = "(d / 'eval_results.json').write_text('{}')"
    stamp = "(d / 't').write_text(json.dumps([time.time(), time.sleep(0.3), time.time()]))"
    runs = [_tiny_run(tmp_path, f"r{i}", f"{stamp}; {finish}") for i in range(3)]
    failing = _tiny_run(tmp_path, "bad", "raise SystemExit(3)")
    old = _tiny_run(tmp_path, "old", "raise SystemExit('a finished run must not run again')")
    old.dir.mkdir()
    (old.dir / "eval_results.json").write_text("{}")
    finished = []
    result = Scheduler(1, on_finish=lambda run, code: finished.append((run.dir.name, code))).run([*runs, failing, old])
    assert [r.dir.name for r in result["done"]] == ["r0", "r1", "r2"]
    assert [r.dir.name for r in result["failed"]] == ["bad"] and result["held"] == []
    assert sorted(finished) == [("bad", 3), ("r0", 0), ("r1", 0), ("r2", 0)]
    spans = sorted((t[0], t[2]) for t in (json.loads((r.dir / "t").read_text()) for r in runs))
    # one at a time: every run ends before the next one starts
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    info = json.loads((runs[0].dir / "run_info.json").read_text())
    assert info["returncode"] == 0 and info["wall_s"] >= 0.3
    assert (runs[0].dir / "run.log").is_file()


def test_scheduler_deadline_and_finish_by_hold_runs(tmp_path):
    runs = [
        _tiny_run(tmp_path, f"r{i}", "time.sleep(0.5); (d / 'eval_results.json').write_text('{}')") for i in range(3)
    ]
    result = Scheduler(1, deadline_s=0.2).run(runs)
    assert [r.dir.name for r in result["done"]] == ["r0"]  # launched at once; the others came after the deadline
    assert [r.dir.name for r in result["held"]] == ["r1", "r2"]
    assert not runs[1].dir.exists()
    start = time.monotonic()
    result = Scheduler(1, finish_by_s=5.0, known_wall={("mrpc", "dense"): 10.0}).run(runs[1:])
    assert result["held"] == runs[1:] and time.monotonic() - start < 1  # 10 s measured would end after 5 s


def test_archive_keeps_results_and_logs_only(tmp_path):
    run = tmp_path / "out" / "mrpc" / "dense-seed42"
    run.mkdir(parents=True)
    for name in ("eval_results.json", "run_info.json", "trainer_state.json", "run.log", "tokenizer.json", "README.md"):
        (run / name).write_text(name)
    (tmp_path / "out" / "tables.md").write_text("tables")
    run_accuracy.write_archive(tmp_path / "out", tmp_path / "a" / "acc.tar.gz")
    run_accuracy.extract_archive(tmp_path / "a" / "acc.tar.gz", tmp_path / "back")
    back = tmp_path / "back"
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file()) == [
        "mrpc/dense-seed42/eval_results.json",
        "mrpc/dense-seed42/run.log",
        "mrpc/dense-seed42/run_info.json",
        "mrpc/dense-seed42/trainer_state.json",
        "tables.md",
    ]
    assert (back / "mrpc/dense-seed42/eval_results.json").read_text() == "eval_results.json"


def test_the_default_mark_follows_sparsity_config():
    """The tables mark the row whose recipe ``SparsityConfig()`` runs: gradual SparseGPT (chosen by the 3-seed tables
    of examples/README.md), not the magnitude baseline nor prune-then-recover (which adds distillation)."""
    from hf_sparse import SparsityConfig

    assert accuracy_sweep.recipe_is_default("gradual_sparsegpt")
    assert not accuracy_sweep.recipe_is_default("gradual_magnitude")
    assert not accuracy_sweep.recipe_is_default("prune_then_recover")
    defaults = SparsityConfig()
    assert (defaults.score, defaults.schedule, defaults.start, defaults.end) == ("sparsegpt", "cubic", 0.1, 0.6)
    assert (defaults.update_every, defaults.calibration_batches) == (100, 32)
