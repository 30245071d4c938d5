"""GLUE and SQuAD metrics computed locally, without downloading anything.

``evaluate.load("glue", ...)`` and ``evaluate.load("squad")`` fetch their code from the Hugging Face Hub, which is
not reachable from every machine that trains with hf_sparse (and a metric that silently changes upstream makes
tables irreproducible). These functions return the same keys and the same values as those Hub metrics: GLUE
metrics as fractions in ``[0, 1]`` (correlations in ``[-1, 1]``), SQuAD scores as percentages in ``[0, 100]``.
Only numpy is needed; ties in Spearman's rank correlation get average ranks, as in ``scipy.stats.spearmanr``.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "GLUE_TASK_METRICS",
    "accuracy",
    "binary_f1",
    "glue_metrics",
    "matthews_corrcoef",
    "normalize_answer",
    "pearson",
    "spearman",
    "squad_exact_match",
    "squad_f1",
    "squad_metrics",
    "squad_v2_metrics",
]

#: The metrics each GLUE task reports, in the order and with the names of the Hub ``glue`` metric.
GLUE_TASK_METRICS: dict[str, tuple[str, ...]] = {
    "cola": ("matthews_correlation",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"),
    "stsb": ("pearson", "spearmanr"),
    "mnli": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "mnli_matched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "hans": ("accuracy",),
}


def _pair(predictions: Iterable, references: Iterable, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(list(predictions) if not isinstance(predictions, np.ndarray) else predictions, dtype=dtype)
    r = np.asarray(list(references) if not isinstance(references, np.ndarray) else references, dtype=dtype)
    p, r = p.reshape(-1), r.reshape(-1)
    if p.shape != r.shape:
        raise ValueError(f"predictions ({p.size}) and references ({r.size}) must have the same length")
    if p.size == 0:
        raise ValueError("cannot compute a metric over zero examples: pass at least one prediction")
    return p, r


def accuracy(predictions: Iterable, references: Iterable) -> float:
    """Fraction of predictions equal to their reference."""
    p, r = _pair(predictions, references)
    return float(np.mean(p == r))


def binary_f1(predictions: Iterable, references: Iterable, *, pos_label: int = 1) -> float:
    """F1 of the positive class (``sklearn.metrics.f1_score`` default); 0.0 when there are no true positives."""
    p, r = _pair(predictions, references)
    tp = float(np.sum((p == pos_label) & (r == pos_label)))
    fp = float(np.sum((p == pos_label) & (r != pos_label)))
    fn = float(np.sum((p != pos_label) & (r == pos_label)))
    if tp == 0.0:
        return 0.0
    return 2.0 * tp / (2.0 * tp + fp + fn)


def matthews_corrcoef(predictions: Iterable, references: Iterable) -> float:
    """Matthews correlation for any number of classes (Gorodkin's R_K, as in scikit-learn); 0.0 when undefined."""
    p, r = _pair(predictions, references)
    classes, inverse = np.unique(np.concatenate([r, p]), return_inverse=True)
    r_idx, p_idx = inverse[: r.size], inverse[r.size :]
    k = classes.size
    confusion = np.zeros((k, k), dtype=np.float64)
    np.add.at(confusion, (r_idx, p_idx), 1.0)
    t_sum, p_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    n_correct, n = np.trace(confusion), confusion.sum()
    cov_ytyp = n_correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n * n - np.dot(p_sum, p_sum)
    cov_ytyt = n * n - np.dot(t_sum, t_sum)
    denom = cov_ytyt * cov_ypyp
    if denom == 0.0:
        return 0.0
    return float(cov_ytyp / np.sqrt(denom))


def pearson(predictions: Iterable, references: Iterable) -> float:
    """Pearson's correlation coefficient; ``nan`` when either side is constant (as scipy)."""
    p, r = _pair(predictions, references, dtype=np.float64)
    pc, rc = p - p.mean(), r - r.mean()
    denom = np.sqrt(np.dot(pc, pc) * np.dot(rc, rc))
    if denom == 0.0:
        return float("nan")
    return float(np.clip(np.dot(pc, rc) / denom, -1.0, 1.0))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Runs of equal values share the mean of the 1-based ranks they span.
    starts = np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]])
    run_id = np.cumsum(starts) - 1
    run_start = np.flatnonzero(starts)
    run_end = np.concatenate([run_start[1:], [x.size]])
    mean_rank = (run_start + run_end + 1) / 2.0
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = mean_rank[run_id]
    return ranks


def spearman(predictions: Iterable, references: Iterable) -> float:
    """Spearman's rank correlation: Pearson on average ranks (ties handled as ``scipy.stats.spearmanr``)."""
    p, r = _pair(predictions, references, dtype=np.float64)
    return pearson(_average_ranks(p), _average_ranks(r))


_GLUE_FUNCTIONS = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "matthews_correlation": matthews_corrcoef,
    "pearson": pearson,
    "spearmanr": spearman,
}


