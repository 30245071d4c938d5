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


def test_unknown_key_in_a_json_file_is_an_error_with_a_suggestion(tmp_path):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"patern": "64:2:8"}))
    with pytest.raises(ValueError) as info:
        SparsityConfig.from_json_file(path)
    text = str(info.value)
    assert str(path) in text and "unknown key 'patern' (did you mean 'pattern'?)" in text
    assert "valid keys: [" in text and "'update_every'" in text


def test_unknown_key_in_a_dict_is_an_error():
    with pytest.raises(ValueError, match=r"unknown key 'future_knob'; valid keys"):
        SparsityConfig.from_dict({"pattern": "2:4", "future_knob": 3})


@pytest.mark.parametrize("field", ["transposable", "global_unstructured", "dynamic"])
@pytest.mark.parametrize("value", ["false", "true", "yes", 0, 1, None])
def test_bool_fields_take_only_bools(field, value):
    with pytest.raises(ValueError) as info:
        SparsityConfig(**{field: value})
    assert f"SparsityConfig.{field}={value!r}" in str(info.value) and "True or False" in str(info.value)


def test_json_booleans_and_quoted_ones(tmp_path):
    path = tmp_path / "recipe.json"
    path.write_text('{"dynamic": true, "masked_decay": 0.1}')
    assert SparsityConfig.from_json_file(path).dynamic is True
    path.write_text('{"dynamic": "false"}')
    with pytest.raises(ValueError, match=r"SparsityConfig\.dynamic='false': must be a bool"):
        SparsityConfig.from_json_file(path)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"start": float("nan")}, "start"),
        ({"end": float("inf")}, "end"),
        ({"start": True}, "start"),
        ({"update_every": True}, "update_every"),
        ({"update_every": "100"}, "update_every"),
        ({"obs_num_grads": 2.0}, "obs_num_grads"),
        ({"obs_block_size": True}, "obs_block_size"),
        ({"obs_damp": float("nan")}, "obs_damp"),
        ({"obs_damp": float("inf")}, "obs_damp"),
        ({"obs_damp": "0.01"}, "obs_damp"),
        ({"dynamic": True, "masked_decay": float("nan")}, "masked_decay"),
        ({"dynamic": True, "masked_decay": float("inf")}, "masked_decay"),
        ({"dynamic": True, "masked_decay": True}, "masked_decay"),
        ({"dynamic": True, "dense_finetune_start": float("nan")}, "dense_finetune_start"),
    ],
)
def test_number_fields_reject_bools_strings_and_non_finite(kwargs, field):
    with pytest.raises(ValueError) as info:
        SparsityConfig(**kwargs)
    assert f"SparsityConfig.{field}={kwargs[field]!r}" in str(info.value)


@pytest.mark.parametrize("field", ["targets", "ignore"])
@pytest.mark.parametrize("value", [123, [1, 2], {"encoder": 1}])
def test_targets_and_ignore_name_the_field_and_what_is_allowed(field, value):
    with pytest.raises(ValueError) as info:
        SparsityConfig(**{field: value})
    assert f"SparsityConfig.{field}={value!r}" in str(info.value) and "list of regex strings" in str(info.value)


def test_targets_as_a_tuple_or_a_string_become_a_list():
    assert SparsityConfig(targets=("encoder",), ignore="pooler").targets == ["encoder"]
    assert SparsityConfig(ignore="pooler").ignore == ["pooler"]


@pytest.mark.parametrize("value, text", [(124, '"2:4"'), (230528, '"64:2:8"')])
def test_unquoted_yaml_pattern_says_to_quote_it(value, text):
    with pytest.raises(ValueError) as info:
        SparsityConfig(pattern=value)
    message = str(info.value)
    assert f"SparsityConfig.pattern={value}" in message and "quote" in message and text in message


def test_kernels_field_validates_and_round_trips():
    assert SparsityConfig().kernels == "auto"
    assert SparsityConfig(kernels="never").kernels == "never"
    with pytest.raises(ValueError, match="kernels='sometimes'.*'auto' or 'never'"):
        SparsityConfig(kernels="sometimes")
    cfg = SparsityConfig(pattern="64:2:8", kernels="never")
    assert SparsityConfig.from_dict(cfg.to_dict()) == cfg
