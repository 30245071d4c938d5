"""from_pretrained round trips of compressed checkpoints for every supported model family and head."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import random_ids, tiny_config
from helpers import logits, prune_now
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

import hf_sparse
from hf_sparse import CompressedFormatError, SparseLinear

CASES = [
    ("bert", AutoModelForSequenceClassification, "2:4"),
    ("bert", AutoModelForQuestionAnswering, "64:2:8"),
    ("roberta", AutoModelForSequenceClassification, "64:2:8"),
    ("distilbert", AutoModelForQuestionAnswering, "2:8"),
    ("distilbert", AutoModelForSequenceClassification, "unstructured:0.8"),
    ("gpt2", AutoModelForCausalLM, "64:2:8"),
    ("gpt2", AutoModelForSequenceClassification, "2:4"),
    ("llama", AutoModelForCausalLM, "2:4"),
    ("llama", AutoModelForSequenceClassification, "64:2:16"),
]


def _saved(tmp_path, family, auto_class, pattern, **kwargs):
    torch.manual_seed(0)
    config = tiny_config(family)
    if auto_class is AutoModelForQuestionAnswering:
        config.num_labels = 2  # start and end logits
    model = auto_class.from_config(config)
    pruner = prune_now(model, pattern, **kwargs)
    hf_sparse.save_pretrained(model, tmp_path / "sparse", pruner)
    return model, pruner, tmp_path / "sparse"


@pytest.mark.parametrize(
    "family, auto_class, pattern", CASES, ids=[f"{c[0]}-{c[1].__name__[12:]}-{c[2]}" for c in CASES]
)
def test_round_trip_bit_exact(tmp_path, family, auto_class, pattern):
    model, pruner, folder = _saved(tmp_path, family, auto_class, pattern)
    ids = random_ids()
    expected = logits(model, ids)

    loaded = auto_class.from_pretrained(folder)
    sparse_layers = {n for n, m in loaded.named_modules() if isinstance(m, SparseLinear)}
    assert sparse_layers == {layer.name for layer in pruner.layers}
    assert torch.equal(logits(loaded, ids), expected)  # bit-exact in fp32 on the CPU

    # save again: the same tensors, byte for byte
    loaded.save_pretrained(tmp_path / "again")
    first, second = load_file(folder / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    # to_dense: a plain model that saves and loads without hf_sparse's format
    hf_sparse.to_dense(loaded)
    assert not any(isinstance(m, SparseLinear) for m in loaded.modules())
    assert torch.equal(logits(loaded, ids), expected)
    loaded.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    dense = auto_class.from_pretrained(tmp_path / "dense")
    assert torch.equal(logits(dense, ids), expected)


RESAVE = """
import sys
from transformers import AutoModelForSequenceClassification
import hf_sparse
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1])
for out in sys.argv[2:]:
    model.save_pretrained(out)
"""


@pytest.mark.slow
def test_saves_are_byte_identical_across_processes(tmp_path):
    """A load and re-save writes the same bytes, whatever the process (hash seeds, safetensors' map order)."""
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "64:2:8")
    outs = [tmp_path / f"child{i}" for i in range(3)]
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run(
        [sys.executable, "-c", RESAVE, str(folder), *map(str, outs)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    for i in range(2):
        loaded.save_pretrained(tmp_path / f"parent{i}")
        outs.append(tmp_path / f"parent{i}")
    for name in ("model.safetensors", "config.json"):
        first = (folder / name).read_bytes()
        assert all((out / name).read_bytes() == first for out in outs), name


def test_config_records_format(tmp_path):
    _, pruner, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "64:2:8")
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "hf_sparse" and quant["format_version"] == hf_sparse.FORMAT_VERSION
    assert quant["hf_sparse_version"] == hf_sparse.__version__ and quant["patterns"] == ["64:2:8"]
    assert set(quant["layers"]) == {layer.name for layer in pruner.layers}
    assert quant["layers"]["bert.encoder.layer.0.intermediate.dense"]["shape"] == [128, 64]


def test_transposable_flag_recorded(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "2:4", transposable=True)
    layers = json.loads((folder / "config.json").read_text())["quantization_config"]["layers"]
    assert all(spec.get("transposable") for spec in layers.values())


def test_bf16_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert")).to(torch.bfloat16)
    pruner = prune_now(model, "2:4")
    hf_sparse.save_pretrained(model, tmp_path, pruner)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert loaded.bert.encoder.layer[0].intermediate.dense.weight.dtype == torch.bfloat16
    assert torch.equal(logits(loaded, random_ids()), logits(model, random_ids()))


def test_loaded_model_trains_and_keeps_its_pattern(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "64:2:8")
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    layer = loaded.bert.encoder.layer[0].intermediate.dense
    mask_before, values_before = layer.mask().clone(), layer.weight.detach().clone()
    optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1)
    loaded.train()
    for step in range(3):
        out = loaded(input_ids=random_ids(seed=step), labels=torch.tensor([0, 1, 2]))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(layer.weight.detach(), values_before)
    assert torch.equal(layer.mask(), mask_before)
    loaded.save_pretrained(tmp_path / "tuned")
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "tuned")
    assert torch.equal(logits(again, random_ids()), logits(loaded, random_ids()))


