"""Where a 2:4 sparse-wgmma call's GPU time goes, CTA by CTA: the timeline build's phase stamps.

    python benchmarks/timeline_spmm.py [--shapes 4096x4096 ...] [--tokens 1 16 64 128 256] [--json out.jsonl]

The script sets ``HF_SPARSE_NVCC_FLAGS=-DHF_SPARSE_TIMELINE`` before the extension loads (a build of its own, cached
beside the product's): one thread of each CTA of ``csrc/spmm_sm90.cu``'s kernels stamps the GPU's global timer at the
phases of its first work unit (``TimelineMark``: entry, set-up done, first stage issued, first stage ready, main loop
done, split-K arrival, the last split's sum, exit) and records its SM. For each (shape, token count) the call runs in a
chain over distinct copies of the weight (``gpu_timing.chain_us``: each call finds its weight out of the L2, issued
back to back behind a sleep kernel, as in a model's forward); then the stamps are cleared, the chain runs once more and
each CTA's row holds the last call that ran it. Printed, in µs: the chain's time per call, the call's span (first
entry to last exit; the rest of the call time is the gap between kernels), and per phase the median and the maximum
over CTAs, with the phases of the CTA that exits last (the critical path). Stamps cost a few instructions per CTA.
"""

from __future__ import annotations

import argparse
import sys
from statistics import median

from timeline_build import chain_and_rows, timeline_extension

# TimelineMark in csrc/spmm_sm90.cu, in order
ENTRY, SET_UP, FIRST_ISSUED, FIRST_READY, LOOP_DONE, ARRIVED, SUMMED, END, SM, LAST = range(10)
MAX_CTAS = 4096  # kTimelineCtas in csrc/spmm_sm90.cu: the CTAs that stamp
PHASES = ("launch", "set-up", "fill", "main loop", "arrival", "sum", "epilogue")


def cta_phases(row: list[int], t0: int) -> dict[str, float]:
    """One CTA's phases in µs from its stamps (ns; 0 = not stamped) and the call's first entry ``t0``: ``launch``
    (entry - t0), ``set-up`` (to the barriers' set-up, persistent kernels only), ``fill`` (entry to its first stage
    ready, set-up included), ``main loop`` (first stage ready to the loop's end), ``arrival`` (split-K: the partial
    sums stored and the counter passed), ``sum`` (the last split: every split's partial sums added) and ``epilogue``
    (to exit: the output stored, or a non-last split leaving; in a persistent CTA with more than one unit, the rest of
    its units too)."""
    us = {
        "launch": (row[ENTRY] - t0) / 1000.0,
        "fill": (row[FIRST_READY] - row[ENTRY]) / 1000.0,
        "main loop": (row[LOOP_DONE] - row[FIRST_READY]) / 1000.0,
    }
    if row[SET_UP]:
        us["set-up"] = (row[SET_UP] - row[ENTRY]) / 1000.0
    after = row[LOOP_DONE]
    if row[ARRIVED]:
        us["arrival"] = (row[ARRIVED] - after) / 1000.0
        after = row[ARRIVED]
        if row[LAST] == 1 and row[SUMMED]:
            us["sum"] = (row[SUMMED] - after) / 1000.0
            after = row[SUMMED]
    us["epilogue"] = (row[END] - after) / 1000.0
    return us


def summarize(stamps: list[list[int]]) -> dict:
    """The call's span, per-phase median and maximum over its CTAs, the critical CTA's phases and the SM spread, from
    the rows of stamps whose entry is set (the CTAs of the call)."""
    rows = [r for r in stamps if r[ENTRY] and r[FIRST_READY] and r[LOOP_DONE] and r[END]]
    if not rows:
        raise ValueError("no CTA stamped every phase: was the call made on the timeline build's 2:4 wgmma kernels?")
    t0 = min(r[ENTRY] for r in rows)
    per_cta = [cta_phases(r, t0) for r in rows]
    stats = {}
    for phase in PHASES:
        values = [p[phase] for p in per_cta if phase in p]
        if values:
            stats[phase] = (median(values), max(values))
    critical = max(range(len(rows)), key=lambda i: rows[i][END])
    per_sm: dict[int, int] = {}
    for r in rows:
        per_sm[r[SM]] = per_sm.get(r[SM], 0) + 1
    return {
        "ctas": len(rows),
        "sms": len(per_sm),
        "max_ctas_per_sm": max(per_sm.values()),
        "span_us": (rows[critical][END] - t0) / 1000.0,
        "phases": stats,
        "critical": per_cta[critical],
    }


def describe(s: dict) -> str:
    """One line of :func:`summarize`'s figures."""
    phases = " ".join(f"{k} {med:.1f}/{mx:.1f}" for k, (med, mx) in s["phases"].items())
    crit = " + ".join(f"{k} {v:.1f}" for k, v in s["critical"].items())
    return (
        f"{s['ctas']} CTAs on {s['sms']} SMs (<= {s['max_ctas_per_sm']} each); span {s['span_us']:.1f}; "
        f"median/max: {phases}; last to exit: {crit}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x11008", "11008x4096", "28672x8192"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 192, 256])
    ap.add_argument("--json", default=None, help="append one JSON object per (shape, token count) to this file")
    args = ap.parse_args()
    ext = timeline_extension("spmm_timeline", "timeline_spmm.py")
    import torch
    from bench_kernels import checked_error, json_lines, magnitude_pack, parse_shape
    from gpu_timing import cold_copies

    from hf_sparse.ops import force_kernel, spmm

    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; µs (GPU time); phases median/max over CTAs", flush=True)
    with json_lines(args.json) as append_row:
        for shape in args.shapes:
            k, r = parse_shape(shape)
            copies = []
            for _ in range(cold_copies(r * k)):  # the 2:4 weight and metadata: about half the dense bf16 bytes
                wm, _, p = magnitude_pack(torch.randn(r, k, device="cuda"), "2:4")
                copies.append((wm, p))
            for n in args.tokens:
                x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                with force_kernel(spmm="wgmma"):
                    for wm, p in copies:
                        checked_error(spmm(x, p), x.float() @ wm.t(), f"{shape} n={n}")
                    calls = [lambda x=x, p=p: spmm(x, p) for _, p in copies]
                    per_call, rows = chain_and_rows(calls, lambda: ext.spmm_timeline(MAX_CTAS))
                s = summarize(rows)
                print(f"{k:>5}->{r:<5} n={n:<4} chain {per_call:6.1f}/call; {describe(s)}", flush=True)
                append_row({"k": k, "r": r, "tokens": n, "chain_us": per_call, **s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
