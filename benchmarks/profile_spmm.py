"""One SpMM (or dense ``F.linear``) shape, called a few times: the target of an ``ncu`` profile.

    ncu --clock-control none -k regex:spmm_sm90 --launch-skip 3 --launch-count 1 \
        python benchmarks/profile_spmm.py --k 1024 --r 4096 --tokens 8192 --mode wgmma --config 4

``--flush write|read`` flushes the L2 before every call as ``benchmarks/gpu_timing.py`` does (``write``: do_bench's
256 MB of zeros, which leaves dirty lines; ``read``: clean lines only); profile it with ``ncu --cache-control none``
and the ``dram__bytes_write.sum`` metric to see what the timed call writes back.
``--config`` (lab build only: ``HF_SPARSE_BUILD_LAB=1``) forces a tile configuration of the 2:4 wgmma kernel
(``lab.tuning``'s ``sm90_config``). ``--mode dense`` runs ``F.linear`` on the masked bf16 weight (cuBLAS) instead. The inputs are random (never zeros);
the first call is checked against fp64 so a profile is never taken of a wrong kernel. Used by
``benchmarks/profile_spmm.sh``, which runs ncu over the configurations and shapes of interest.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_kernels import magnitude_pack
from gpu_timing import l2_flusher
from lab.tuning import require_lab_build, tuning

from hf_sparse.ops import force_kernel, spmm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, required=True, help="in_features")
    ap.add_argument("--r", type=int, required=True, help="out_features")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mode", choices=["wgmma", "dense"], default="wgmma")
    ap.add_argument("--config", type=int, default=None, help="tile configuration (lab build; default: the product's)")
    ap.add_argument("--pattern", default="2:4", help="2:4 or V:2:M (e.g. 64:2:8)")
    ap.add_argument(
        "--pipe", type=int, default=None, help="V:2:M pipeline (lab build's vnm_pipe; default: the product's)"
    )
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--flush", choices=["none", "write", "read"], default="none", help="L2 flush before every call")
    args = ap.parse_args()
    knobs = {"sm90_config": args.config, "vnm_pipe": args.pipe}
    knobs = {name: value for name, value in knobs.items() if value is not None}
    if knobs:
        require_lab_build("--config / --pipe")
    with force_kernel(spmm="wgmma"), tuning(**knobs):
        return run(args)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    w = torch.randn(args.r, args.k, device="cuda")
    wm, _, p = magnitude_pack(w, args.pattern)
    wd = wm.bfloat16()
    x = torch.randn(args.tokens, args.k, device="cuda").bfloat16()
    ref = F.linear(x.double(), wd.double())
    fn = (lambda: F.linear(x, wd)) if args.mode == "dense" else (lambda: spmm(x, p))
    flush = l2_flusher(args.flush) if args.flush != "none" else (lambda: None)
    flush()
    y = fn()
    err = float((y.double() - ref).norm() / ref.norm())
    print(
        f"{args.mode} {args.pattern} config={args.config} pipe={args.pipe} {args.tokens}x{args.k}->{args.r}: rel err {err:.2e}",
        flush=True,
    )
    for _ in range(args.calls - 1):
        flush()
        fn()
    torch.cuda.synchronize()
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
