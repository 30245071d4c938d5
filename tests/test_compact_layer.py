"""The compact layer (``SparseLinear.from_dense``): kept values only, the same outputs and gradients as the masked
dense layer it replaces, on CPU in fp32 and under autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

from hf_sparse.formats.compressed import compress
from hf_sparse.masks import compute_mask
from hf_sparse.nn import SparseLinear
from hf_sparse.patterns import parse_pattern

SPECS = [("2:4", 48, 64), ("64:2:8", 128, 96), ("2:8", 40, 64), ("unstructured:0.7", 24, 40)]


def _dense_and_mask(spec: str, rows: int, cols: int, conv1d: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if conv1d:
        module = Conv1D(rows, cols)
        torch.nn.init.normal_(module.weight, generator=gen)
        logical = module.weight.detach().t()
    else:
        module = torch.nn.Linear(cols, rows)
        logical = module.weight.detach()
    with torch.no_grad():
        module.bias.copy_(torch.randn(rows, generator=gen))
    mask = compute_mask(logical.abs(), parse_pattern(spec))
    return module, mask


def _masked_linear(module, mask) -> torch.nn.Linear:
    """The reference: an ``nn.Linear`` holding the masked dense weight (logical layout)."""
    weight = module.weight.detach()
    weight = weight.t() if isinstance(module, Conv1D) else weight
    ref = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.where(mask, weight, 0.0))
        ref.bias.copy_(module.bias)
    return ref


@pytest.mark.parametrize(("spec", "rows", "cols"), SPECS)
@pytest.mark.parametrize("conv1d", [False, True])
def test_from_dense_holds_the_on_disk_tensors_and_kept_index(spec, rows, cols, conv1d):
    module, mask = _dense_and_mask(spec, rows, cols, conv1d)
    layer = SparseLinear.from_dense(module, mask, spec)
    logical = module.weight.detach().t() if conv1d else module.weight.detach()
    expected = compress(logical, mask, parse_pattern(spec))
    assert layer.dense_class == ("Conv1D" if conv1d else "Linear")
    assert layer.bias is module.bias  # the same Parameter: its optimizer state stays valid
    assert set(layer.compressed_tensors()) == set(expected)
    for key, value in expected.items():
        assert torch.equal(getattr(layer, key), value), key
    assert layer.weight.numel() == int(mask.sum())
    # kept_index: the flat position of each value, in the values' order (compress of arange gives exactly this)
    positions = torch.arange(rows * cols, dtype=torch.float64).view(rows, cols)
    index = layer.kept_index
    assert index.dtype == torch.int64
    assert torch.equal(index, compress(positions, mask, parse_pattern(spec))["weight"].reshape(-1).long())
    assert torch.equal(logical.reshape(-1)[index], layer.weight.detach().reshape(-1))
    assert "kept_index" not in str(list(layer.state_dict()))


def test_from_dense_dtype_and_requires_grad():
    module, mask = _dense_and_mask("2:4", 16, 32)
    module.weight.requires_grad_(False)
    layer = SparseLinear.from_dense(module, mask, "2:4", dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and not layer.weight.requires_grad
    with pytest.raises(ValueError, match=r"mask shape \(32, 16\) .* \(16, 32\)"):
        SparseLinear.from_dense(module, mask.t(), "2:4")


@pytest.mark.parametrize(("spec", "rows", "cols"), SPECS)
@pytest.mark.parametrize("conv1d", [False, True])
def test_training_step_equals_masked_dense_fp32(spec, rows, cols, conv1d):
    """Output, input gradient, bias gradient and the kept values' gradient equal the masked ``nn.Linear``'s (its
    weight gradient gathered at ``kept_index``), bit for bit in fp32."""
    module, mask = _dense_and_mask(spec, rows, cols, conv1d, seed=1)
    ref = _masked_linear(module, mask)
    layer = SparseLinear.from_dense(module, mask, spec)
    x = torch.randn(3, 5, cols)
    g = torch.randn(3, 5, rows)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yr = layer(xs), ref(xr)
    ys.backward(g)
    yr.backward(g)
    assert torch.equal(ys, yr)
    assert torch.equal(xs.grad, xr.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)
    assert layer.weight.grad.shape == layer.weight.shape
    assert torch.equal(layer.weight.grad.reshape(-1), ref.weight.grad.reshape(-1)[layer.kept_index])


@pytest.mark.parametrize(("spec", "rows", "cols"), SPECS[:2])
def test_training_step_equals_masked_dense_under_cpu_autocast(spec, rows, cols):
    module, mask = _dense_and_mask(spec, rows, cols, seed=2)
    ref = _masked_linear(module, mask)
    layer = SparseLinear.from_dense(module, mask, spec)
    x = torch.randn(7, cols)
    g = torch.randn(7, rows, dtype=torch.bfloat16)
    outs = []
    for mod in (layer, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(x)
        y.backward(g)
        outs.append(y)
    assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad.reshape(-1), ref.weight.grad.reshape(-1)[layer.kept_index])
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_kept_index_is_rebuilt_after_to():
    module, mask = _dense_and_mask("64:2:8", 64, 64)
    layer = SparseLinear.from_dense(module, mask, "64:2:8")
    first = layer.kept_index
    layer.to(torch.float64)
    assert layer._index is None  # dropped with everything derived
    assert torch.equal(layer.kept_index, first)
    x = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.where(mask, module.weight.double(), 0), layer.bias))
