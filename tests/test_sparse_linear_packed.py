"""SparseLinear (the module loaded checkpoints are made of) builds the kernels' layout from its compressed tensors
(its kernel state): checked on CPU against the decompressed weight, for every pattern the kernels run."""

from __future__ import annotations

import pytest
import torch

from hf_sparse.formats.compressed import compress, decompress
from hf_sparse.masks import compute_mask
from hf_sparse.nn import SparseLinear
from hf_sparse.ops import dense_from_packed
from hf_sparse.patterns import parse_pattern


def _loaded(spec: str, rows: int, cols: int, seed: int = 0) -> tuple[SparseLinear, torch.Tensor]:
    pattern = parse_pattern(spec)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    mask = compute_mask(w.abs(), pattern)
    tensors = compress(torch.where(mask, w, 0.0), mask, pattern)
    nnz = int(mask.sum()) if spec.startswith("unstructured") else None
    module = SparseLinear(cols, rows, pattern, bias=True, nnz=nnz)
    with torch.no_grad():
        for key, value in tensors.items():
            getattr(module, key).copy_(value)
        module.bias.copy_(torch.randn(rows, generator=gen))
    return module, decompress(tensors, pattern, (rows, cols))


@pytest.mark.parametrize(("spec", "rows", "cols"), [("2:4", 40, 72), ("64:2:8", 128, 200), ("128:2:16", 128, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_weight_encodes_the_loaded_weight(spec, rows, cols, dtype):
    module, dense = _loaded(spec, rows, cols)
    state = module.kernel_state(dtype)
    packed = state.packed
    assert packed.dtype == dtype and (packed.rows, packed.cols) == (rows, cols)
    assert torch.equal(dense_from_packed(packed, torch.float32), dense.to(dtype).float())
    assert module.kernel_state(dtype) is state  # built once
    with torch.no_grad():
        module.weight.mul_(2.0)
        state(module, torch.randn(1, cols).to(dtype))  # the first call after the change refreshes the pack in place
    assert state.packed.values is packed.values
    assert torch.equal(dense_from_packed(state.packed, torch.float32), (2 * dense).to(dtype).float())


@pytest.mark.parametrize(("spec", "cols"), [("2:8", 64), ("unstructured:0.5", 64), ("2:4", 36)])
def test_no_kernel_layout_for_other_patterns_or_shapes(spec, cols):
    module, dense = _loaded(spec, 64, cols)
    with pytest.raises(ValueError, match="no Sparse Tensor Core kernel"):
        module.kernel_state(torch.bfloat16)
    x = torch.randn(3, cols)
    torch.testing.assert_close(module(x), torch.nn.functional.linear(x, dense, module.bias))
