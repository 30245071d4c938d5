"""CPU: ``bench_kernels.json_lines``, the ``--json`` output of the timeline and sweep scripts: rows appended one JSON
object a line after what the file held, each readable before the run ends (a run cut short keeps them)."""

from __future__ import annotations

import json

from bench_kernels import json_lines


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
