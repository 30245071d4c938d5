"""Where a chain of V:2:M SpMMs on the X^T path spends its GPU time, and how close it comes to the bound of its design
(issue 17 item 3: 8192 tokens).

For each shape and pattern: a chain of calls on distinct weight copies, as a model's forward issues them
(``gpu_timing.chain_us``), for the V:2:M call, the 2:4 kernel on a 2:4 weight of the same shape, cuBLAS, and a
device-to-device copy of X; then a profiler trace of the V:2:M and 2:4 chains (each kernel's duration, the gaps).

The bound. Both GEMMs are bound by what crosses L2 -> SM (benchmarks/RESULTS.md, "the ceilings that bound the
sparse-wgmma SpMMs": the 2:4 main loop runs at its feed skeleton's rate): per 128-row x BN-token tile and k-tile of 64
(condensed) columns, the B tile (BN x 64 of X, or of X^T's kept rows; twice where V = 64, one per 64-row slab), 8 KB
of A fragments and 1 KB of metadata; plus Y's writes (ncu counts these bytes within 1%). Two feed rates bound the X^T
GEMM: the 2:4 kernel's bytes per µs in the same run (its X tiles are read by every row block of a token tile), and
``--copy-rate-tbs``, the rate at which bulk or cp.async copies stream from the L2 alone (``roofline_sm90.cu
streams``). The call's bound adds a copy of X (the transpose reads and writes X once, as a copy does). The tile
widths come from the kernels' names in the trace.

    python benchmarks/profile_xt_chain.py [--shapes 1024x4096 ...] [--patterns 128:2:8 ...]   (cc 9.0, sm_90a build)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile

import torch
from bench_kernels import cold_packs, magnitude_pack, pack_bytes, parse, parse_shape
from gpu_timing import chain_us, cold_copies

from hf_sparse.ops import force_kernel, spmm

SHAPES = ["768x3072", "1024x4096", "4096x1024", "4096x11008", "11008x4096"]
PATTERNS = ["128:2:8", "128:2:16"]
A_AND_META_BYTES = 128 * 32 * 2 + 1024  # per 128-row tile and k-tile: 2:4 values of 64 columns, their metadata


def kernel_kind(name: str) -> str:
    if "transpose" in name:
        return "transpose"
    return "gemm" if "kernel<" in name and "spmm" in name else name[:40]


def tile_tokens(name: str, xt: bool) -> int:
    """The token width of a tile, from the kernel's template arguments (<T, M, BN> on the X^T path, <T, BN, ...> for
    the 2:4 TMA kernels)."""
    args = re.search(r"kernel<([^>]*)>", name)
    if args is None:
        raise RuntimeError(f"no template arguments in kernel name {name!r}")
    ints = [int(a) for a in re.findall(r"(?<![\w.])(\d+)(?![\w.])", args.group(1))]
    return ints[1] if xt else ints[0]


def xt_tiles(rows: int, tokens: int, bn: int) -> int:
    """Output tiles of a call: 128-row blocks x bn-token tiles."""
    return -(-rows // 128) * -(-tokens // bn)


def feed_bytes(rows: int, tokens: int, k_tiles: int, bn: int, b_copies: int) -> int:
    """L2 <-> SM bytes of a call: per tile and k-tile the B tile (b_copies times), A and metadata; then Y."""
    tiles = xt_tiles(rows, tokens, bn)
    return tiles * k_tiles * (b_copies * bn * 64 * 2 + A_AND_META_BYTES) + rows * tokens * 2


def traced(fns: list) -> tuple[dict[str, list[float]], list[str], float, float]:
    """Kernel durations by kind, the GEMM kernels' names, and the span and gaps per call of one pass over ``fns``."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for f in fns:
            f()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted(
                (e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"]
            )
    kinds: dict[str, list[float]] = {}
    names = []
    for e in events:
        kind = kernel_kind(e["name"])
        kinds.setdefault(kind, []).append(e["dur"])
        if kind == "gemm":
            names.append(e["name"])
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    gaps = sum(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(events, events[1:], strict=False))
    return kinds, names, span / len(fns), gaps / len(fns)


def mean(d: list[float]) -> float:
    return sum(d) / len(d)


def profile_shape(k: int, r: int, pattern: str, tokens: int, copy_rate_tbs: float) -> str:
    v, m = parse(pattern)
    w = torch.randn(r, k, device="cuda")
    _, packs = cold_packs(w, pattern)
    packs24 = [magnitude_pack(w, "2:4")[2] for _ in range(cold_copies(pack_bytes(packs[0]) * m // 4))]
    dense = [torch.randn(r, k, device="cuda").bfloat16() for _ in range(cold_copies(r * k * 2))]
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    copies = [torch.empty_like(x) for _ in range(2)]
    with force_kernel(spmm="wgmma"):
        ours_fns = [lambda q=q: spmm(x, q) for q in packs]
        ref_fns = [lambda q=q: spmm(x, q) for q in packs24]
        ours = chain_us(ours_fns)
        ref = chain_us(ref_fns)
        cublas = chain_us([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        copy = chain_us([lambda c=c: c.copy_(x) for c in copies])
        kinds, names, span, gaps = traced(ours_fns)
        kinds24, names24, _, _ = traced(ref_fns)
    if "gemm" not in kinds:
        return f"{k}->{r} {pattern}: no X^T-path GEMM in the trace ({sorted(kinds)})"
    bn, bn24 = tile_tokens(names[0], xt=True), tile_tokens(names24[0], xt=False)
    gemm, gemm24 = mean(kinds["gemm"]), mean(kinds24["gemm"])
    rate = feed_bytes(r, tokens, k // 64, bn24, 1) / gemm24  # bytes per µs the 2:4 main loop moved
    xt_bytes = feed_bytes(r, tokens, -(-(4 * k // m) // 64), bn, 1 if v == 128 else 2)
    gemm_bound = xt_bytes / rate
    bound = gemm_bound + copy
    copy_rate_bound = xt_bytes / (copy_rate_tbs * 1e6) + copy
    parts = ", ".join(f"{n} {mean(d):.1f} x {len(d)}" for n, d in kinds.items())
    return (
        f"{k}->{r} {pattern} {tokens} tok (BN {bn}; 2:4 BN {bn24}): chain {ours:.1f} us/call = {cublas / ours:.2f}x"
        f" cuBLAS ({cublas:.1f}), 2:4 {ref:.1f} ({cublas / ref:.2f}x), copy of X {copy:.1f}; trace per call: span"
        f" {span:.1f}, {parts}, gaps {gaps:.1f}; 2:4 GEMM {gemm24:.1f} us = {rate / 1e6:.2f} TB/s of feed;"
        f" bound: GEMM {gemm_bound:.1f} ({100 * gemm_bound / gemm:.0f}% reached) + copy {copy:.1f} = {bound:.1f} us"
        f" = {cublas / bound:.2f}x cuBLAS; the chain reaches {100 * bound / ours:.0f}% of it; at {copy_rate_tbs} TB/s:"
        f" {copy_rate_bound:.1f} us = {cublas / copy_rate_bound:.2f}x cuBLAS, the chain reaches"
        f" {100 * copy_rate_bound / ours:.0f}%"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in SHAPES])
    ap.add_argument("--patterns", nargs="+", default=PATTERNS)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument(
        "--copy-rate-tbs",
        type=float,
        default=9.0,
        help="L2 -> shared-memory rate of copies streaming alone, TB/s (roofline_sm90.cu streams: 8.9-9.0 on an H200)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_xt_chain.py needs a CUDA GPU")
    torch.manual_seed(0)
    for k, r in args.shapes:
        for pattern in args.patterns:
            print(profile_shape(k, r, pattern, args.tokens, args.copy_rate_tbs), flush=True)


if __name__ == "__main__":
    main()
