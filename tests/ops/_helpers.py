"""Shared test helpers: random V:2:M weights (never zeros) and the error rule for matmul kernels."""

from __future__ import annotations

import torch

from hf_sparse.masks import nm_mask, vnm_mask

PATTERNS = [(64, 4), (64, 8), (128, 8), (64, 16), (128, 16), (64, 32), (128, 64), (64, 128)]


def random_masked(rows: int, cols: int, v: int, m: int, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random dense weight and its V:2:M mask (magnitude), with some rows pruned harder to exercise padding."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen).to(device=device, dtype=dtype)
    mask = nm_mask(w.abs().float(), 2, 4) if m == 4 else vnm_mask(w.abs().float(), v, 2, m)
    if rows > 3:
        mask[3, : min(cols, 2 * m)] = False  # a row keeping nothing in its first groups -> padded slots
    return torch.where(mask, w, torch.zeros((), dtype=dtype, device=device)), mask


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
