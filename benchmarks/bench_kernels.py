"""Kernel benchmark: SpMM / SDDMM / pack of hf_sparse against dense cuBLAS and cuSPARSELt, ratios in one run.

    python benchmarks/bench_kernels.py [--tokens 8192 16] [--csv out.csv] [--patterns 2:4 64:2:8 ...]
        [--shapes 1024x1024 768x3072 ...] [--sm90-configs 15 20 ...]
    python benchmarks/bench_kernels.py --sddmm-only [--tokens 8192] [--patterns ...]   # the SDDMM table alone

Times are medians of ``triton.testing.do_bench`` (CUDA events) on fresh random bf16 data. Ratios are
``baseline time / our time`` (> 1 means we are faster). Each SpMM result is also checked against the dense
product before it is reported. *ours* is the ``mma.sp`` kernel; *wgmma* the sparse-``wgmma`` kernel of the pattern
(``spmm_sm90.cu`` for 2:4, ``spmm_vnm_sm90.cu`` for V:2:M; sm_90a builds only, ``n/a`` elsewhere) with its ratio to
dense and to ``mma.sp`` (*xMma*).

cuSPARSELt (2:4; a V:2:M weight keeps <= 2 of every 4 columns, so it runs as 2:4 too): *cslt* = eager
``torch._cslt_sparse_mm``, default algorithm; *csltT* = the same with the algorithm of ``_cslt_sparse_mm_search``
(both rebuild descriptors and plan per call); *csltC* = the cached-plan path (``lab.cslt``: one
``cusparseLtMatmul`` per call, algorithm searched once; lab build only, ``HF_SPARSE_BUILD_LAB=1``, else nan), with ``cC*D`` = dense / csltC and ``cC*O`` = our best kernel
(wgmma where available, else mma.sp) / csltC. *v24* (V:2:M only): our 2:4 SpMM on the weight packed as 2:4 (the
forward a compact V:2:M layer can measure as ``sparse24``), ``v24*D`` = dense / v24.

The run ends with a summary: per pattern and token count, the range over the shapes of the best of our kernels
(*wgmma*, *ours*, *v24*, whichever is fastest: what a compact layer's measured plan can pick) against cuBLAS.

``--shapes`` limits the run to some (in x out) shapes; ``--sm90-configs`` (lab build only: ``HF_SPARSE_BUILD_LAB=1``)
adds, for 2:4 rows, the 2:4 wgmma kernel forced to each listed tile configuration (``lab.tuning``'s ``sm90_config``),
each checked against the dense product, printed as one extra line per row. Kernels are forced with
``hf_sparse.ops.force_kernel``.

SDDMM (``--sddmm-only``, or the *sddmm* columns of the main table: the default kernel): *dWgemm* = the dense weight
gradient ``dy.t() @ x`` (cuBLAS, bf16 out); *sdMma* = the ``mma.sync`` SDDMM (``csrc/sddmm.cu``), *sdWg* = the dense
``wgmma`` SDDMM (``csrc/sddmm_sm90.cu``, sm_90a only), both fp32 values at the kept slots, each checked against
the fp32 product first; *xDW* = dWgemm / that kernel; *scat* = ``scatter_dense`` of the values into the dense bf16
gradient, timed separately.
"""
# ruff: noqa: B023  (every benchmarked lambda is called at once, inside its own loop iteration)

from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from gpu_timing import cold_copies
from lab.tuning import require_lab_build, tuning

from hf_sparse.masks import nm_mask, vnm_mask
from hf_sparse.ops import force_kernel, pack, sddmm, spmm

# (in, out); 1024 -> 1024: BERT-large's Q, K, V and attention-output projections
SHAPES = [(768, 3072), (3072, 768), (1024, 1024), (1024, 4096), (4096, 1024), (4096, 11008), (11008, 4096)]
PATTERNS = ["2:4", "64:2:8", "64:2:16", "64:2:32", "128:2:8"]


def parse(p: str) -> tuple[int, int]:
    parts = [int(s) for s in p.split(":")]
    return (64, 4) if len(parts) == 2 else (parts[0], parts[2])


