"""Shared test helpers: random V:2:M weights (never zeros), a poisoned allocator and the error rule for matmul
kernels."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

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


def mask_with_distinct_slab_columns(rows: int, cols: int, v: int, m: int, seed: int) -> torch.Tensor:
    """A V:2:M mask (CPU, bool) whose 4 kept columns differ between consecutive 64-row slabs in every group where
    V = 64 (slab s keeps a random 4-subset, slab s+1 a different one), each row keeping a random 2 of its block's 4.
    Drawn a block at a time with tensor ops: the GPU tests take it on weights of up to 10^8 elements. M >= 8: at M = 4
    every slab keeps all 4 columns."""
    if m < 8:
        raise ValueError(f"slabs keep distinct 4-subsets of M columns only for M >= 8, got M = {m}")
    gen = torch.Generator().manual_seed(seed)
    groups = cols // m
    mask = torch.zeros(rows, groups, m, dtype=torch.bool)
    prev = None
    for blk in range(rows // v):
        chosen = torch.rand(groups, m, generator=gen).argsort(-1)[:, :4].sort(-1).values  # a random 4-subset a group
        if prev is not None and v == 64:
            same = (chosen == prev).all(-1)
            chosen[same] = (chosen[same] + 1) % m  # a shifted 4-subset of Z_m is never the same subset
            chosen = chosen.sort(-1).values
        prev = chosen
        pick = torch.rand(v, groups, 4, generator=gen).argsort(-1)[..., :2]  # 2 of the 4 for each row and group
        idx = torch.gather(chosen.expand(v, groups, 4), 2, pick)
        mask[blk * v : (blk + 1) * v].scatter_(2, idx, True)
    return mask.reshape(rows, cols)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def poison_allocator() -> None:
    """Fill freed caching-allocator blocks with NaN so an output element a kernel forgets stays NaN."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float32)
    del junk


def assert_linear_matches(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """``y`` is ``F.linear(x, w, b)`` in x's dtype: every element written (no NaN), error against the fp64 product
    within 2x of PyTorch's own ``F.linear`` error in that dtype."""
    torch.cuda.synchronize()
    wq = w.to(x.dtype)
    assert y.shape == (*x.shape[:-1], w.shape[0]) and y.dtype == x.dtype
    assert not bool(torch.isnan(y).any()), "unwritten or NaN output"
    ref = F.linear(x.double(), wq.double(), None if b is None else b.double())
    assert rel_err(y, ref) <= 2 * rel_err(F.linear(x, wq, b), ref) + 1e-6


@contextlib.contextmanager
def lab_knobs(**knobs: int) -> Iterator[None]:
    """Set the lab build's tuning knobs (``benchmarks/lab/tuning.py``) inside the block; skips the test unless this
    process builds the lab extension (``HF_SPARSE_BUILD_LAB=1``). With no knobs, the product's choices run (no skip)."""
    if not knobs:
        yield
        return
    from hf_sparse.ops._build import lab_build

    if not lab_build():
        pytest.skip("a lab tuning knob: needs the lab build (HF_SPARSE_BUILD_LAB=1)")
    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from lab.tuning import tuning

    with tuning(**knobs):
        yield


def fake_compiler(monkeypatch, build_dir: Path, compile_fn) -> None:
    """``_build.load_extension`` without a toolchain: ``compile_fn`` stands in for ``cpp_extension.load`` (it gets its
    keyword arguments), the build cache is ``build_dir`` and no earlier failure is remembered."""
    from torch.utils import cpp_extension

    from hf_sparse.ops import _build

    monkeypatch.setattr(_build, "_check_toolchain", lambda: None)
    monkeypatch.setattr(_build, "arch_flags", lambda archs=None: [])
    monkeypatch.setenv("HF_SPARSE_BUILD_DIR", str(build_dir))
    monkeypatch.setattr(cpp_extension, "load", compile_fn)
    monkeypatch.setattr(_build, "_build_failures", {})
