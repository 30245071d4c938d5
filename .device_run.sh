#!/bin/bash
# device run helper (not committed): build, smoke, tests, bench; everything into $OUT
cd "$(dirname "$0")"
export PYTHONPATH=$PWD HF_SPARSE_CUDA_ARCH_LIST=9.0
date -u > $OUT/date.txt; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $OUT/date.txt
timeout 200 python -m hf_sparse.ops.build > $OUT/build.txt 2>&1; echo "build rc=$?"; tail -2 $OUT/build.txt
timeout 60 python - > $OUT/smoke.txt 2>&1 <<'PY'
import os, torch
from hf_sparse.ops import pack, sddmm, scatter_dense
from tests.ops._helpers import random_masked
for m, v, gather in [(8, 64, "staged"), (8, 64, "regs"), (8, 128, "staged"), (4, 64, "staged"), (16, 64, "staged")]:
    os.environ["HF_SPARSE_SDDMM_KERNEL"] = "wgmma"; os.environ["HF_SPARSE_SDDMM_GATHER"] = gather
    w, mask = random_masked(256, 64 * m * 2, v, m, device="cuda", seed=1)
    p = pack(w, mask, v, m, torch.bfloat16)
    x = torch.randn(300, w.shape[1], device="cuda").bfloat16(); dy = torch.randn(300, 256, device="cuda").bfloat16()
    got = scatter_dense(sddmm(dy, x, p), p, torch.float32); torch.cuda.synchronize()
    ref = torch.where(mask, dy.float().t() @ x.float(), 0.0)
    print(m, v, gather, float((got - ref).norm() / ref.norm()), flush=True)
PY
echo "smoke rc=$?"; cat $OUT/smoke.txt | tail -6
timeout 150 python -m pytest -q -m gpu tests/ops/test_kernels_gpu.py -k sddmm > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -4 $OUT/tests.txt
timeout 110 python benchmarks/bench_kernels.py --sddmm-only --tokens 8192 --patterns 2:4 64:2:8 64:2:16 64:2:32 128:2:8 --no-train --csv $OUT/sddmm.csv > $OUT/bench.txt 2>&1; echo "bench rc=$?"; cat $OUT/bench.txt
HF_SPARSE_SDDMM_GATHER=regs timeout 50 python benchmarks/bench_kernels.py --sddmm-only --tokens 8192 --patterns 64:2:8 --no-train > $OUT/bench_regs.txt 2>&1; echo "bench regs rc=$?"; cat $OUT/bench_regs.txt
date -u >> $OUT/date.txt