def glue_metrics(task_name: str, predictions: Iterable, references: Iterable) -> dict[str, float]:
    """The metrics the Hub ``glue`` metric reports for ``task_name`` (e.g. ``{"accuracy": …, "f1": …}`` for mrpc).

    ``predictions`` are class ids (or scores for ``stsb``), not logits: take the ``argmax`` first.
    """
    key = task_name.lower().replace("-", "")
    if key not in GLUE_TASK_METRICS:
        raise ValueError(f"unknown GLUE task '{task_name}'; expected one of {sorted(GLUE_TASK_METRICS)}")
    p, r = _pair(predictions, references)
    return {name: _GLUE_FUNCTIONS[name](p, r) for name in GLUE_TASK_METRICS[key]}


# --------------------------------------------------------------------------------------------------------- SQuAD

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation: lower case, drop punctuation and the articles a/an/the, squash spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def squad_exact_match(prediction: str, ground_truth: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_f1(prediction: str, ground_truth: str, *, empty_matches_empty: bool = False) -> float:
    """Token-level F1 between normalised answers.

    The v1.1 evaluator scores an empty side as 0; the v2.0 evaluator scores it 1 when both are empty (a correct
    "no answer") and 0 otherwise. ``empty_matches_empty=True`` selects the v2.0 rule.
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    if empty_matches_empty and (not pred_tokens or not gold_tokens):
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2.0 * precision * recall / (precision + recall)


def _answer_texts(answers) -> list[str]:
    """Accept the nested SQuAD form (``[{"text": …}]``), the flat HF form (``{"text": [...]}``) or plain strings."""
    if isinstance(answers, Mapping):
        return list(answers.get("text", []))
    return [a["text"] if isinstance(a, Mapping) else str(a) for a in answers]


def squad_metrics(
    predictions: Mapping[str, str] | Sequence[Mapping],
    references: Mapping[str, object] | Sequence[Mapping],
) -> dict[str, float]:
    """SQuAD v1.1 ``{"exact_match", "f1"}`` in percent: the maximum over each question's gold answers, averaged.

    Either ``{id: prediction_text}`` and ``{id: answers}``, or the Hub ``squad`` metric's lists
    (``[{"id", "prediction_text"}]`` and ``[{"id", "answers"}]``). Questions without a prediction score 0, as in
    the official evaluator.
    """
    preds, refs = _as_maps(predictions, references)
    em = f1 = 0.0
    for qid, answers in refs.items():
        golds = _answer_texts(answers)
        if qid not in preds or not golds:
            continue
        pred = preds[qid]
        em += max(squad_exact_match(pred, g) for g in golds)
        f1 += max(squad_f1(pred, g) for g in golds)
    total = max(len(refs), 1)
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1 / total}


def squad_v2_metrics(
    predictions: Mapping[str, str] | Sequence[Mapping],
    references: Mapping[str, object] | Sequence[Mapping],
) -> dict[str, float]:
    """SQuAD v2.0 scores in percent with the keys of the Hub ``squad_v2`` metric, at a fixed threshold.

    A question without gold answers is unanswerable: only the empty prediction is right. The threshold on the
    no-answer score is applied earlier, in post-processing (``--null_score_diff_threshold``).
    """
    preds, refs = _as_maps(predictions, references)
    exact: dict[str, float] = {}
    f1: dict[str, float] = {}
    has_ans: list[str] = []
    for qid, answers in refs.items():
        golds = [g for g in _answer_texts(answers) if normalize_answer(g)] or [""]
        if golds != [""]:
            has_ans.append(qid)
        pred = preds.get(qid, None)
        if pred is None:
            exact[qid] = f1[qid] = 0.0
            continue
        exact[qid] = max(squad_exact_match(pred, g) for g in golds)
        f1[qid] = max(squad_f1(pred, g, empty_matches_empty=True) for g in golds)
    has = set(has_ans)
    no_ans = [q for q in refs if q not in has]

    def mean(values: dict[str, float], ids: Iterable[str]) -> float:
        ids = list(ids)
        return 100.0 * sum(values[i] for i in ids) / len(ids)

    out = {"exact": mean(exact, refs), "f1": mean(f1, refs), "total": float(len(refs))}
    if has_ans:
        out.update(HasAns_exact=mean(exact, has_ans), HasAns_f1=mean(f1, has_ans), HasAns_total=float(len(has_ans)))
    if no_ans:
        out.update(NoAns_exact=mean(exact, no_ans), NoAns_f1=mean(f1, no_ans), NoAns_total=float(len(no_ans)))
    return out


def _as_maps(predictions, references) -> tuple[dict[str, str], dict[str, object]]:
    if isinstance(predictions, Mapping):
        preds = {str(k): v for k, v in predictions.items()}
    else:
        preds = {str(p["id"]): p["prediction_text"] for p in predictions}
    if isinstance(references, Mapping):
        refs = {str(k): v for k, v in references.items()}
    else:
        refs = {str(r["id"]): r["answers"] for r in references}
    if not refs:
        raise ValueError("no reference questions: pass at least one {id: answers} entry")
    return preds, refs
