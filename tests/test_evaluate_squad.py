"""``examples/evaluate_squad.py``: the official evaluator's command line, on small files written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "evaluate_squad.py"
SHARED_DEV = ROOT.parent / "shared" / "data" / "squad" / "dev-v1.1.json"


def _dataset(version="1.1", impossible=False):
    qas = [
        {
            "id": "q1",
            "question": "Where?",
            "answers": [{"text": "on the mat", "answer_start": 8}, {"text": "the mat", "answer_start": 11}],
        },
        {"id": "q2", "question": "Who?", "answers": [{"text": "The cat", "answer_start": 0}]},
    ]
    if impossible:
        qas.append({"id": "q3", "question": "Why?", "answers": [], "is_impossible": True})
    return {
        "version": version,
        "data": [{"title": "t", "paragraphs": [{"context": "The cat on the mat.", "qas": qas}]}],
    }


def _run(tmp_path, dataset, predictions):
    data, preds = tmp_path / "data.json", tmp_path / "preds.json"
    data.write_text(json.dumps(dataset))
    preds.write_text(json.dumps(predictions))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(data), str(preds)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_official_interface_and_scores(tmp_path):
    # q1: "a mat too" -> [mat, too] vs [on, mat]: F1 1/2, vs [mat]: F1 2/3, EM 0; q2: "cat" -> EM 1 ("the" dropped)
    out, err = _run(tmp_path, _dataset(), {"q1": "a mat too", "q2": "cat"})
    assert set(out) == {"exact_match", "f1"}
    assert out["exact_match"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(100 * (2 / 3 + 1) / 2)
    assert err == ""


def test_missing_prediction_and_version_warning(tmp_path):
    out, err = _run(tmp_path, _dataset(version="1.0"), {"q2": "The cat"})
    assert out == {"exact_match": 50.0, "f1": 50.0}
    assert "Unanswered question q1 will receive score 0." in err
    assert "Evaluation expects v-1.1, but got dataset with v-1.0" in err


def test_v2_dataset_uses_v2_rules(tmp_path):
    out, _ = _run(tmp_path, _dataset(version="v2.0", impossible=True), {"q1": "on the mat", "q2": "x", "q3": ""})
    assert out["exact"] == pytest.approx(200 / 3)
    assert out["NoAns_exact"] == 100.0 and out["HasAns_exact"] == 50.0


def test_in_process_gold_answers_on_real_dev_set():
    if not SHARED_DEV.is_file():
        pytest.skip(f"{SHARED_DEV} not present")
    sys.path.insert(0, str(SCRIPT.parent))
    import evaluate_squad

    data = json.loads(SHARED_DEV.read_text())
    gold = {qa["id"]: qa["answers"][0]["text"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gold_{os.getpid()}.json"
    path.write_text(json.dumps(gold))
    try:
        assert evaluate_squad.evaluate(str(SHARED_DEV), str(path)) == {"exact_match": 100.0, "f1": 100.0}
    finally:
        path.unlink()
