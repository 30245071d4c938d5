"""Tuning helper: time the SpMM kernel built with each tile variant (csrc/tile_config.h) in one run.

    python benchmarks/bench_spmm_variants.py --variants 0 1 2

Each variant is built in a subprocess as a lab build (``HF_SPARSE_BUILD_LAB=1``, with
``HF_SPARSE_NVCC_FLAGS=-DHF_SPARSE_SPMM_VARIANT=<v>``; variant 0 is the product's shapes); the table prints the
``mma.sp`` kernel's time and its ratio to dense cuBLAS (``F.linear``) at 8192 tokens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import torch, torch.nn.functional as F
from triton.testing import do_bench
from hf_sparse.masks import nm_mask, vnm_mask
from hf_sparse.ops import force_kernel, pack, spmm
torch.manual_seed(0)
force_kernel(spmm="mma_sp").__enter__()  # the variants are mma.sp tiles; held for the whole child process
for k, r in [(1024, 4096), (4096, 1024), (4096, 11008)]:
    x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(r, k, device="cuda")
    td = do_bench(lambda: F.linear(x, w.bfloat16()), warmup=10, rep=40, return_mode="median")
    for v, m in [(64, 4), (64, 8), (128, 8), (64, 16), (64, 32)]:
        mask = nm_mask(w.abs(), 2, 4) if m == 4 else vnm_mask(w.abs(), v, 2, m)
        wm = torch.where(mask, w, 0.0)
        p = pack(wm, mask, v, m, torch.bfloat16)
        y = spmm(x, p)
        ref = F.linear(x.float(), wm.bfloat16().float())
        err = float((y.float() - ref).norm() / ref.norm())
        t = do_bench(lambda: spmm(x, p), warmup=10, rep=40, return_mode="median")
        print(f"VARIANT {k:>5}->{r:<5} {v}:2:{m:<3} dense {td:.4f} ours {t:.4f} x{td / t:5.2f} err {err:.1e}", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    for v in args.variants:
        env = dict(os.environ)
        if v:
            env["HF_SPARSE_BUILD_LAB"] = "1"
            env["HF_SPARSE_NVCC_FLAGS"] = f"-DHF_SPARSE_SPMM_VARIANT={v}"
        print(f"== variant {v}", flush=True)
        subprocess.run([sys.executable, "-c", CHILD], env=env, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
