"""The extension's timeline build (``-DHF_SPARSE_TIMELINE`` in ``HF_SPARSE_NVCC_FLAGS``: a build of its own, cached
beside the product's), for the scripts that read its per-CTA stamps (``timeline_spmm.py``) or cycle counters
(``timeline_xt.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType


def timeline_extension(reader: str, script: str) -> ModuleType:
    """The timeline build, loaded (the flag is added to ``HF_SPARSE_NVCC_FLAGS`` first, so call this before anything
    loads the extension), with its ``reader`` binding; exits saying why where there is no GPU or no such binding."""
    flags = os.environ.get("HF_SPARSE_NVCC_FLAGS", "").split()
    if "-DHF_SPARSE_TIMELINE" not in flags:
        os.environ["HF_SPARSE_NVCC_FLAGS"] = " ".join([*flags, "-DHF_SPARSE_TIMELINE"])
    import torch

    from hf_sparse.ops._build import load_extension

    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    ext = load_extension()
    if not hasattr(ext, reader):
        raise SystemExit("the loaded extension has no timeline: HF_SPARSE_NVCC_FLAGS must hold -DHF_SPARSE_TIMELINE")
    return ext


def chain_and_rows(calls: list[Callable[[], object]], read: Callable[[], object]) -> tuple[float, list[list[int]]]:
    """The chain's GPU µs per call over ``calls`` (``gpu_timing.chain_us``), then the rows ``read`` returns after one
    more pass of the chain (``read`` is called before it too, which clears what earlier calls left)."""
    import torch
    from gpu_timing import chain_us

    per_call = chain_us(calls)
    read()
    chain_us(calls, reps=1)
    torch.cuda.synchronize()
    return per_call, read().tolist()
