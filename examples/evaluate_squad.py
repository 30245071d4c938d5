#!/usr/bin/env python
"""Score SQuAD predictions with the interface of the official evaluator (``evaluate-v1.1.py``).

    python examples/evaluate_squad.py dev-v1.1.json predictions.json
    {"exact_match": 81.2, "f1": 88.5}

``predictions.json`` maps question ids to answer texts (``run_qa.py`` writes it). As in the official script, a
question without a prediction scores 0 and is reported on stderr, and a dataset whose ``version`` is not 1.1 gets a
warning. A v2.0 dataset (questions marked ``is_impossible``) is scored with the v2.0 rules and keys
(``exact``, ``f1``, ``HasAns_*``, ``NoAns_*``), where an empty prediction means "no answer".
The normalisation and scores are :mod:`hf_sparse.metrics`'s, checked against hand-computed values in the tests.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # utils_qa.py next to this script

from utils_qa import flatten_squad, is_nested_squad, read_json_file  # noqa: E402

EXPECTED_VERSION = "1.1"


def _metrics_module():
    """``hf_sparse.metrics`` without running ``hf_sparse/__init__`` (torch + transformers: seconds for a CLI).

    The metrics file is pure numpy by design, so it is executed on its own.
    """
    if "hf_sparse" in sys.modules:
        return importlib.import_module("hf_sparse.metrics")
    spec = importlib.util.find_spec("hf_sparse")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("hf_sparse is not importable: pip install it, or put a checkout on PYTHONPATH")
    path = Path(next(iter(spec.submodule_search_locations))) / "metrics.py"
    module_spec = importlib.util.spec_from_file_location("_hf_sparse_metrics", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def evaluate(dataset_path: str, predictions_path: str, *, warn=lambda msg: print(msg, file=sys.stderr)) -> dict:
    """Scores of ``predictions_path`` (``{id: text}``) against a nested SQuAD ``dataset_path``."""
    document = read_json_file(dataset_path)
    if not is_nested_squad(document):
        raise SystemExit(f"{dataset_path}: not a SQuAD dataset (expected {{'version', 'data': [{{'paragraphs'}}]}})")
    predictions = read_json_file(predictions_path)
    if isinstance(predictions, list):  # the Hub metric's [{"id", "prediction_text"}] form
        predictions = {str(p["id"]): p["prediction_text"] for p in predictions}
    if not isinstance(predictions, dict):
        raise SystemExit(f"{predictions_path}: expected a JSON object mapping question ids to answer texts")

    version_2 = any(
        qa.get("is_impossible", False) for a in document["data"] for p in a["paragraphs"] for qa in p["qas"]
    )
    version = str(document.get("version", ""))
    if not version_2 and version != EXPECTED_VERSION:
        warn(f"Evaluation expects v-{EXPECTED_VERSION}, but got dataset with v-{version}")
    references = {r["id"]: r["answers"] for r in flatten_squad(document)}
    for qid in references:
        if qid not in predictions:
            warn(f"Unanswered question {qid} will receive score 0.")
    metrics = _metrics_module()
    if version_2:
        return metrics.squad_v2_metrics(predictions, references)
    return metrics.squad_metrics(predictions, references)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Evaluation for SQuAD {EXPECTED_VERSION}")
    parser.add_argument("dataset_file", help="Dataset file (nested SQuAD JSON; .xz/.gz accepted)")
    parser.add_argument("prediction_file", help="Prediction file ({question id: answer text})")
    args = parser.parse_args(argv)
    print(json.dumps(evaluate(args.dataset_file, args.prediction_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
