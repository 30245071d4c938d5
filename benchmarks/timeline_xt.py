"""Where the V:2:M X^T path's GEMM spends its cycles, CTA by CTA: the timeline build's per-role cycle counters.

    python benchmarks/timeline_xt.py [--shapes 768x3072 ...] [--patterns 128:2:8 ...] [--tokens 8192] [--json out]
    HF_SPARSE_BUILD_LAB=1 python benchmarks/timeline_xt.py ... --splits 0 1 2 4   # each split count forced

The script sets ``HF_SPARSE_NVCC_FLAGS=-DHF_SPARSE_TIMELINE`` before the extension loads (a build of its own, cached
beside the product's). Each persistent CTA of ``csrc/spmm_vnm_xt_sm90.cuh`` then sums SM cycles (``clock64``) over its
work units (``XtCounter``): the producer's thread 0 in each unit's set-up before its first copy and waiting for free
stages; thread 0 of the first consumer warpgroup waiting for full stages, draining its last wgmmas, in split-K and in
the epilogue. For each (shape, pattern) the call runs in a chain over distinct weight copies (``gpu_timing.chain_us``,
as a model's forward issues them); the counters are cleared, the chain runs once more, and each CTA's row holds the
last call that ran it. Printed: the chain's µs per call; per CTA (median over CTAs) the units it ran, its cycles per
unit, and the share of the consumer's and of the producer's cycles each wait takes (the rest: issuing wgmmas or
copies). What is not waiting is what the role spends its cycles on; a consumer that waits on full stages most of the
time is fed too slowly, a producer that waits on free stages is ahead of its consumers. Then a stage's flight (from
the producer's first copy into it to the consumer's full-wait returning) against the consumer's cycles per step: a
flight near the steps the ring holds in flight (its stages less the one or two the consumer holds) times the step
says the ring is too shallow for the copies' latency; a flight well under it says the producer's issue sets the
pace. ``--splits`` runs each (shape, pattern) once per split count, forced by the lab build's ``split_k`` knob (0: the
product's count), so that what a split adds (the split-K share) is measured beside what it saves.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from statistics import median

from timeline_build import chain_and_rows, timeline_extension

# XtCounter in csrc/spmm_vnm_xt_sm90.cuh, in order
UNITS, PRODUCER, SET_UP, EMPTY_WAIT, CONSUMER, FULL_WAIT, DRAIN, SPLIT, EPILOGUE, STAGE_FLIGHT, STEPS = range(11)
MAX_CTAS = 1024  # kXtTimelineCtas
CONSUMER_PARTS = {"full wait": FULL_WAIT, "drain": DRAIN, "split-K": SPLIT, "epilogue": EPILOGUE}
PRODUCER_PARTS = {"set-up": SET_UP, "empty wait": EMPTY_WAIT}


def summarize(counters: list[list[int]]) -> dict:
    """Medians over the CTAs that ran units (rows of ``XtCounter`` values): units per CTA, consumer and producer
    cycles per unit, and each part's share of its role's cycles (the rest under ``"other"``)."""
    rows = [r for r in counters if r[UNITS] > 0 and r[CONSUMER] > 0 and r[PRODUCER] > 0 and r[STEPS] > 0]
    if not rows:
        raise ValueError("no CTA counted a unit: was the call made on the timeline build's X^T path?")

    def shares(total: int, parts: dict[str, int]) -> dict[str, float]:
        out = {name: median(r[i] / r[total] for r in rows) for name, i in parts.items()}
        out["other"] = median(1.0 - sum(r[i] for i in parts.values()) / r[total] for r in rows)
        return out

    return {
        "ctas": len(rows),
        "units": median(r[UNITS] for r in rows),
        "consumer_cycles_per_unit": median(r[CONSUMER] / r[UNITS] for r in rows),
        "producer_cycles_per_unit": median(r[PRODUCER] / r[UNITS] for r in rows),
        "consumer_cycles_per_step": median(r[CONSUMER] / r[STEPS] for r in rows),
        "stage_flight_cycles": median(r[STAGE_FLIGHT] / r[STEPS] for r in rows),
        "consumer": shares(CONSUMER, CONSUMER_PARTS),
        "producer": shares(PRODUCER, PRODUCER_PARTS),
    }


def describe(s: dict) -> str:
    """One line of :func:`summarize`'s figures."""
    cons = " ".join(f"{k} {100 * v:.0f}%" for k, v in s["consumer"].items())
    prod = " ".join(f"{k} {100 * v:.0f}%" for k, v in s["producer"].items())
    return (
        f"{s['ctas']} CTAs, {s['units']:.0f} units each; consumer {s['consumer_cycles_per_unit']:.0f} cycles/unit"
        f" ({cons}); producer {s['producer_cycles_per_unit']:.0f} cycles/unit ({prod}); a step"
        f" {s['consumer_cycles_per_step']:.0f} cycles, a stage in flight {s['stage_flight_cycles']:.0f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["768x3072", "1024x4096", "4096x11008"])
    ap.add_argument("--patterns", nargs="+", default=["128:2:8", "128:2:16"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", default=None, help="append one JSON object per (shape, pattern, split) to this file")
    ap.add_argument(
        "--splits", type=int, nargs="+", default=[0], help="split counts to force (lab build); 0: the product's count"
    )
    args = ap.parse_args()
    if any(s < 0 for s in args.splits):
        ap.error("--splits: counts are 0 (the product's) or more")
    ext = timeline_extension("spmm_xt_timeline", "timeline_xt.py")
    import torch
    from bench_kernels import checked_error, cold_packs, json_lines, parse_shape
    from lab.tuning import require_lab_build, tuning

    if any(args.splits):
        require_lab_build("timeline_xt.py --splits")

    from hf_sparse.ops import force_kernel, spmm

    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; {args.tokens} tokens; medians over CTAs", flush=True)
    with json_lines(args.json) as append_row:
        for shape in args.shapes:
            k, r = parse_shape(shape)
            x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
            for pattern in args.patterns:
                wm, packs = cold_packs(torch.randn(r, k, device="cuda"), pattern)
                for split in args.splits:
                    forced = tuning(split_k=split) if split else contextlib.nullcontext()
                    with force_kernel(spmm="wgmma"), forced:
                        checked_error(spmm(x, packs[0]), x.float() @ wm.t(), f"{shape} {pattern} split {split}")
                        calls = [lambda p=p, x=x: spmm(x, p) for p in packs]
                        per_call, rows = chain_and_rows(calls, lambda: ext.spmm_xt_timeline(MAX_CTAS))
                    s = summarize(rows)
                    print(
                        f"{k:>5}->{r:<5} {pattern:<8} split {split or 'product':<7} chain {per_call:7.1f} us/call; "
                        f"{describe(s)}",
                        flush=True,
                    )
                    append_row({"k": k, "r": r, "pattern": pattern, "split_k": split, "chain_us": per_call, **s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
