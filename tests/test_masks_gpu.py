"""GPU: the mask-selection kernels (csrc/mask_select.cu) against the torch rules of hf_sparse.masks, exactly, on
fresh random scores, on scores full of ties (the lower index must win, as in the torch forms) and in bf16."""

from __future__ import annotations

import pytest
import torch
from ops._helpers import poison_allocator

from hf_sparse import masks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", autouse=True)
def kernels_loaded():
    from hf_sparse.ops._build import load_extension

    load_extension()  # the mask functions use the kernels only once the extension is loaded


def _scores(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "ties":  # few distinct values: ties everywhere, and float64 sums of them are exact
        return torch.randint(0, 3, (rows, cols), device="cuda", generator=gen).float()
    score = torch.rand(rows, cols, device="cuda", generator=gen) + 1e-3
    return score.bfloat16() if kind == "bf16" else score


def _check(kernel_mask: torch.Tensor, reference: torch.Tensor) -> None:
    torch.cuda.synchronize()
    assert kernel_mask.dtype == torch.bool and kernel_mask.shape == reference.shape
    assert torch.equal(kernel_mask.view(torch.uint8), reference.view(torch.uint8))  # every byte written, 0 or 1


@pytest.mark.parametrize("kind", ["random", "ties", "bf16"])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (2, 8), (3, 8), (2, 16), (4, 32)])
@pytest.mark.parametrize(("rows", "groups"), [(1, 1), (7, 5), (192, 33)])
def test_nm_kernel_matches_torch(n, m, rows, groups, kind):
    score = _scores(rows, groups * m, kind, seed=n * 100 + m + rows)
    poison_allocator()
    _check(masks.nm_mask(score, n, m), masks._nm_mask_torch(score, n, m))


@pytest.mark.parametrize("kind", ["random", "ties", "bf16"])
@pytest.mark.parametrize(
    ("v", "n", "m"), [(64, 2, 8), (128, 2, 16), (64, 2, 32), (64, 2, 128), (64, 1, 8), (64, 4, 8)]
)
@pytest.mark.parametrize("blocks", [1, 3])
def test_vnm_kernel_matches_torch(v, n, m, blocks, kind):
    score = _scores(v * blocks, m * 5, kind, seed=v + n * 10 + m + blocks)
    poison_allocator()
    _check(masks.vnm_mask(score, v, n, m), masks._vnm_mask_torch(score, v, n, m, 4))


@pytest.mark.parametrize("kind", ["random", "ties", "bf16"])
@pytest.mark.parametrize(("rows", "cols"), [(4, 4), (12, 28), (256, 1024)])
def test_transposable_kernel_matches_torch(rows, cols, kind):
    score = _scores(rows, cols, kind, seed=rows + cols)
    poison_allocator()
    mask = masks.transposable_2to4_mask(score)
    _check(mask, masks._transposable_2to4_mask_torch(score))
    assert (mask.view(rows, cols // 4, 4).sum(-1) == 2).all() and (mask.view(rows // 4, 4, cols).sum(1) == 2).all()
