"""GLUE and SQuAD metrics against values computed by hand (and against scipy where it is installed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hf_sparse.metrics import (
    accuracy,
    binary_f1,
    glue_metrics,
    matthews_corrcoef,
    normalize_answer,
    pearson,
    spearman,
    squad_exact_match,
    squad_f1,
    squad_metrics,
    squad_v2_metrics,
)

# preds/refs: tp = 2 (idx 0, 4), fp = 1 (idx 1), fn = 1 (idx 3), tn = 1 (idx 2)
PREDS = [1, 1, 0, 0, 1]
REFS = [1, 0, 0, 1, 1]


def test_accuracy():
    assert accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == 0.75
    assert accuracy(np.array([[1], [2]]), [1, 2]) == 1.0


def test_binary_f1_by_hand():
    assert binary_f1(PREDS, REFS) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # 2tp / (2tp + fp + fn) = 2/3
    assert binary_f1([0, 0], [1, 1]) == 0.0


def test_matthews_binary_by_hand():
    # (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (2 - 1) / sqrt(3*3*2*2) = 1/6
    assert matthews_corrcoef(PREDS, REFS) == pytest.approx(1 / 6)
    assert matthews_corrcoef([0, 1, 0, 1], [0, 1, 0, 1]) == pytest.approx(1.0)
    assert matthews_corrcoef([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)
    assert matthews_corrcoef([1, 1, 1, 1], [0, 1, 0, 1]) == 0.0  # undefined -> 0, as scikit-learn


def test_matthews_multiclass_by_hand():
    # confusion (rows = truth): [[1,0,0],[0,1,1],[1,0,0]]; t = [1,2,1], p = [2,1,1], c = 2, s = 4
    # (c*s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)) = (8 - 5) / sqrt((16 - 6)(16 - 6)) = 0.3
    assert matthews_corrcoef([0, 1, 2, 0], [0, 1, 1, 2]) == pytest.approx(0.3)


def test_pearson_by_hand():
    # dx = [-1, 0, 1], dy = [-7/3, -1/3, 8/3]: r = 5 / (sqrt(2) * sqrt(114) / 3) = 15 / sqrt(228)
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(15 / math.sqrt(228))
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))


def test_spearman_with_ties_by_hand():
    # ranks x = [1, 2.5, 2.5, 4], y = [1, 3, 2, 4]: r = 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert spearman([10, 20, 30], [3, 2, 1]) == pytest.approx(-1.0)


def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, 200).astype(float)
    y = x + rng.normal(size=200)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)


def test_glue_metrics_keys():
    assert glue_metrics("mrpc", PREDS, REFS) == pytest.approx({"accuracy": 0.6, "f1": 2 / 3})
    assert set(glue_metrics("stsb", [1.0, 2.0, 3.0], [1.0, 2.5, 2.9])) == {"pearson", "spearmanr"}
    assert set(glue_metrics("cola", PREDS, REFS)) == {"matthews_correlation"}
    assert set(glue_metrics("SST-2", PREDS, REFS)) == {"accuracy"}
    with pytest.raises(ValueError, match="unknown GLUE task 'boolq'"):
        glue_metrics("boolq", PREDS, REFS)
    with pytest.raises(ValueError, match="same length"):
        accuracy([1, 2], [1])


def test_normalize_answer_official_rules():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("  ") == ""


def test_squad_scores_by_hand():
    assert squad_exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
    # pred [cat, sat], gold [cat, sat, down]: precision 1, recall 2/3 -> F1 0.8
    assert squad_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert squad_f1("", "cat") == 0.0
    assert squad_f1("", "", empty_matches_empty=True) == 1.0


def test_squad_metrics_max_over_answers_and_missing_ids():
    refs = {"a": [{"text": "on the mat"}, {"text": "mat"}], "b": {"text": ["Paris"], "answer_start": [0]}}
    # a: EM 1 against "mat"; b: missing -> 0
    assert squad_metrics({"a": "the mat"}, refs) == pytest.approx({"exact_match": 50.0, "f1": 50.0})
    preds = [{"id": "a", "prediction_text": "mat"}, {"id": "b", "prediction_text": "paris france"}]
    refs_list = [{"id": "a", "answers": refs["a"]}, {"id": "b", "answers": refs["b"]}]
    # b: F1 = 2 * (1/2 * 1) / (1/2 + 1) = 2/3
    assert squad_metrics(preds, refs_list) == pytest.approx({"exact_match": 50.0, "f1": 100 * (1 + 2 / 3) / 2})


def test_squad_v2_metrics():
    refs = {"has": {"text": ["Paris"], "answer_start": [0]}, "none": {"text": [], "answer_start": []}}
    out = squad_v2_metrics({"has": "Paris", "none": ""}, refs)
    assert out["exact"] == 100.0 and out["f1"] == 100.0 and out["total"] == 2
    assert out["HasAns_total"] == 1 and out["NoAns_total"] == 1
    out = squad_v2_metrics({"has": "", "none": "Paris"}, refs)
    assert out["exact"] == 0.0 and out["f1"] == 0.0
