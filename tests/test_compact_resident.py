"""Inference keeps one copy of a compact layer's weights: the kernel's pack holds the values and the positions
(``CompactKernel.adopt``), and every reader of the on-disk form gets it back exactly (``SparseLinear.on_disk_form``).
Checked on CPU, where the kernel path runs on the ops' references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_config
from helpers import prune_now
from safetensors.torch import load_file
from test_compact_kernel import _layer
from transformers import AutoModelForSequenceClassification

import hf_sparse
from hf_sparse import SparseLinear

SPECS = [("2:4", 128, 256), ("64:2:8", 128, 256), ("128:2:8", 256, 128), ("64:2:16", 192, 512)]


def _bf16_layer(spec, rows, cols, seed=0):
    layer, dense, mask = _layer(spec, rows, cols, seed=seed)
    return layer.to(torch.bfloat16), dense, mask


def _storage_bytes(*tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of another's storage counts once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize(("spec", "rows", "cols"), SPECS)
def test_inference_keeps_one_copy_of_the_weights(spec, rows, cols):
    layer, dense, _ = _bf16_layer(spec, rows, cols)
    disk_bytes = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    k = layer.kernel_state(torch.bfloat16)
    x = torch.randn(5, cols).bfloat16()
    with torch.inference_mode():
        y = k(layer, x)
    assert layer._resident is k
    assert layer.weight.untyped_storage().data_ptr() == k.buf.untyped_storage().data_ptr()
    assert all(b.numel() == 0 for b in layer.buffers())  # the metadata and block columns hold the positions
    held = _storage_bytes(layer.weight, layer.bias, *layer.buffers(), k.buf, k.packed.meta, k.packed.columns)
    assert held <= 1.05 * disk_bytes, (held, disk_bytes)
    ref = F.linear(x.float(), dense.bfloat16().float(), layer.bias.detach().float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    with torch.no_grad():  # a resident layer computes exactly as before
        assert torch.equal(k(layer, x), y)


@pytest.mark.parametrize(("spec", "rows", "cols"), SPECS)
def test_the_on_disk_form_comes_back_bit_exact(spec, rows, cols):
    layer, dense, mask = _bf16_layer(spec, rows, cols, seed=3)
    before = {name: t.clone() for name, t in layer.state_dict().items()}
    k = layer.kernel_state(torch.bfloat16)
    with torch.inference_mode():
        k(layer, torch.randn(4, cols).bfloat16())
    assert layer._resident is k
    after = layer.state_dict()  # saving brings the on-disk form back
    assert layer._resident is None
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name
    assert torch.equal(layer.mask(), mask)
    with torch.inference_mode():  # the next inference call moves the values into the pack again
        k(layer, torch.randn(4, cols).bfloat16())
    assert layer._resident is k
    assert torch.equal(layer.to_dense_module().weight.float(), dense.bfloat16().float())
    assert layer._resident is None


@pytest.mark.parametrize(("spec", "rows", "cols"), SPECS[:2])
def test_training_after_inference_equals_training_alone(spec, rows, cols):
    layer, _, _ = _bf16_layer(spec, rows, cols, seed=5)
    twin = copy.deepcopy(layer)
    x = torch.randn(6, cols).bfloat16()
    k = layer.kernel_state(torch.bfloat16)
    with torch.inference_mode():
        k(layer, x)
    assert layer._resident is k
    outs = []
    for m in (layer, twin):
        xg = x.clone().requires_grad_()
        y = m.kernel_state(torch.bfloat16)(m, xg)
        y.float().square().sum().backward()
        outs.append((y.detach(), xg.grad, m.weight.grad, m.bias.grad))
    assert layer._resident is None
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    for name, t in twin.state_dict().items():
        assert torch.equal(layer.state_dict()[name], t), name


def test_to_after_inference_moves_the_on_disk_form():
    layer, dense, _ = _bf16_layer("2:4", 128, 256, seed=7)
    k = layer.kernel_state(torch.bfloat16)
    with torch.inference_mode():
        k(layer, torch.randn(3, 256).bfloat16())
    layer.to(torch.float32)
    assert layer._resident is None and layer.weight.dtype == torch.float32
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), F.linear(x, dense.bfloat16().float(), layer.bias))


@pytest.mark.parametrize(
    ("spec", "rows", "cols", "dtype"),
    [("2:4", 40, 72, torch.bfloat16), ("2:4", 128, 256, torch.float32)],
    ids=["padded-layout", "fp32-values-under-bf16"],
)
def test_no_residency_where_the_pack_is_not_a_permutation_of_the_values(spec, rows, cols, dtype):
    layer, _, _ = _layer(spec, rows, cols)
    layer = layer.to(dtype)
    positions = [b.clone() for b in layer.buffers()]
    k = layer.kernel_state(torch.bfloat16)
    with torch.inference_mode():
        k(layer, torch.randn(2, cols).to(dtype))
    assert layer._resident is None
    assert layer.weight.untyped_storage().data_ptr() != k.buf.untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(layer.buffers(), positions, strict=True))


def test_a_loaded_model_runs_resident_and_saves_the_same_bytes(tmp_path, monkeypatch):
    """A bf16 checkpoint loaded with ``from_pretrained``, run for inference on the kernel path (forced onto the
    ops' CPU references here), holds each pruned layer once, and saves byte-identical tensors afterwards."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert")).to(torch.bfloat16)
    pruner = prune_now(model, "2:4")
    hf_sparse.save_pretrained(model, tmp_path / "sparse", pruner)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "sparse").eval()
    ids = random_ids()
    with torch.inference_mode():
        expected = loaded(input_ids=ids).logits
    monkeypatch.setattr(SparseLinear, "_kernel_dtype", lambda self, x: torch.bfloat16)
    with torch.inference_mode():
        got = loaded(input_ids=ids).logits
    layers = [m for m in loaded.modules() if isinstance(m, SparseLinear)]
    assert layers and all(m._resident is m._kernel for m in layers)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.05)
    loaded.save_pretrained(tmp_path / "again")
    first = load_file(tmp_path / "sparse" / "model.safetensors")
    second = load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_plain_no_grad_keeps_the_on_disk_form():
    """Code under ``no_grad`` may write the values between calls (in the on-disk order): no residency there."""
    layer, dense, _ = _bf16_layer("2:4", 128, 256, seed=9)
    k = layer.kernel_state(torch.bfloat16)
    x = torch.randn(4, 256).bfloat16()
    with torch.no_grad():
        k(layer, x)
        assert layer._resident is None
        new = torch.randn_like(layer.weight)
        layer.weight.copy_(new)
        y = k(layer, x)
    weight = torch.zeros(128 * 256, dtype=torch.bfloat16).index_put_((layer.kept_index,), new.view(-1))
    ref = F.linear(x.float(), weight.view(128, 256).float(), layer.bias.detach().float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_a_write_into_a_resident_weight_raises_instead_of_computing_with_scrambled_values():
    layer, _, _ = _bf16_layer("2:4", 128, 256, seed=11)
    k = layer.kernel_state(torch.bfloat16)
    x = torch.randn(4, 256).bfloat16()
    with torch.inference_mode():
        k(layer, x)
    assert layer._resident is k
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="written in place while torch.inference_mode"):
        with torch.inference_mode():
            k(layer, x)
    with pytest.raises(RuntimeError, match="reload the model"):
        layer.state_dict()
