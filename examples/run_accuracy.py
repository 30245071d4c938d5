#!/usr/bin/env python
"""Sparse-against-dense accuracy tables: many ``(task, row, seed)`` runs of ``run_glue.py`` / ``run_qa.py`` at once on
one GPU, then per task the mean ± standard deviation over seeds and the difference to dense, as markdown.

A MiniLM-sized run leaves an H200 mostly idle and is bound by its host process, so up to ``--max_parallel``
(default 16, one per CPU core) run side by side. Every run writes into ``OUTPUT_DIR/<task>/<row>-seed<seed>``; a run
whose ``eval_results.json`` exists is skipped, so a sweep cut short resumes in the next call. ``--deadline_s`` stops
launching runs after that many seconds (those not started stay for the next call) and ``--finish_by_s`` holds back
a run whose measured wall time (same task and row, any seed) would end after that second, so a device call with a
hard time limit never kills a run in the middle. Each run's wall time goes to its ``run_info.json``.

Tasks, recipes, patterns and rows are defined in ``accuracy_sweep.py``: rows are ``dense`` and ``RECIPE/PATTERN``
(``--rows`` takes names or shell patterns: ``'prune_then_recover/*'``, ``'*/2:4'``). Budgets: the dense row trains a
task's epochs (``--epochs TASK=N``), every sparse row ``--sparse_budget`` times that (2 by default, a
prune-then-recover dense phase included); the tables give each row's epochs and optimizer steps.

    python examples/run_accuracy.py --model_name_or_path .carry/minilm --data_dir .carry --output_dir /tmp/acc \\
        --tasks mrpc cola --seeds 42 --deadline_s 330 --resume_from .carry/acc.tar.gz --archive $OUT/acc.tar.gz
    python examples/run_accuracy.py --output_dir out/acc --report_only     # the tables of what has finished

On CUDA the driver builds (or loads) the hf_sparse CUDA extension once before launching anything (``--kernels
auto``): a run that finds no built extension builds it itself at train start (torch's ``cpp_extension``, minutes),
and concurrent runs would all wait on the one that holds the build lock. ``--kernels never`` trains the sparse rows
without the extension (pruned layers stay dense and masked for the whole run: the same products).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
sys.path.insert(0, str(EXAMPLES))  # accuracy_sweep.py next to this script

from accuracy_sweep import (  # noqa: E402
    DEFAULT_ROWS,
    DEFAULT_SEEDS,
    DEFAULT_TASKS,
    PATTERNS,
    RECIPES,
    TASKS,
    collect,
    report,
    select_rows,
)

#: the flags every run shares (budget, data, seed and output folder come per run)
RUN_ARGS = tuple(
    "--do_train --do_eval --per_device_train_batch_size 32 --eval_strategy no --save_strategy no --logging_steps 100 "
    "--report_to none --disable_tqdm true".split()
)
#: output files of a run that the archive and the tables keep (model weights are deleted after the run)
KEEP_FILES = ("eval_results.json", "train_results.json", "all_results.json", "trainer_state.json", "run_info.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


# ---------------------------------------------------------------------------------------------------------- plan


@dataclass
class Run:
    task: str
    row: str
    seed: int
    epochs: float
    dir: Path
    command: list[str]
    cost: float  # estimated, relative: orders the launches

    @property
    def done(self) -> bool:
        return (self.dir / "eval_results.json").is_file()


def row_dir_name(row: str, seed: int) -> str:
    """``prune_then_recover/64:2:8``, 42 -> ``prune_then_recover-64_2_8-seed42``."""
    return f"{row.replace('/', '-').replace(':', '_')}-seed{seed}"


def row_flags(row: str, kernels: str) -> list[str]:
    if row == "dense":
        return []
    recipe, pattern = row.split("/", 1)
    flags = [*RECIPES[recipe][0], *PATTERNS[pattern][0]]
    if kernels == "never":
        flags += ["--sparsity_kernels", "never", "--sparsity_compact", "false"]
    return flags


def task_data_args(task: str, data_dir: Path, squad_train_samples: int | None) -> list[str]:
    """The data flags of ``task``, checking the files are there (a missing one is an error that says what to do)."""
    spec = TASKS[task]
    if spec.script == "run_glue.py":
        folder = data_dir / spec.data[0]
        if not (folder / "train.tsv").is_file() or not (folder / "dev.tsv").is_file():
            raise SystemExit(
                f"{task}: no train.tsv/dev.tsv in {folder}; --data_dir must hold glue/SST-2, glue/MRPC and glue/CoLA "
                f"(e.g. mkdir -p {data_dir}/glue && cp -r ../shared/data/glue/{folder.name} {data_dir}/glue/)"
            )
        return ["--task_name", task, "--data_dir", str(folder)]
    train, dev = (data_dir / f for f in spec.data)
    if not train.is_file() and Path(f"{train}.xz").is_file():
        train = Path(f"{train}.xz")
    if not train.is_file() or not dev.is_file():
        raise SystemExit(
            f"squad: need {train} (or .xz) and {dev}; copy them from ../shared/data/squad "
            "(../shared/tools/prepare_carry.sh squad)"
        )
    limit = ["--max_train_samples", str(squad_train_samples)] if squad_train_samples else []
    return ["--train_file", str(train), "--validation_file", str(dev), "--per_device_eval_batch_size", "128", *limit]


def plan_runs(args: argparse.Namespace, cuda: bool) -> list[Run]:
    """Every selected run, seeds in the order given and the most expensive first within a seed."""
    rows = select_rows(args.rows)
    epochs = {**{t: spec.epochs for t, spec in TASKS.items()}, **args.epochs}
    runs = []
    for seed in args.seeds:
        for task in args.tasks:
            spec = TASKS[task]
            data = task_data_args(task, Path(args.data_dir), args.squad_train_samples)
            size = min(spec.train_size, args.squad_train_samples or spec.train_size)
            for row in rows:
                run_epochs = epochs[task] * (1.0 if row == "dense" else args.sparse_budget)
                out = Path(args.output_dir) / task / row_dir_name(row, seed)
                command = [
                    sys.executable,
                    str(EXAMPLES / spec.script),
                    *("--model_name_or_path", args.model_name_or_path, *data, *spec.args),
                    *(
                        "--num_train_epochs",
                        f"{run_epochs:g}",
                        *RUN_ARGS,
                        "--seed",
                        str(seed),
                        "--output_dir",
                        str(out),
                    ),
                    *(["--bf16"] if cuda else []),
                    *row_flags(row, args.kernels),
                    *shlex.split(args.run_args),
                    *(shlex.split(args.sparse_run_args) if row != "dense" else []),
                ]
                cost = size * run_epochs * spec.step_cost * (1.3 if row.startswith("prune_then_recover") else 1.0)
                runs.append(Run(task, row, seed, run_epochs, out, command, cost))
    order = {seed: i for i, seed in enumerate(args.seeds)}
    return sorted(runs, key=lambda r: (order[r.seed], -r.cost))


# ------------------------------------------------------------------------------------------------------ running


@dataclass
class Scheduler:
    """Runs :class:`Run` commands, at most ``max_parallel`` at a time, and records each one's wall time."""

    max_parallel: int
    deadline_s: float | None = None
    finish_by_s: float | None = None
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    keep_models: bool = False
    on_finish: Any = None  # called with (run, returncode) after each run
    known_wall: dict[tuple[str, str], float] = field(default_factory=dict)  # (task, row) -> measured wall seconds

    def _may_launch(self, run: Run, elapsed: float) -> bool:
        if self.deadline_s is not None and elapsed >= self.deadline_s:
            return False
        wall = self.known_wall.get((run.task, run.row))
        return self.finish_by_s is None or wall is None or elapsed + wall <= self.finish_by_s

    def run(self, runs: list[Run], start: float | None = None) -> dict[str, list[Run]]:
        """Launch, wait, record; returns the runs ``done``, ``failed`` and ``held`` (not started: deadline).
        ``start``: the ``time.monotonic()`` the deadlines count from (default: now)."""
        start = time.monotonic() if start is None else start
        pending = [r for r in runs if not r.done]
        result: dict[str, list[Run]] = {"done": [], "failed": [], "held": []}
        active: dict[int, tuple[Run, subprocess.Popen, float, Any]] = {}
        try:
            while pending or active:
                elapsed = time.monotonic() - start
                while pending and len(active) < self.max_parallel:
                    run = next((r for r in pending if self._may_launch(r, elapsed)), None)
                    if run is None:
                        break
                    pending.remove(run)
                    shutil.rmtree(run.dir, ignore_errors=True)  # leftovers of an interrupted attempt
                    run.dir.mkdir(parents=True)
                    log = open(run.dir / "run.log", "w", encoding="utf-8")  # noqa: SIM115 (closed when it ends)
                    log.write(shlex.join(run.command) + "\n\n")
                    log.flush()
                    proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
                    active[proc.pid] = (run, proc, time.time(), log)
                    print(f"[{elapsed:6.0f} s] start  {run.task} {run.row} seed {run.seed}", flush=True)
                if not active:  # nothing may start any more
                    result["held"] = pending
                    break
                time.sleep(0.5)
                for pid, (run, proc, started, log) in list(active.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    del active[pid]
                    log.close()
                    self._finished(run, code, started, result)
        finally:
            for _, proc, _, log in active.values():  # interrupted: stop what this driver started
                proc.terminate()
                proc.wait()
                log.close()
        return result

    def _finished(self, run: Run, code: int, started: float, result: dict[str, list[Run]]) -> None:
        wall = time.time() - started
        info = {
            "task": run.task,
            "row": run.row,
            "seed": run.seed,
            "epochs": run.epochs,
            "wall_s": round(wall, 1),
            "returncode": code,
            "started": started,
            "command": run.command,
        }
        (run.dir / "run_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
        if not self.keep_models:
            for path in run.dir.iterdir():
                if path.is_dir() and path.name.startswith("checkpoint-"):
                    shutil.rmtree(path)
                elif path.suffix in WEIGHT_SUFFIXES:
                    path.unlink()
        ok = code == 0 and run.done
        if ok:
            self.known_wall[(run.task, run.row)] = max(wall, self.known_wall.get((run.task, run.row), 0.0))
        result["done" if ok else "failed"].append(run)
        status = "done  " if ok else f"FAILED (exit {code}, see {run.dir / 'run.log'})"
        print(f"[wall {wall:6.0f} s] {status} {run.task} {run.row} seed {run.seed}", flush=True)
        if not ok:
            tail = (run.dir / "run.log").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            print("    " + "\n    ".join(tail), flush=True)
        if self.on_finish is not None:
            self.on_finish(run, code)


def clear_stale_lock(build_dir: Path) -> None:
    """Remove the ``lock`` file torch's ``cpp_extension`` leaves in a build folder when the process building there
    was killed: every later load would wait on it forever. Only called before any run of this driver starts, so no
    build of ours holds it."""
    lock = build_dir / "lock"
    if lock.exists():
        print(f"removing {lock}: a build lock left by a process that was stopped while building", flush=True)
        lock.unlink()


def extension_build_dir() -> Path | None:
    """Where ``hf_sparse.ops._build.load_extension`` builds: ``HF_SPARSE_BUILD_DIR``, else torch's extension cache
    (``None`` where this torch does not say)."""
    env = os.environ.get("HF_SPARSE_BUILD_DIR")
    if env:
        return Path(env)
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    from hf_sparse.ops._build import EXTENSION_NAME

    return Path(_get_build_directory(EXTENSION_NAME, verbose=False))


#: what each run loads at train start (``SparsityCallback``): the kernel extension, not the cuSPARSELt baseline
_BUILD = """
import sys
from hf_sparse.ops._build import KernelUnavailableError, load_extension
try:
    print("hf_sparse: extension at", load_extension().__file__)
except KernelUnavailableError as exc:
    sys.exit(str(exc))
"""


def build_extension(env: dict[str, str], log: Path) -> None:
    """Build (or load the cached build of) the CUDA extension once, before any run starts. Exits with a message
    naming the log and ``--kernels never`` if it cannot be built."""
    build_dir = None if env.get("HF_SPARSE_NVCC_FLAGS") else extension_build_dir()  # NVCC flags: another name
    if build_dir is not None:
        clear_stale_lock(build_dir)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.call([sys.executable, "-c", _BUILD], stdout=out, stderr=subprocess.STDOUT, env=env)
    print(f"CUDA extension: built or loaded in {time.monotonic() - start:.0f} s (log {log})", flush=True)
    if code != 0:
        print(log.read_text(encoding="utf-8", errors="replace")[-3000:])
        raise SystemExit(
            f"the hf_sparse CUDA extension could not be built (see {log}); the sparse runs need it once their layers "
            "turn compact. Fix the build, or rerun with --kernels never (pruned layers stay dense and masked)"
        )


def write_archive(output_dir: Path, archive: Path) -> None:
    """A ``.tar.gz`` of every run's small files (results, state, run info, log) and the tables, paths relative to
    ``output_dir``; written to a temporary name and renamed, so a reader never sees half an archive."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(output_dir.rglob("*")):
            if path.is_file() and (path.name in KEEP_FILES or path.suffix == ".log" or path.name == "tables.md"):
                tar.add(path, arcname=str(path.relative_to(output_dir)))
    os.replace(tmp, archive)


def extract_archive(archive: Path, output_dir: Path) -> None:
    """Put the runs of an archive of :func:`write_archive` (an earlier call's) into ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(output_dir, filter="data")


# ------------------------------------------------------------------------------------------------------------ main


def _task_epochs(values: list[str]) -> dict[str, float]:
    out = {}
    for item in values:
        task, _, number = item.partition("=")
        if task not in TASKS or not number:
            raise SystemExit(f"--epochs {item!r}: give TASK=EPOCHS with TASK one of {', '.join(TASKS)}")
        out[task] = float(number)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", help="the pretrained model folder (e.g. .carry/minilm)")
    p.add_argument("--data_dir", help="folder holding glue/{SST-2,MRPC,CoLA} and, for squad, squad/")
    p.add_argument("--output_dir", required=True, help="runs go to OUTPUT_DIR/<task>/<row>-seed<seed>")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=list(TASKS))
    p.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), help="row names or shell patterns (see above)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    p.add_argument("--epochs", nargs="+", default=[], metavar="TASK=N", help="the dense row's epochs of a task")
    p.add_argument("--sparse_budget", type=float, default=2.0, help="a sparse row's epochs / the dense row's (1-2)")
    p.add_argument("--squad_train_samples", type=int, default=60000, help="squad: training questions used")
    p.add_argument("--max_parallel", type=int, default=16, help="runs at a time")
    p.add_argument("--deadline_s", type=float, help="launch no run after this many seconds")
    p.add_argument("--finish_by_s", type=float, help="launch no run whose measured wall time would end after this")
    p.add_argument("--kernels", choices=["auto", "never"], default="auto", help="CUDA extension: build once / unused")
    p.add_argument("--run_args", default="", help="extra flags for every run (e.g. '--max_train_samples 64')")
    p.add_argument("--sparse_run_args", default="", help="extra flags for the sparse runs only")
    p.add_argument("--archive", help="keep a .tar.gz of the results here, rewritten after every run")
    p.add_argument(
        "--resume_from", help="an earlier call's --archive: its runs go into OUTPUT_DIR first (missing: none yet)"
    )
    p.add_argument("--keep_models", action="store_true", help="keep each run's saved model (default: deleted)")
    p.add_argument("--report_only", action="store_true", help="print the tables of the finished runs, run nothing")
    p.add_argument("--dry_run", action="store_true", help="print the runs that would start, run nothing")
    args = p.parse_args(argv)
    args.epochs = _task_epochs(args.epochs)
    # the runs get absolute paths: they do not depend on the folder the driver was started from
    args.output_dir = str(Path(args.output_dir).resolve())
    if args.data_dir:
        args.data_dir = str(Path(args.data_dir).resolve())
    if args.model_name_or_path and Path(args.model_name_or_path).is_dir():
        args.model_name_or_path = str(Path(args.model_name_or_path).resolve())
    if not 1.0 <= args.sparse_budget <= 2.0:
        p.error(f"--sparse_budget {args.sparse_budget}: a sparse row trains 1 to 2 times the dense row's budget")
    if args.max_parallel < 1:
        p.error("--max_parallel must be >= 1")
    if not args.report_only and not (args.model_name_or_path and args.data_dir):
        p.error("--model_name_or_path and --data_dir are needed to run (or give --report_only)")
    return args


def known_walls(output_dir: Path) -> dict[tuple[str, str], float]:
    """The longest measured wall time of each (task, row) among the finished runs under ``output_dir``."""
    walls: dict[tuple[str, str], float] = {}
    for rec in collect(output_dir):
        if rec["wall_s"] is not None:
            key = (rec["task"], rec["row"])
            walls[key] = max(walls.get(key, 0.0), rec["wall_s"])
    return walls


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # --deadline_s and --finish_by_s count from here
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    if args.resume_from:
        if Path(args.resume_from).is_file():
            extract_archive(Path(args.resume_from), output_dir)
        else:  # the first call of a sweep
            print(f"--resume_from {args.resume_from}: no such file, so no earlier results (first call?)", flush=True)
    if args.report_only:
        print(report(output_dir))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    runs = plan_runs(args, cuda)
    todo = [r for r in runs if not r.done]
    print(f"{len(runs)} runs selected, {len(runs) - len(todo)} already finished, {len(todo)} to run", flush=True)
    if args.dry_run:
        for run in todo:
            print(f"{run.task} {run.row} seed {run.seed}: {run.epochs:g} epochs\n    {shlex.join(run.command)}")
        return 0
    output_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if cuda and args.kernels == "auto" and todo:
        build_extension(env, output_dir / "build_extension.log")

    archive = Path(args.archive) if args.archive else None

    def on_finish(run: Run, code: int) -> None:
        report(output_dir)
        if archive is not None:
            write_archive(output_dir, archive)

    scheduler = Scheduler(
        args.max_parallel,
        args.deadline_s,
        args.finish_by_s,
        env=env,
        keep_models=args.keep_models,
        on_finish=on_finish,
        known_wall=known_walls(output_dir),
    )
    result = scheduler.run(runs, start)
    text = report(output_dir)
    if archive is not None:
        write_archive(output_dir, archive)
    print(
        f"\n{len(result['done'])} runs finished, {len(result['failed'])} failed, {len(result['held'])} not started "
        f"(deadline), in {time.monotonic() - start:.0f} s\n"
    )
    for run in result["failed"]:
        print(f"FAILED: {run.task} {run.row} seed {run.seed} ({run.dir / 'run.log'})")
    for run in result["held"]:
        print(f"not started: {run.task} {run.row} seed {run.seed} (the next call runs it)")
    print(text)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
