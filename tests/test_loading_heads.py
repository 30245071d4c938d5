"""A compressed checkpoint loads into another head or into the base model, as a dense one does: the base-model prefix
(``bert``, ``roberta``, ``distilbert``, ``transformer``, ``model``) is stripped or added for the compressed layers."""

import json

import pytest
import torch
from conftest import random_ids, tiny_config
from helpers import logits, prune_now
from transformers import AutoModel, AutoModelForSequenceClassification

import hf_sparse
from hf_sparse import SparseLinear

PATTERNS = {"bert": "2:4", "roberta": "64:2:8", "distilbert": "2:8", "gpt2": "64:2:8", "llama": "2:4"}


def _hidden(base_model, ids):
    base_model.eval()
    with torch.no_grad():
        return base_model(input_ids=ids).last_hidden_state


def _sparse_layers(model):
    return {name for name, module in model.named_modules() if isinstance(module, SparseLinear)}


def _saved_layers(folder):
    return set(json.loads((folder / "config.json").read_text())["quantization_config"]["layers"])


def _save_both(model, pruner, tmp_path):
    """The pruned model saved compressed and, with the same weights, dense."""
    hf_sparse.save_pretrained(model, tmp_path / "sparse", pruner)
    model.save_pretrained(tmp_path / "dense")
    return tmp_path / "sparse", tmp_path / "dense"


@pytest.mark.parametrize("family", list(PATTERNS))
def test_task_checkpoint_loads_into_its_base_model(tmp_path, family):
    """Take the encoder of a fine-tuned sparse classifier."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(family))
    pruner = prune_now(model, PATTERNS[family])
    sparse_dir, dense_dir = _save_both(model, pruner, tmp_path)
    prefix = f"{model.base_model_prefix}."
    layers = {layer.name.removeprefix(prefix) for layer in pruner.layers}
    assert all(layer.name.startswith(prefix) for layer in pruner.layers)
    ids = random_ids()

    base = AutoModel.from_pretrained(sparse_dir)
    assert _sparse_layers(base) == layers
    hidden = _hidden(base, ids)
    assert torch.equal(hidden, _hidden(model.base_model, ids))
    assert torch.equal(hidden, _hidden(AutoModel.from_pretrained(dense_dir), ids))

    base.save_pretrained(tmp_path / "base")  # quantization_config names the base model's layers
    assert _saved_layers(tmp_path / "base") == layers
    assert torch.equal(_hidden(AutoModel.from_pretrained(tmp_path / "base"), ids), hidden)


@pytest.mark.parametrize("family", list(PATTERNS))
def test_base_checkpoint_loads_into_a_task_model(tmp_path, family):
    """Prune the encoder once, fine-tune many heads: the head is new and initialised as for a dense checkpoint."""
    torch.manual_seed(0)
    base = AutoModel.from_config(tiny_config(family))
    pruner = prune_now(base, PATTERNS[family])
    sparse_dir, dense_dir = _save_both(base, pruner, tmp_path)
    ids = random_ids()

    torch.manual_seed(1)
    task, info = AutoModelForSequenceClassification.from_pretrained(sparse_dir, output_loading_info=True)
    torch.manual_seed(1)
    dense = AutoModelForSequenceClassification.from_pretrained(dense_dir)
    prefix = f"{task.base_model_prefix}."
    layers = {prefix + layer.name for layer in pruner.layers}
    assert _sparse_layers(task) == layers
    assert torch.equal(_hidden(task.base_model, ids), _hidden(base, ids))
    head = {key for key in task.state_dict() if not key.startswith(prefix)}
    assert head and head <= set(info["missing_keys"])
    assert all(torch.equal(task.get_parameter(key), dense.get_parameter(key)) for key in head)
    expected = logits(dense, ids)
    assert torch.isfinite(expected).all() and torch.equal(logits(task, ids), expected)

    task.save_pretrained(tmp_path / "task")  # quantization_config names the task model's layers
    assert _saved_layers(tmp_path / "task") == layers
    assert torch.equal(logits(AutoModelForSequenceClassification.from_pretrained(tmp_path / "task"), ids), expected)


def test_pruned_head_layer_is_left_out_of_the_base_model(tmp_path):
    """A compressed layer of a head the model lacks is unexpected, as its dense tensors are."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("roberta"))
    pruner = prune_now(model, "2:4", targets=[r"layer\.\d+\.", r"^classifier\.dense$"])
    assert "classifier.dense" in {layer.name for layer in pruner.layers}
    hf_sparse.save_pretrained(model, tmp_path / "sparse", pruner)

    base, info = AutoModel.from_pretrained(tmp_path / "sparse", output_loading_info=True)
    assert {"classifier.dense.weight", "classifier.dense.weight_indices"} <= set(info["unexpected_keys"])
    assert torch.equal(_hidden(base, random_ids()), _hidden(model.base_model, random_ids()))
    base.save_pretrained(tmp_path / "base")
    layers = {layer.name.removeprefix("roberta.") for layer in pruner.layers if layer.name != "classifier.dense"}
    assert _saved_layers(tmp_path / "base") == layers
