"""CPU: ``benchmarks/gpu_session.sh``'s order of work, with stand-ins for ``python`` and ``nvidia-smi`` on PATH. With
BASE, both trees' kernels are built, and each stage runs on each tree in turn (base first) with that tree's package
and build directory, ROUNDS times; without it each stage runs once on this checkout. A run that ends while holding
torch's build lock (killed in its load) does not leave it for the next run of its tree."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
STAGE = 'echo "ran on $PYTHONPATH with $HF_SPARSE_BUILD_DIR"'


def _stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, *stages: str, tests: str = "", **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _stub(bin_dir, "nvidia-smi", 'echo "Stand-in GPU, 0"\n')
    # the build prints which package and build directory it was given; everything else succeeds quietly
    _stub(
        bin_dir,
        "python",
        'if [ "$1 $2" = "-m hf_sparse.ops.build" ]; then echo "built $HF_SPARSE_BUILD_DIR from $PYTHONPATH"; fi\n',
    )
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "HF_SPARSE_BUILD_DIR": str(tmp_path / "build"),
        "LIMIT": "300",
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), tests, *stages], env=full_env, capture_output=True, text=True, timeout=120
    )


def _base_tree(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    (base / "hf_sparse").mkdir(parents=True)
    (base / "csrc").mkdir()
    return base


def test_each_stage_alternates_base_and_this_tree(tmp_path):
    base = _base_tree(tmp_path)
    done = _run(tmp_path, STAGE, "echo second", BASE=str(base), ROUNDS="2")
    assert done.returncode == 0, done.stderr
    session = (tmp_path / "out" / "session.log").read_text()
    build = tmp_path / "build"
    assert f"[base] built {build}-base from {base}" in session
    assert f"built {build} from {REPO}" in session
    bench = (tmp_path / "out" / "bench.log").read_text()
    heads = re.findall(r"^== (.*?) \(", bench, flags=re.M)
    assert heads == [
        f"{STAGE} [base] round 1",
        f"{STAGE} [this] round 1",
        f"{STAGE} [base] round 2",
        f"{STAGE} [this] round 2",
        "echo second [base] round 1",
        "echo second [this] round 1",
        "echo second [base] round 2",
        "echo second [this] round 2",
    ]
    ran = re.findall(r"^ran on (.*)$", bench, flags=re.M)
    assert ran == [f"{base} with {build}-base", f"{REPO} with {build}"] * 2


def test_without_base_a_stage_runs_once_on_this_checkout(tmp_path):
    done = _run(tmp_path, STAGE)
    assert done.returncode == 0, done.stderr
    bench = (tmp_path / "out" / "bench.log").read_text()
    assert re.findall(r"^== (.*?) \(", bench, flags=re.M) == [STAGE]
    assert re.findall(r"^ran on (.*)$", bench, flags=re.M) == [f"{REPO} with {tmp_path / 'build'}"]
    assert "[base]" not in (tmp_path / "out" / "session.log").read_text()


def _order(tmp_path: Path) -> list[str]:
    """The session log's stage heads and GPU-test lines, in the order they were written."""
    session = (tmp_path / "out" / "session.log").read_text()
    return re.findall(r"^(== .*? \(|GPU tests: )", session, flags=re.M)


def test_the_gpu_tests_run_before_the_stages(tmp_path):
    done = _run(tmp_path, STAGE, tests="tests/ops")
    assert done.returncode == 0, done.stderr
    assert _order(tmp_path) == ["GPU tests: ", f"== {STAGE} ("]


def test_tests_last_runs_the_stages_first(tmp_path):
    done = _run(tmp_path, STAGE, "echo second", tests="tests/ops", TESTS_LAST="1")
    assert done.returncode == 0, done.stderr
    assert _order(tmp_path) == [f"== {STAGE} (", "== echo second (", "GPU tests: "]


def test_a_base_without_the_package_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    done = _run(tmp_path, STAGE, BASE=str(tmp_path / "empty"))
    assert done.returncode == 2
    assert "holds no hf_sparse/ and csrc/" in done.stderr
    assert not (tmp_path / "out" / "bench.log").exists()


def test_a_build_lock_left_by_a_run_is_gone_before_the_next_run(tmp_path):
    # each run of the first stage leaves its tree's lock, as a run killed in torch's build does; the second stage
    # reports whether its tree's lock is there when it starts
    leave = 'mkdir -p "$HF_SPARSE_BUILD_DIR/hf_sparse_C" && touch "$HF_SPARSE_BUILD_DIR/hf_sparse_C/lock"; exit 134'
    look = 'if [ -e "$HF_SPARSE_BUILD_DIR/hf_sparse_C/lock" ]; then echo "lock there"; else echo "no lock"; fi'
    done = _run(tmp_path, leave, look, BASE=str(_base_tree(tmp_path)), ROUNDS="1")
    assert done.returncode == 0, done.stderr
    bench = (tmp_path / "out" / "bench.log").read_text()
    assert re.findall(r"^(lock there|no lock)$", bench, flags=re.M) == ["no lock", "no lock"]


def _summary(tmp_path: Path, log: str) -> list[str]:
    path = tmp_path / "pytest.log"
    path.write_text(log)
    done = subprocess.run(
        ["bash", "-c", f'. "{REPO}/benchmarks/pytest_summary.sh" && summarize_tests "{path}"'],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_finished_runs_summary_is_its_failures_and_last_line(tmp_path):
    log = (
        "..F.s [100%]\n=== short test summary info ===\n"
        "FAILED tests/ops/test_a.py::test_x - AssertionError\n=== 1 failed, 3 passed, 1 skipped in 4.0s ===\n"
    )
    assert _summary(tmp_path, log) == [
        "FAILED tests/ops/test_a.py::test_x - AssertionError",
        "=== 1 failed, 3 passed, 1 skipped in 4.0s ===",
    ]


def test_a_run_the_limit_stopped_says_how_far_it_got_and_where(tmp_path):
    # pytest -q's progress, then faulthandler's dump on SIGABRT, innermost frame first
    log = (
        "..s.....s" + "." * 63 + " [ 46%]\n"
        ".....Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n"
        '  File "/w/tests/ops/_helpers.py", line 70 in mask_helper\n'
        '  File "/w/tests/ops/test_k.py", line 296 in test_split\n'
        '  File "/venv/lib/python3.12/site-packages/_pytest/python.py", line 167 in pytest_pyfunc_call\n'
        '  File "/w/tests/conftest.py", line 9 in fixture\n\nExtension modules: numpy (total: 1)\n'
    )
    assert _summary(tmp_path, log) == [
        "stopped by the limit after: 75 passed, 2 skipped",
        '  File "/w/tests/ops/_helpers.py", line 70 in mask_helper',
        '  File "/w/tests/ops/test_k.py", line 296 in test_split',
    ]
