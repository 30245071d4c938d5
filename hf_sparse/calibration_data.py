"""Calibration text from a file, tokenized into batches: what ``hf-sparse prune`` feeds :func:`hf_sparse.oneshot`.

Reads the formats the example scripts read: ``.tsv`` (GLUE files as downloaded: tab-separated, a header row, no
quoting), ``.csv``, ``.json`` (a list of records, records under a ``"data"`` key, or SQuAD's nested
``data → paragraphs → context/qas``) and ``.jsonl`` (one record per line). The text column is the one named, or
else the first of :data:`TEXT_COLUMNS` present, or else the first column whose values are text.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

__all__ = ["TEXT_COLUMNS", "calibration_batches", "read_texts"]

#: Column names tried, in order, when no text column is named.
TEXT_COLUMNS = ("text", "sentence", "sentence1", "question", "context", "content", "document", "premise")
_SUFFIXES = (".tsv", ".csv", ".json", ".jsonl")


def _records(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"calibration file {path}: expected one of {', '.join(_SUFFIXES)}, got {suffix!r}")
    text = path.read_text(encoding="utf-8-sig")
    if suffix in (".tsv", ".csv"):
        if suffix == ".tsv":
            return list(csv.DictReader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
        return list(csv.DictReader(text.splitlines()))
    if suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if data and isinstance(data[0], dict) and "paragraphs" in data[0]:  # SQuAD: one record per paragraph
        return [{"context": p["context"]} for article in data for p in article["paragraphs"]]
    if not isinstance(data, list):
        raise ValueError(f"calibration file {path}: JSON must be a list of records or {{'data': [...]}}")
    return data


def read_texts(path: str | Path, text_column: str | None = None) -> list[str]:
    """The non-empty texts of ``path`` (see the module docstring for formats and the column choice)."""
    path = Path(path)
    records = [r for r in _records(path) if isinstance(r, dict)]
    if not records:
        raise ValueError(f"calibration file {path}: no records")
    columns = list(records[0])
    if text_column is None:
        text_column = next((c for c in TEXT_COLUMNS if c in columns), None)
        if text_column is None:
            text_column = next((c for c in columns if isinstance(records[0][c], str) and " " in records[0][c]), None)
        if text_column is None:
            raise ValueError(f"calibration file {path}: no text column found among {columns}; pass --text_column")
    elif text_column not in columns:
        raise ValueError(f"calibration file {path}: no column {text_column!r}; columns: {columns}")
    texts = [r.get(text_column) for r in records]
    return [t for t in texts if isinstance(t, str) and t.strip()]


def calibration_batches(
    texts: list[str], tokenizer, *, num_samples: int, max_seq_length: int, batch_size: int = 8, seed: int = 0
) -> list[dict]:
    """``num_samples`` texts drawn at random (``seed``), tokenized (truncated to ``max_seq_length``, padded per
    batch) into batches of ``batch_size``. Tokenizers without a padding token (GPT-2, Llama) pad with EOS."""
    if num_samples < 1 or batch_size < 1 or max_seq_length < 1:
        raise ValueError(
            f"num_samples={num_samples}, batch_size={batch_size}, max_seq_length={max_seq_length}: all must be >= 1"
        )
    chosen = random.Random(seed).sample(texts, min(num_samples, len(texts)))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return [
        dict(
            tokenizer(
                chosen[i : i + batch_size],
                truncation=True,
                max_length=max_seq_length,
                padding=True,
                return_tensors="pt",
            )
        )
        for i in range(0, len(chosen), batch_size)
    ]
