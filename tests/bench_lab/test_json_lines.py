"""CPU: ``bench_kernels.json_lines``, the ``--json`` output of the timeline and sweep scripts: rows appended one JSON
object a line after what the file held, each readable before the run ends (a run cut short keeps them); and
``compare_sweeps.load`` on a file a killed run left, whose cells ``sweep_split_k.py --resume`` skips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_kernels import json_lines
from compare_sweeps import load

SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_split_k.py"


def test_rows_are_appended_and_flushed_at_once(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"earlier": 1}\n')
    with json_lines(str(path)) as append_row:
        append_row({"k": 768, "r": 3072, "chain_us": 36.4})
        assert path.read_text().splitlines()[-1] == '{"k": 768, "r": 3072, "chain_us": 36.4}'
        append_row({"pattern": "128:2:16", "units": 6})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"earlier": 1},
        {"k": 768, "r": 3072, "chain_us": 36.4},
        {"pattern": "128:2:16", "units": 6},
    ]


def test_without_a_path_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with json_lines(None) as append_row:
        append_row({"k": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_row_a_killed_run_left_half_written_is_ended_and_skipped(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"pattern": "64:2:8", "k": 4096, "r": 11008, "tokens": 64, "dense": 30.1}\n{"pattern": "64:2')
    with json_lines(str(path)) as append_row:
        append_row({"pattern": "64:2:8", "k": 4096, "r": 11008, "tokens": 128, "dense": 35.2})
    lines = path.read_text().splitlines()
    assert lines[1] == '{"pattern": "64:2'
    assert json.loads(lines[2])["tokens"] == 128
    rows = load([str(path)])
    assert set(rows) == {("64:2:8", 4096, 11008, 64), ("64:2:8", 4096, 11008, 128)}
    assert [r["dense"] for r in rows[("64:2:8", 4096, 11008, 128)]] == [35.2]
    assert f"{path}:2 is not a whole row" in capsys.readouterr().err


def test_sweep_resume_without_a_json_file_is_refused():
    done = subprocess.run(
        [sys.executable, str(SWEEP), "--product-only", "--resume"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "--resume needs --json" in done.stderr
