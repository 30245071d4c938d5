"""Split-K and tile sweep of the sparse-wgmma SpMMs at 64-256 tokens (lab build): the data behind the split rule.

    HF_SPARSE_BUILD_LAB=1 python benchmarks/sweep_split_k.py [--tokens 64 128 256] [--splits 1 2 4 8]
        [--patterns 2:4 64:2:8 64:2:16] [--shapes 4096x11008 ...] [--json out.jsonl [--resume]] [--configs 20 23 27]
        [--queued]
    python benchmarks/sweep_split_k.py --product-only ...   # dense and the product's choice only (any build)

For every (pattern, shape, token count) it times dense cuBLAS (``F.linear`` on the masked weight), the product's
choice of the pattern's sparse-``wgmma`` kernel, and that kernel with each split count of ``--splits`` forced
(``lab.tuning``'s ``split_k``). For 2:4 it also times the few-token tiles forced at every count up to 256 tokens
(``small_tiles=1``) and the persistent large configurations (``small_tiles=0``) with their own split rule
(``large``) and with each split count forced (``Ls<count>``); with ``--vnm-xt``, V:2:M with its X^T path forced on
(``xts<count>``), and with ``--vnm-rg`` off (``rgs<count>``). ``--product-only`` times dense and the product's choice alone, so that two
checkouts (``PYTHONPATH``) can be compared in one session with any build. ``--bound`` also times cuBLAS on a dense
weight of as many bytes as the pack (values, metadata, column offsets): the ratio a SpMM that moves its bytes as
cuBLAS does would reach (``bytes`` / ``bytes_chain``). Every configuration is checked against the dense product before
it is timed.
Times are ``triton.testing.do_bench`` medians (CUDA events, GPU time), in µs; ratios are cuBLAS time / ours.
"""
# ruff: noqa: B023  (every benchmarked lambda is called at once, inside its own loop iteration)

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from bench_kernels import (
    LLAMA_SHAPES,
    checked_error,
    json_lines,
    magnitude_pack,
    pack_bytes,
    parse_shape,
    view24_time,
)
from compare_sweeps import load
from gpu_timing import chain_us, cold_copies, flushed_us
from lab.tuning import require_lab_build, tuning