def magnitude_pack(w: torch.Tensor, pattern: str):
    """``pattern`` (``"2:4"`` or ``"V:2:M"``) kept by magnitude on ``w``: the masked weight, the mask and its bf16
    pack, the inputs every SpMM/SDDMM benchmark here times."""
    v, m = parse(pattern)
    mask = nm_mask(w.abs(), 2, 4) if m == 4 else vnm_mask(w.abs(), v, 2, m)
    wm = torch.where(mask, w, 0.0)
    return wm, mask, pack(wm, mask, v, m, torch.bfloat16)


def pack_bytes(p) -> int:
    """The bytes a SpMM call reads of the packed weight ``p``: its values, metadata and column offsets."""
    return sum(t.numel() * t.element_size() for t in (p.values, p.meta, p.columns))


def cold_packs(w: torch.Tensor, pattern: str) -> tuple[torch.Tensor, list]:
    """``w`` kept by magnitude and packed (:func:`magnitude_pack`), then packs of distinct random weights of its shape
    until a chain over them (``gpu_timing.chain_us``) finds each one out of the L2 (``gpu_timing.cold_copies`` of a
    pack's bytes), as a model's forward reads each layer's weight: ``w``'s masked weight (to check a call against)
    and the packs, ``w``'s first."""
    wm, _, first = magnitude_pack(w, pattern)
    more = cold_copies(pack_bytes(first)) - 1
    return wm, [first] + [magnitude_pack(torch.randn_like(w), pattern)[2] for _ in range(more)]


@contextmanager
def json_lines(path: str | None) -> Iterator[Callable[[dict], None]]:
    """A function that appends a row to ``path`` as one JSON object a line, flushed at once so a run cut short keeps
    the rows it made (``--json`` of the scripts here); with no path it does nothing."""
    if path is None:
        yield lambda row: None
        return
    with open(path, "a+") as f:
        if f.tell() > 0:  # a run killed while it wrote its last row left it without its newline: end that line
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")

        def append(row: dict) -> None:
            f.write(json.dumps(row) + "\n")
            f.flush()

        yield append


# Every projection shape (in_features x out_features) of the Llama-2 7B / 13B / 70B decoders, the shapes issue 17
# item 2 names: 7B's attention, MLP up and down; 13B's; 70B's query / output, key / value (grouped-query attention: 8
# heads of 128), MLP up and down.
LLAMA_SHAPES = [
    "4096x4096", "4096x11008", "11008x4096",
    "5120x5120", "5120x13824", "13824x5120",
    "8192x8192", "8192x1024", "8192x28672", "28672x8192",
]  # fmt: skip


def parse_shape(s: str) -> tuple[int, int]:
    """``"1024x4096"`` -> (1024, 4096): in_features x out_features."""
    try:
        k, r = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {s!r}: expected IN x OUT, e.g. 1024x4096") from None
    if k <= 0 or r <= 0:
        raise argparse.ArgumentTypeError(f"shape {s!r}: both sizes must be positive")
    return k, r


def wgmma_available() -> bool:
    from hf_sparse.ops import _select

    return _select.wgmma_available(torch.device("cuda"))


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def checked_error(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 2e-2) -> float:
    """Relative error of ``got`` against ``ref``, reported as a WRONG RESULT on stderr from ``tol`` up (never hidden;
    the figure is still timed and printed)."""
    err = float((got.float() - ref).norm() / ref.norm())
    if not err < tol:
        print(f"  WRONG RESULT {what}: rel err {err:.3g}", file=sys.stderr)
    return err


def sm90_config_times(configs: list[int], x: torch.Tensor, p, ref: torch.Tensor) -> dict[int, float]:
    """The 2:4 wgmma kernel at each tile configuration in ``configs`` (ms), each checked against ``ref`` first."""
    out = {}
    for cfg in configs:
        with force_kernel(spmm="wgmma"), tuning(sm90_config=cfg):
            checked_error(spmm(x, p), ref, f"wgmma config {cfg}")
            out[cfg] = bench(lambda: spmm(x, p))
    return out