def test_loading_without_import_fails_loudly(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "2:4")
    code = (
        "import sys\n"
        "from transformers import AutoModelForSequenceClassification\n"
        f"AutoModelForSequenceClassification.from_pretrained({str(folder)!r})\n"
        "assert 'hf_sparse' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "mismatch" in result.stderr.lower()


def _corrupt(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_index_out_of_range_names_the_tensor(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "64:2:8")
    name = "bert.encoder.layer.1.output.dense.weight_columns"

    def edit(t):
        t[name] = t[name].clone()
        t[name][0, 0, 3] = 200

    _corrupt(folder, edit)
    with pytest.raises(CompressedFormatError, match=rf"{name}: index 200 out of range"):
        AutoModelForSequenceClassification.from_pretrained(folder)


def test_wrong_shape_names_the_tensor(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "2:4")
    name = "bert.encoder.layer.0.attention.self.key.weight_indices"
    _corrupt(folder, lambda t: t.update({name: t[name][:, :3].contiguous()}))
    with pytest.raises(CompressedFormatError, match=rf"{name}: shape \(64, 3\) in the checkpoint, expected \(64, 8\)"):
        AutoModelForSequenceClassification.from_pretrained(folder)


@pytest.mark.parametrize("key", ["weight", "weight_indices"])
def test_missing_tensor_names_it_and_the_file(tmp_path, key):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "2:4")
    name = f"bert.encoder.layer.0.attention.self.key.{key}"
    _corrupt(folder, lambda t: t.pop(name))
    with pytest.raises(CompressedFormatError, match=rf"{name}: missing from \S*model\.safetensors"):
        AutoModelForSequenceClassification.from_pretrained(folder)


def test_missing_tensor_in_a_torch_checkpoint_names_it_and_the_file(tmp_path):
    """A ``.bin`` checkpoint has no header to check before loading: the tensor Transformers did not fill is found
    after it, instead of running on uninitialised memory."""
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "64:2:8")
    name = "bert.encoder.layer.1.output.dense.weight_selectors"
    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(CompressedFormatError, match=rf"{name}: missing from \S*pytorch_model\.bin"):
        AutoModelForSequenceClassification.from_pretrained(folder)


@pytest.mark.parametrize(
    ("family", "bias"),
    [("bert", "bert.encoder.layer.0.output.dense.bias"), ("gpt2", "transformer.h.1.attn.c_proj.bias")],
)
def test_missing_bias_is_initialised_as_in_a_dense_checkpoint(tmp_path, family, bias):
    model, _, folder = _saved(tmp_path, family, AutoModelForSequenceClassification, "2:4")
    model.save_pretrained(tmp_path / "dense")  # the same pruned weights, dense
    for checkpoint in (folder, tmp_path / "dense"):
        _corrupt(checkpoint, lambda t: t.pop(bias))
    sparse = AutoModelForSequenceClassification.from_pretrained(folder)
    dense = AutoModelForSequenceClassification.from_pretrained(tmp_path / "dense")
    assert torch.equal(sparse.get_parameter(bias), dense.get_parameter(bias))
    ids = random_ids()
    expected = logits(dense, ids)
    assert torch.isfinite(expected).all() and torch.equal(logits(sparse, ids), expected)


def test_unknown_format_version(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "2:4")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format_version"] = 99
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format_version=99"):
        AutoModelForSequenceClassification.from_pretrained(folder)


def test_layer_name_not_in_model(tmp_path):
    _, _, folder = _saved(tmp_path, "bert", AutoModelForSequenceClassification, "2:4")
    config = json.loads((folder / "config.json").read_text())
    layers = config["quantization_config"]["layers"]
    layers["bert.encoder.layer.7.output.dense"] = layers["bert.encoder.layer.0.output.dense"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CompressedFormatError, match="layer.7.output.dense"):
        AutoModelForSequenceClassification.from_pretrained(folder)


def test_failed_save_writes_nothing(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    pruner = prune_now(model, "2:4")
    with torch.no_grad():
        model.bert.encoder.layer[1].output.dense.weight.add_(1.0)  # masks no longer applied
    with pytest.raises(ValueError, match="layer.1.output.dense: .* non-zero at pruned positions"):
        hf_sparse.save_pretrained(model, tmp_path / "out", pruner)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("family", "pattern"), [("bert", "2:4"), ("roberta", "64:2:8"), ("bert", "2:8")])
def test_intermediate_gelu_folds_into_the_sparse_layer_and_back(tmp_path, family, pattern):
    """BERT-family intermediate layers run GELU in the 2:4 kernel's epilogue: loading folds the exact GELU into the
    SparseLinear (the same function: bit-exact logits on the CPU), ``to_dense`` puts the activation module back."""
    from transformers.activations import GELUActivation

    model, pruner, folder = _saved(tmp_path, family, AutoModelForSequenceClassification, pattern)
    ids = random_ids()
    expected = logits(model, ids)
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    intermediates = [m for n, m in loaded.named_modules() if n.endswith(".intermediate")]
    assert intermediates
    kernel_ready = pattern != "2:8"  # 2:8 has no Sparse Tensor Core kernel: nothing to fold into
    for module in intermediates:
        assert module.dense.activation == ("gelu" if kernel_ready else None)
        assert isinstance(module.intermediate_act_fn, torch.nn.Identity if kernel_ready else GELUActivation)
    others = [m for m in loaded.modules() if isinstance(m, SparseLinear) and m not in [i.dense for i in intermediates]]
    assert others and all(m.activation is None for m in others)
    assert torch.equal(logits(loaded, ids), expected)
    hf_sparse.to_dense(loaded)
    assert all(type(m.intermediate_act_fn) is GELUActivation for m in intermediates)
    assert torch.equal(logits(loaded, ids), expected)
