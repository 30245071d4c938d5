import json

import pytest

from hf_sparse import SparsityConfig


def test_json_round_trip(tmp_path):
    cfg = SparsityConfig(
        pattern="64:2:8", schedule="linear", start=0.1, end=200, update_every=7, targets=["encoder"], ignore=["pooler"]
    )
    path = tmp_path / "cfg.json"
    cfg.to_json_file(path)
    again = SparsityConfig.from_json_file(path)
    assert again == cfg
    assert isinstance(again.start, float) and isinstance(again.end, int)
    assert json.loads(path.read_text())["hf_sparse_version"]


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        ({"pattern": "3:2"}, "pattern", "'3:2'"),
        ({"schedule": "exp"}, "schedule", "'cubic'"),
        ({"start": 1.5}, "start", "for an absolute step pass an int"),
        ({"start": 0.6, "end": 0.2}, "end", "before start"),
        ({"update_every": 0}, "update_every", ">= 1"),
        ({"targets": ["(unclosed"]}, "targets", "not a valid regex"),
        ({"score": "taylor"}, "score", "magnitude"),
        ({"pattern": "2:8", "transposable": True}, "transposable", "'2:4'"),
        ({"pattern": "2:4", "global_unstructured": True}, "global_unstructured", "unstructured"),
        ({"start": "0.1"}, "start", "fraction"),
    ],
)
def test_errors_name_field_value_and_allowed(kwargs, field, text):
    with pytest.raises(ValueError) as info:
        SparsityConfig(**kwargs)
    assert f"SparsityConfig.{field}" in str(info.value) and text in str(info.value)


def test_unknown_keys_warn(tmp_path):
    with pytest.warns(UserWarning, match="upgrade hf_sparse"):
        cfg = SparsityConfig.from_dict({"pattern": "2:4", "future_knob": 3})
    assert cfg.pattern == "2:4"
