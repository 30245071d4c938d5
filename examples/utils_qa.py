"""Reading SQuAD files and turning start/end logits into answer spans.

Shared by ``run_qa.py`` and ``evaluate_squad.py``. The post-processing follows the standard recipe of the
Transformers question-answering example (so scores are comparable with published ones): for every example, look
at the ``n_best_size`` best start and end positions of each of its features (sliding windows), keep the spans that
lie inside the context, end after they start and are at most ``max_answer_length`` tokens long, score a span by the
sum of its start and end logits, and map the best one back to characters through the offset mapping. With
SQuAD v2 the empty answer competes through the score of the ``[CLS]`` position.
"""

from __future__ import annotations

import collections
import gzip
import json
import logging
import lzma
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["is_nested_squad", "load_squad_file", "open_text", "postprocess_qa_predictions", "read_json_file"]


def open_text(path: str | os.PathLike):
    """Open a text file, transparently decompressing ``.xz`` and ``.gz`` (the SQuAD train set ships as ``.xz``)."""
    path = str(path)
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_json_file(path: str | os.PathLike):
    """A JSON document, or the list of records of a JSON Lines file (``.jsonl``, or a ``.json`` with one per line)."""
    with open_text(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def is_nested_squad(document) -> bool:
    """True for the original SQuAD layout: ``{"data": [{"title", "paragraphs": [{"context", "qas"}]}]}``."""
    if not isinstance(document, dict) or not isinstance(document.get("data"), list) or not document["data"]:
        return False
    first = document["data"][0]
    return isinstance(first, dict) and "paragraphs" in first


def flatten_squad(document: dict) -> list[dict]:
    """One record per question, in the column layout of the Hub ``squad`` dataset.

    ``answers`` becomes ``{"text": [...], "answer_start": [...]}``; an unanswerable v2 question (``is_impossible``)
    gets empty lists, which is how the Hub ``squad_v2`` dataset marks it.
    """
    records = []
    for article in document["data"]:
        title = article.get("title", "")
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible", False) else qa.get("answers", [])
                records.append(
                    {
                        "id": str(qa["id"]),
                        "title": title,
                        "context": context,
                        "question": qa["question"],
                        "answers": {
                            "text": [a["text"] for a in answers],
                            "answer_start": [int(a["answer_start"]) for a in answers],
                        },
                    }
                )
    return records


def load_squad_file(path: str | os.PathLike) -> list[dict]:
    """Records from a nested SQuAD JSON, a flat JSON (a list, or ``{"data": [...]}``) or JSON Lines file."""
    document = read_json_file(path)
    if is_nested_squad(document):
        return flatten_squad(document)
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        return document["data"]
    if isinstance(document, list):
        return document
    raise ValueError(
        f"{path}: not a SQuAD file. Expected the nested SQuAD layout ({{'data': [{{'paragraphs': ...}}]}}), a list "
        "of records with id/question/context/answers, or JSON Lines of such records"
    )


def _best_indices(logits: np.ndarray, n: int) -> list[int]:
    return np.argsort(logits)[-1 : -n - 1 : -1].tolist()


def postprocess_qa_predictions(
    examples: Sequence[dict] | Iterable[dict],
    features,
    predictions: tuple[np.ndarray, np.ndarray],
    *,
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
    output_dir: str | os.PathLike | None = None,
    prefix: str | None = None,
) -> dict[str, str]:
    """Map per-feature start/end logits to one answer text per example id.

    ``features`` must carry ``example_id`` and ``offset_mapping`` (``None`` for tokens outside the context), as
    produced by ``run_qa.py``'s validation preprocessing. With ``version_2_with_negative`` the empty answer wins
    when its score beats the best span by more than ``null_score_diff_threshold``. When ``output_dir`` is given,
    writes ``predictions.json`` and ``nbest_predictions.json`` (and ``null_odds.json`` for v2) there, named with
    ``prefix`` (e.g. ``eval_predictions.json``).
    """
    all_start, all_end = predictions
    example_ids = features["example_id"]
    if len(all_start) != len(example_ids):
        raise ValueError(
            f"got {len(all_start)} predictions for {len(example_ids)} features: they must match one to one"
        )

    features_by_example: dict[str, list[int]] = collections.defaultdict(list)
    for i, example_id in enumerate(example_ids):
        features_by_example[example_id].append(i)
    offsets_column = features["offset_mapping"]

    answers: dict[str, str] = {}
    nbest_json: dict[str, list[dict]] = {}
    null_odds: dict[str, float] = {}
    for example in examples:
        context = example["context"]
        min_null_score = None
        candidates = []
        for fi in features_by_example.get(example["id"], []):
            start_logits, end_logits = all_start[fi], all_end[fi]
            offsets = offsets_column[fi]
            null_score = float(start_logits[0] + end_logits[0])
            if min_null_score is None or null_score < min_null_score:
                min_null_score = null_score
            for s in _best_indices(start_logits, n_best_size):
                for e in _best_indices(end_logits, n_best_size):
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue  # outside the context (question, special tokens or padding)
                    if len(offsets[s]) < 2 or len(offsets[e]) < 2:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    start_char, end_char = offsets[s][0], offsets[e][1]
                    candidates.append(
                        {
                            "text": context[start_char:end_char],
                            "score": float(start_logits[s] + end_logits[e]),
                            "start_logit": float(start_logits[s]),
                            "end_logit": float(end_logits[e]),
                            "offsets": (int(start_char), int(end_char)),
                        }
                    )
        candidates.sort(key=lambda c: c["score"], reverse=True)
        candidates = candidates[:n_best_size]
        if version_2_with_negative and min_null_score is not None:
            candidates.append({"text": "", "score": min_null_score, "start_logit": None, "end_logit": None})
            candidates.sort(key=lambda c: c["score"], reverse=True)
            candidates = candidates[: n_best_size + 1]
        if not candidates:  # no valid span in any window (or no feature at all): answer empty, as upstream does
            candidates = [{"text": "", "score": 0.0, "start_logit": 0.0, "end_logit": 0.0}]

        scores = np.array([c["score"] for c in candidates], dtype=np.float64)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        for c, p in zip(candidates, probs, strict=True):
            c["probability"] = float(p)

        if not version_2_with_negative:
            answers[example["id"]] = candidates[0]["text"]
        else:
            best_span = next((c for c in candidates if c["text"] != ""), None)
            if best_span is None:
                answers[example["id"]] = ""
                null_odds[example["id"]] = float("inf")
            else:
                diff = min_null_score - best_span["score"]
                null_odds[example["id"]] = float(diff)
                answers[example["id"]] = "" if diff > null_score_diff_threshold else best_span["text"]
        nbest_json[example["id"]] = [{k: v for k, v in c.items() if k != "offsets"} for c in candidates]

    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = (lambda stem: f"{prefix}_{stem}.json") if prefix else (lambda stem: f"{stem}.json")
        _dump(out / name("predictions"), answers)
        _dump(out / name("nbest_predictions"), nbest_json)
        if version_2_with_negative:
            _dump(out / name("null_odds"), null_odds)
        logger.info("wrote predictions of %d examples to %s", len(answers), out)
    return answers


def _dump(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