from hf_sparse.ops import force_kernel, spmm


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return 1000.0 * float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def same_bytes_weights(p, k: int, copies: int) -> list[torch.Tensor]:
    """``copies`` dense bf16 weights of ``k`` features and as many bytes as the pack ``p`` (rows rounded up to 8)."""
    rows = -(-pack_bytes(p) // (2 * k) // 8) * 8
    return [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]


def timed(x: torch.Tensor, p, ref: torch.Tensor, what: str, **knobs: int) -> float:
    """The pattern's sparse-wgmma kernel with the lab ``knobs`` set (none: any build), checked against ``ref``, in µs."""
    with force_kernel(spmm="wgmma"), tuning(**knobs):
        checked_error(spmm(x, p), ref, what)
        return bench_us(lambda: spmm(x, p))


def cold_times(x: torch.Tensor, pattern: str, wb: torch.Tensor, p, copies: list, halves: list) -> dict[str, float]:
    """Dense and the product after a clean L2 flush (``read``) and in a chain over ``copies`` (``chain``), and cuBLAS
    in a chain over ``halves``, in µs; every copy's product checked against its dense product first."""
    out = {"dense_read": flushed_us(lambda: F.linear(x, wb), flush="read")}
    with force_kernel(spmm="wgmma"):
        out["product_read"] = flushed_us(lambda: spmm(x, p), flush="read")
        for i, (wb_i, p_i) in enumerate(copies):
            checked_error(spmm(x, p_i), F.linear(x.float(), wb_i.float()), f"{pattern} chain copy {i}")
        out["product_chain"] = chain_us([lambda p_i=p_i: spmm(x, p_i) for _, p_i in copies])
    out["dense_chain"] = chain_us([lambda wb_i=wb_i: F.linear(x, wb_i) for wb_i, _ in copies])
    out["half_chain"] = chain_us([lambda h=h: F.linear(x, h) for h in halves])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 96, 128, 192, 256])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--patterns", nargs="+", default=["2:4", "64:2:8", "64:2:16"])
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in LLAMA_SHAPES])
    ap.add_argument("--json", default=None, help="append one JSON object per row to this file")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="with --json: skip the cells (pattern, shape, tokens) the file already holds, so that a sweep a call's "
        "limit cut short goes on where it stopped",
    )
    ap.add_argument("--product-only", action="store_true", help="time dense and the product's choice only")
    ap.add_argument(
        "--configs", type=int, nargs="*", default=[], help="2:4: also each of these tile configurations (sm90_config)"
    )
    ap.add_argument(
        "--vnm-xt",
        action="store_true",
        help="V:2:M: the kernel with its X^T path forced on (xt) instead of the product's choice, with every split "
        "count of --splits (0: the product's count); --vnm-rg adds the register gather forced (rg)",
    )
    ap.add_argument(
        "--vnm-rg", action="store_true", help="with --vnm-xt: also the register gather forced (vnm_xt=0, rg)"
    )
    ap.add_argument(
        "--queued",
        action="store_true",
        help="also dense and the product issued behind a busy GPU after do_bench's L2 flush (gpu_timing.flushed_us)",
    )
    ap.add_argument(
        "--bound",
        action="store_true",
        help="also cuBLAS on a dense weight of the pack's bytes (bytes; with --cold, in a chain: bytes_chain)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="also dense and the product after a clean L2 flush and in a chain over distinct weights (gpu_timing)",
    )
    args = ap.parse_args()
    if args.resume and args.json is None:
        ap.error("--resume needs --json: the file whose cells are skipped")
    done = set(load([args.json])) if args.resume and os.path.exists(args.json) else set()
    if not args.product_only:
        require_lab_build("sweep_split_k.py")
    if not torch.cuda.is_available():
        raise SystemExit("sweep_split_k.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; µs (GPU time); x = cuBLAS / ours", flush=True)
    with json_lines(args.json) as append_row:
        for pattern in args.patterns:
            for k, r in args.shapes:
                tokens = [n for n in args.tokens if (pattern, k, r, n) not in done]
                if not tokens:
                    print(f"# {pattern} {k}->{r}: every token count is in {args.json} already", flush=True)
                    continue
                w = torch.randn(r, k, device="cuda")
                wm, mask, p = magnitude_pack(w, pattern)
                wb = wm.to(torch.bfloat16)
                copies, halves = [], []
                if args.cold:  # the chain's weights: `p` and `wb` first, then distinct ones until each call is cold
                    copies = [(wb, p)]
                    for _ in range(cold_copies(wb.numel() * wb.element_size() // 2) - 1):
                        wm_i, _, p_i = magnitude_pack(torch.randn(r, k, device="cuda"), pattern)
                        copies.append((wm_i.to(torch.bfloat16), p_i))
                    # cuBLAS on half the output rows of each: the bytes and the useful arithmetic of a 2:4 weight without
                    # its metadata, i.e. what a sparse kernel as efficient as cuBLAS would take (dense_chain / half_chain:
                    # the ratio that allows); made once per shape, as the copies are
                    halves = [wb_i[: wb_i.shape[0] // 2].clone() for wb_i, _ in copies]
                same_bytes = same_bytes_weights(p, k, max(1, len(copies))) if args.bound else []
                for n in tokens:
                    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    ref = F.linear(x.float(), wb.float())
                    dense = bench_us(lambda: F.linear(x, wb))
                    row = {"pattern": pattern, "k": k, "r": r, "tokens": n, "dense": dense}
                    row["product"] = timed(x, p, ref, "product")
                    if pattern != "2:4":  # a V:2:M weight is also 2:4: what a compact layer's plan also measures
                        row["view24"] = 1000.0 * view24_time(wm, mask, x, ref)
                    extra = {}
                    if args.product_only:
                        variants = []
                    # 2:4: L = the persistent large configurations; the few-token tiles up to 256 tokens
                    elif pattern == "2:4":
                        variants = [("L", {"small_tiles": 0})] + ([("", {"small_tiles": 1})] if n <= 256 else [])
                        extra["large"] = timed(x, p, ref, "large", small_tiles=0)  # with their own split rule
                        for c in args.configs:
                            extra[f"c{c}"] = timed(x, p, ref, f"configuration {c}", sm90_config=c)
                    elif args.vnm_xt:
                        variants = [("xt", {"vnm_xt": 1})] + ([("rg", {"vnm_xt": 0})] if args.vnm_rg else [])
                    else:
                        variants = [("", {})]
                    for name, knobs in variants:
                        for s in args.splits:
                            extra[f"{name}s{s}"] = timed(x, p, ref, f"{name} split {s}", split_k=s, **knobs)
                    row.update(extra)
                    row["dense_again"] = bench_us(lambda: F.linear(x, wb))  # the GPU's clocks after the row's runs
                    if args.queued:
                        row["dense_queued"] = flushed_us(lambda: F.linear(x, wb))
                        with force_kernel(spmm="wgmma"):
                            row["product_queued"] = flushed_us(lambda: spmm(x, p))
                    if args.cold:
                        row.update(cold_times(x, pattern, wb, p, copies, halves))
                    if same_bytes:
                        row["bytes"] = bench_us(lambda: F.linear(x, same_bytes[0]))
                        if args.cold:
                            row["bytes_chain"] = chain_us([lambda b=b: F.linear(x, b) for b in same_bytes])
                    line = (
                        f"{pattern:>8} {k:>5}->{r:<5} n={n:<4} dense {dense:7.1f} product {row['product']:7.1f} "
                        f"({dense / row['product']:.2f}x)"
                    )
                    line += f" dense again {row['dense_again']:7.1f}"
                    if args.queued:
                        line += f" queued: dense {row['dense_queued']:7.1f} product {row['product_queued']:7.1f}"
                    if args.cold:
                        line += "".join(
                            f" {how}: dense {row['dense_' + how]:7.1f} product {row['product_' + how]:7.1f}"
                            f" ({row['dense_' + how] / row['product_' + how]:.2f}x)"
                            for how in ("read", "chain")
                        )
                        line += f" half {row['half_chain']:7.1f} (ideal {row['dense_chain'] / row['half_chain']:.2f}x)"
                    if same_bytes:
                        line += f" bytes {row['bytes']:7.1f} (bound {dense / row['bytes']:.2f}x)"
                    if "view24" in row:
                        line += f" view24 {row['view24']:7.1f} ({dense / row['view24']:.2f}x)"
                    if extra:
                        best = min(extra, key=extra.get)
                        line += f" best {best} {extra[best]:7.1f} ({dense / extra[best]:.2f}x) | " + " ".join(
                            f"{key}:{v:.0f}" for key, v in extra.items()
                        )
                    print(line, flush=True)
                    append_row(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
