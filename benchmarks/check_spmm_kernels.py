"""Quick check of the SpMM kernels (mma.sp and sparse wgmma) against fp64 and dense cuBLAS, in one short run.

    python benchmarks/check_spmm_kernels.py [--patterns 2:4 64:2:8 ...] [--no-configs]

For each pattern and shape: relative error of each kernel and of torch's own bf16 product against an fp64 reference
(poisoned output allocator, random data), then median times (``triton.testing.do_bench``), the ratio to dense and
(wgmma) to mma.sp. In the lab build (``HF_SPARSE_BUILD_LAB=1``) also, for 2:4, every tile configuration of the 2:4
wgmma kernel (``lab.tuning``'s ``sm90_config``), for V:2:M every pipeline of the V:2:M wgmma kernel (``vnm_pipe``)
and, at M = 8, both token tiles (``vnm_tile``); the product build checks the kernels as the product runs them
(``--no-configs`` implied). Meant as the first thing a device run does: it fails fast (exit 1) if a kernel is wrong,
before any long benchmark.
"""
# ruff: noqa: B023  (every benchmarked lambda is called at once, inside its own loop iteration)

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_kernels import magnitude_pack
from lab.tuning import SM90_CONFIGS, tuning

from hf_sparse.ops import force_kernel, spmm
from hf_sparse.ops._build import lab_build
from hf_sparse.ops._select import wgmma_available

SHAPES = [
    (1, 768, 3072),
    (7, 4096, 1024),
    (8192, 768, 3072),
    (8192, 3072, 768),
    (8192, 1024, 1024),
    (8191, 1024, 4096),
    (8192, 4096, 1024),
    (8192, 4096, 11008),
    (8192, 11008, 4096),
]


#: the lab build's V:2:M pipelines (vnm_pipe): ws = warp-specialised, wssh = ws with one gather for both slabs of a
#: CTA where they keep the same columns (V = 128)
PIPE_NAMES = {0: "regs", 1: "staged", 2: "regs+pf", 3: "ws", 4: "wssh"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", nargs="+", default=["2:4"])
    ap.add_argument("--no-configs", action="store_true", help="skip the per-tile-configuration timings")
    args = ap.parse_args()
    configs = not args.no_configs and lab_build()
    kernels = ["mma_sp"] + (["wgmma"] if wgmma_available(torch.device("cuda")) else [])
    print(f"# {torch.cuda.get_device_name()}, kernels: {kernels}, lab configurations: {configs}")
    bad = 0
    for pat, (tokens, k, r) in ((pat, shape) for pat in args.patterns for shape in SHAPES):
        w = torch.randn(r, k, device="cuda")
        wm, _, p = magnitude_pack(w, pat)
        m = p.m
        x = torch.randn(tokens, k, device="cuda").bfloat16()
        b = torch.randn(r, device="cuda").bfloat16()
        wd = wm.bfloat16()
        ref = F.linear(x.double(), wd.double(), b.double())
        torch_err = rel(F.linear(x, wd, b), ref)
        t_dense = float(do_bench(lambda: F.linear(x, wd), warmup=10, rep=40, return_mode="median"))

        def check_and_time(x=x, p=p, b=b, ref=ref, torch_err=torch_err):
            """The current kernel/config on NaN-poisoned memory: (error, correct?, median ms)."""
            torch.full((64 << 20,), float("nan"), device="cuda")  # poison the allocator's free blocks
            y = spmm(x, p, b)
            err = rel(y, ref)
            ok = not bool(torch.isnan(y).any()) and err <= 2 * torch_err + 1e-6
            return err, ok, float(do_bench(lambda: spmm(x, p), warmup=10, rep=40, return_mode="median"))

        line = f"{pat:>7} {tokens:>5} {k:>5}->{r:<5} torch_err {torch_err:.2e} dense {t_dense:.4f} ms"
        times = {}
        for kern in kernels:
            with force_kernel(spmm=kern):
                err, ok, t = check_and_time()
            times[kern] = t
            bad += not ok
            line += f" | {kern} err {err:.2e}{'' if ok else ' WRONG'} {t:.4f} ms x{t_dense / t:.2f}"
        if "wgmma" in times:
            line += f" | wgmma x mma_sp {times['mma_sp'] / times['wgmma']:.2f}"
        print(line, flush=True)
        if "wgmma" in kernels and m >= 8 and configs:  # V:2:M pipelines and token tiles
            line = "      wgmma pipe/tile:"
            for pipe in (1, 0, 2, 3, 4) if m == 8 else (1, 0, 2, 3):
                for tile in (128, 64) if m == 8 and tokens > 64 else (64,):
                    with force_kernel(spmm="wgmma"), tuning(vnm_pipe=pipe, vnm_tile=tile):
                        _, ok, t = check_and_time()
                    bad += not ok
                    name = PIPE_NAMES[pipe]
                    line += f" | {name}/{tile}: {t:.4f} ms x{t_dense / t:.2f}"
                    line += "" if ok else " WRONG"
            print(line, flush=True)
        if "wgmma" in kernels and m == 4 and configs:  # every configuration; 6 and up (TMA) also run small
            line = "      wgmma configs:"
            for cfg in SM90_CONFIGS if tokens > 128 else SM90_CONFIGS[6:]:
                with force_kernel(spmm="wgmma"), tuning(sm90_config=cfg):
                    _, ok, t = check_and_time()
                bad += not ok
                line += f" | {cfg}: {t:.4f} ms x{t_dense / t:.2f}{'' if ok else ' WRONG'}"
            print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
