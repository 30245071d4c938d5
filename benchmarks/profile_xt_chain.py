"""Where a chain of V:2:M SpMMs on the X^T path spends its GPU time at 8192 tokens: each kernel's duration and the gaps
between kernels (a profiler trace of calls on distinct weight copies, as a model's forward issues them), beside the
chain's time per call and cuBLAS's (``gpu_timing.chain_us``).

    python benchmarks/profile_xt_chain.py      (a cc 9.0 GPU and an sm_90a build)
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from gpu_timing import chain_us, cold_copies

from hf_sparse.masks import vnm_mask
from hf_sparse.ops import force_kernel, pack, spmm

SHAPES = [(4096, 11008), (11008, 4096), (4096, 1024)]  # (in, out) features
TOKENS, V, M = 8192, 128, 8


def kernel_kind(name: str) -> str:
    if "transpose" in name:
        return "transpose"
    return "gemm" if "xt_kernel" in name else name[:40]


def profile_shape(k: int, r: int) -> str:
    w = torch.randn(r, k, device="cuda")
    mask = vnm_mask(w.abs(), V, 2, M)
    p = pack(w * mask, mask, V, M, torch.bfloat16)
    packs = [p] + [
        pack(w * mask, mask, V, M, torch.bfloat16)
        for _ in range(cold_copies(sum(t.numel() * t.element_size() for t in (p.values, p.meta, p.columns))) - 1)
    ]
    dense = [torch.randn(r, k, device="cuda").bfloat16() for _ in range(cold_copies(r * k * 2))]
    x = torch.randn(TOKENS, k, device="cuda").bfloat16()
    with force_kernel(spmm="wgmma"):
        ours = chain_us([lambda q=q: spmm(x, q) for q in packs])
        cublas = chain_us([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        for q in packs:
            spmm(x, q)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for q in packs:
                spmm(x, q)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted(
                (e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"]
            )
    calls = len(packs)
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    kinds: dict[str, list[float]] = {}
    for e in events:
        kinds.setdefault(kernel_kind(e["name"]), []).append(e["dur"])
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(events, events[1:], strict=False)]
    parts = ", ".join(f"{n} {sum(d) / len(d):.1f} us x {len(d)}" for n, d in kinds.items())
    return (
        f"{k}->{r} {V}:2:{M} {TOKENS} tok: chain {ours:.1f} us/call, cuBLAS chain {cublas:.1f} ({cublas / ours:.2f}x);"
        f" profiled {calls} calls: span {span / calls:.1f} us/call, {parts}, gaps {sum(gaps) / calls:.1f} us/call"
        f" (max {max(gaps):.1f})"
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_xt_chain.py needs a CUDA GPU")
    torch.manual_seed(0)
    for k, r in SHAPES:
        print(profile_shape(k, r), flush=True)


if __name__ == "__main__":
    main()