def cslt_times(w_sparse: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(eager default algorithm, eager best algorithm from _cslt_sparse_mm_search) in ms; nan if unavailable."""
    try:
        cw = torch._cslt_compress(w_sparse)
        xt = x.t()
        out = torch._cslt_sparse_mm(cw, xt, transpose_result=True)
        if out.shape != (x.shape[0], w_sparse.shape[0]):
            raise RuntimeError(f"unexpected cuSPARSELt output shape {tuple(out.shape)}")
        t0 = bench(lambda: torch._cslt_sparse_mm(cw, xt, transpose_result=True))
        alg = torch._cslt_sparse_mm_search(cw, xt)
        t1 = bench(lambda: torch._cslt_sparse_mm(cw, xt, alg_id=alg, transpose_result=True))
        return t0, t1
    except Exception as exc:  # report, never hide
        print(f"  cuSPARSELt unavailable: {exc}", file=sys.stderr)
        return float("nan"), float("nan")


def cslt_cached_time(w_sparse: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> float:
    """The cached-plan cuSPARSELt path (``lab.cslt``, lab build only) in ms, checked against ``ref``; nan if unavailable."""
    from lab import cslt

    if not cslt.available():
        print("  cached cuSPARSELt path unavailable (lab build only: HF_SPARSE_BUILD_LAB=1)", file=sys.stderr)
        return float("nan")
    cw = cslt.compress(w_sparse.contiguous())
    checked_error(cw.matmul(x), ref, "cached cuSPARSELt")  # the first call makes the plan and searches the algorithm
    t = bench(lambda: cw.matmul(x))
    if cw.plan_inits() != 1:
        print(f"  cached cuSPARSELt made {cw.plan_inits()} plans for one shape", file=sys.stderr)
    return t


def view24_time(wm: torch.Tensor, mask: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> float:
    """Our 2:4 SpMM (default kernel) on a V:2:M weight packed as 2:4, in ms, checked against ``ref``."""
    view = pack(wm, mask, 64, 4, torch.bfloat16, validate=False)
    checked_error(spmm(x, view), ref, "2:4 view")
    return bench(lambda: spmm(x, view))


def sddmm_section(tokens_list: list[int], patterns: list[str], shapes: list[tuple[int, int]]) -> list[dict]:
    """Dense dW GEMM vs the two SDDMM kernels (+ the scatter into the dense gradient), one row per shape/pattern."""
    from hf_sparse.ops import scatter_dense
    from hf_sparse.ops._layout import kept_columns

    has_wgmma = wgmma_available()
    print(f"# SDDMM: sdMma = mma.sync kernel, sdWg = dense-wgmma kernel ({'available' if has_wgmma else 'n/a'})")
    print(
        f"{'tokens':>6} {'in->out':>12} {'pattern':>8} {'dWgemm':>7} {'sdMma':>7} {'xDW':>5} {'sdWg':>7} {'xDW':>5} "
        f"{'xMma':>5} {'scat':>7} {'errMma':>7} {'errWg':>7}"
    )
    rows = []
    for tokens in tokens_list:
        for k, r in shapes:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(tokens, r, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(r, k, device="cuda")
            t_dw = bench(lambda: dy.t() @ x)
            full = dy.float().t() @ x.float()
            for pat in patterns:
                _, mask, p = magnitude_pack(w, pat)
                ref = torch.gather(full, 1, kept_columns(p))
                times, errs = {}, {}
                for kern in ("mma", "wgmma"):
                    if kern == "wgmma" and not has_wgmma:
                        times[kern], errs[kern] = float("nan"), float("nan")
                        continue
                    with force_kernel(sddmm=kern):
                        errs[kern] = checked_error(sddmm(dy, x, p), ref, f"sddmm {kern} {pat} {k}->{r}", tol=1e-2)
                        times[kern] = bench(lambda: sddmm(dy, x, p))
                vals = sddmm(dy, x, p)
                t_sc = bench(lambda: scatter_dense(vals, p, torch.bfloat16))
                row = dict(
                    tokens=tokens,
                    k=k,
                    r=r,
                    pattern=pat,
                    dw_gemm=t_dw,
                    sddmm_mma=times["mma"],
                    sddmm_wgmma=times["wgmma"],
                    x_dw_mma=t_dw / times["mma"],
                    x_dw_wgmma=t_dw / times["wgmma"],
                    wgmma_x_mma=times["mma"] / times["wgmma"],
                    scatter=t_sc,
                    err_mma=errs["mma"],
                    err_wgmma=errs["wgmma"],
                )
                rows.append(row)
                print(
                    f"{tokens:>6} {f'{k}->{r}':>12} {pat:>8} {t_dw:7.4f} {times['mma']:7.4f} {row['x_dw_mma']:5.2f} "
                    f"{times['wgmma']:7.4f} {row['x_dw_wgmma']:5.2f} {row['wgmma_x_mma']:5.2f} {t_sc:7.4f} "
                    f"{errs['mma']:7.1e} {errs['wgmma']:7.1e}",
                    flush=True,
                )
    return rows


def best_ratio(row: dict) -> float:
    """The best of our kernels for the row's pattern against cuBLAS: the sparse-``wgmma`` kernel, ``mma.sp`` or the 2:4
    view of a V:2:M weight, whichever is fastest (what a compact layer's measured plan can pick)."""
    ratios = [float(row[key]) for key in ("x_dense", "wgmma_x_dense", "ours_2to4_view_x_dense")]
    return max(r for r in ratios if r == r)


def print_best_summary(rows: list[dict]) -> None:
    """Per pattern and token count, the range over the shapes of :func:`best_ratio`."""
    print("\n| pattern | tokens | best of our kernels x cuBLAS (min-max over the shapes) |")
    print("| --- | ---: | ---: |")
    for pat in dict.fromkeys(str(r["pattern"]) for r in rows):
        for tokens in dict.fromkeys(int(r["tokens"]) for r in rows):
            best = [best_ratio(r) for r in rows if str(r["pattern"]) == pat and int(r["tokens"]) == tokens]
            if best:
                print(f"| {pat} | {tokens} | {min(best):.2f}-{max(best):.2f}x |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16])
    ap.add_argument("--patterns", nargs="+", default=PATTERNS)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--no-sddmm", action="store_true")
    ap.add_argument("--sddmm-only", action="store_true", help="only the SDDMM table (dense dW GEMM vs both kernels)")
    ap.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=SHAPES,
        help="in x out, e.g. 1024x1024 768x3072 (default: all)",
    )
    ap.add_argument(
        "--sm90-configs",
        type=int,
        nargs="+",
        default=[],
        help="also time the 2:4 wgmma kernel at these tile configurations (2:4 rows only; lab build)",
    )
    args = ap.parse_args()
    if args.sm90_configs:
        require_lab_build("--sm90-configs")
    dev = torch.cuda.get_device_name()
    print(
        f"# {dev}, torch {torch.__version__}, {datetime.date.today()}, bf16; times in ms (median); ratio = base/ours"
    )
    if args.sddmm_only:
        rows_sd = sddmm_section(args.tokens, args.patterns, args.shapes)
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(rows_sd[0]))
                wr.writeheader()
                wr.writerows(rows_sd)
        return 0
    rows_out = []
    has_wgmma = wgmma_available()
    print(f"# ours = mma.sp kernel; wgmma = sparse-wgmma kernel (sm_90a): {'available' if has_wgmma else 'n/a'}")
    hdr = (
        f"{'tokens':>6} {'in->out':>12} {'pattern':>8} {'dense':>7} {'cslt':>7} {'csltT':>7} {'ours':>7} "
        f"{'xDense':>6} {'xCslt':>6} {'xCsltT':>6} | {'wgmma':>7} {'xDense':>6} {'xMma':>5} {'xCsltT':>6} | "
        f"{'csltC':>7} {'cC*D':>5} {'cC*O':>5} | {'v24':>7} {'v24*D':>5} | "
        f"{'dWgemm':>7} {'sddmm':>7} {'xDW':>5} | {'pack':>6} {'%gemm':>5}"
    )
    print(hdr)
    for tokens in args.tokens:
        for k, r in args.shapes:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(tokens, r, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(r, k, device="cuda")
            wd = w.bfloat16()
            t_dense = bench(lambda: F.linear(x, wd))
            t_dw = bench(lambda: dy.t() @ x)
            for pat in args.patterns:
                v, m = parse(pat)
                wm, mask, p = magnitude_pack(w, pat)
                ref = F.linear(x.float(), wm.bfloat16().float())
                with force_kernel(spmm="mma_sp"):
                    err = checked_error(spmm(x, p), ref, f"{pat} {k}->{r} tokens={tokens}")
                    t_ours = bench(lambda: spmm(x, p))
                t_wg, err_wg = float("nan"), float("nan")
                if has_wgmma:
                    with force_kernel(spmm="wgmma"):
                        err_wg = checked_error(spmm(x, p), ref, f"wgmma {pat} {k}->{r} tokens={tokens}")
                        t_wg = bench(lambda: spmm(x, p))
                # a V:2:M weight is also 2:4 (<= 2 kept of every 4 columns): cuSPARSELt and our 2:4 kernel run it as
                # such
                t_c0, t_c1 = cslt_times(wm.bfloat16(), x)
                t_cc = cslt_cached_time(wm.bfloat16(), x, ref)
                t_v24 = view24_time(wm, mask, x, ref) if m > 4 else float("nan")
                t_best = t_wg if t_wg == t_wg else t_ours  # wgmma where it ran, else mma.sp
                t_sd = float("nan") if args.no_sddmm else bench(lambda: sddmm(dy, x, p))
                t_pack = bench(lambda: pack(wm, mask, v, m, torch.bfloat16, validate=False))
                t_cfg = sm90_config_times(args.sm90_configs, x, p, ref) if has_wgmma and m == 4 else {}
                row = dict(
                    tokens=tokens,
                    k=k,
                    r=r,
                    pattern=pat,
                    dense=t_dense,
                    cslt=t_c0,
                    cslt_tuned=t_c1,
                    ours=t_ours,
                    x_dense=t_dense / t_ours,
                    x_cslt=t_c0 / t_ours,
                    x_cslt_tuned=t_c1 / t_ours,
                    wgmma=t_wg,
                    wgmma_x_dense=t_dense / t_wg,
                    wgmma_x_mma_sp=t_ours / t_wg,
                    wgmma_x_cslt_tuned=t_c1 / t_wg,
                    wgmma_err=err_wg,
                    cslt_cached=t_cc,
                    cslt_cached_x_dense=t_dense / t_cc,
                    cslt_cached_x_ours=t_best / t_cc,
                    ours_2to4_view=t_v24,
                    ours_2to4_view_x_dense=t_dense / t_v24,
                    dw_gemm=t_dw,
                    sddmm=t_sd,
                    x_dw=t_dw / t_sd,
                    pack=t_pack,
                    pack_pct=100 * t_pack / t_dense,
                    err=err,
                    **{f"sm90_cfg{c}": t for c, t in t_cfg.items()},
                )
                rows_out.append(row)
                print(
                    f"{tokens:>6} {f'{k}->{r}':>12} {pat:>8} {t_dense:7.4f} {t_c0:7.4f} {t_c1:7.4f} {t_ours:7.4f} "
                    f"{row['x_dense']:6.2f} {row['x_cslt']:6.2f} {row['x_cslt_tuned']:6.2f} | {t_wg:7.4f} "
                    f"{row['wgmma_x_dense']:6.2f} {row['wgmma_x_mma_sp']:5.2f} {row['wgmma_x_cslt_tuned']:6.2f} | {t_cc:7.4f} "
                    f"{row['cslt_cached_x_dense']:5.2f} {row['cslt_cached_x_ours']:5.2f} | {t_v24:7.4f} "
                    f"{row['ours_2to4_view_x_dense']:5.2f} | {t_dw:7.4f} "
                    f"{t_sd:7.4f} {row['x_dw']:5.2f} | {t_pack:6.4f} {row['pack_pct']:5.1f}",
                    flush=True,
                )
                if t_cfg:
                    print(
                        f"{'':>6} {f'{k}->{r}':>12} {pat:>8} wgmma configs (ms, x dense, x cached cuSPARSELt): "
                        + " | ".join(f"{c}: {t:.4f} {t_dense / t:.2f} {t_cc / t:.2f}" for c, t in t_cfg.items()),
                        flush=True,
                    )
    print_best_summary(rows_out)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            wr.writeheader()
            wr.writerows(rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
