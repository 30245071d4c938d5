#!/bin/bash
# device run helper (not committed): build, smoke, tests, bench; everything into $OUT
cd "$(dirname "$0")"
export PYTHONPATH=$PWD HF_SPARSE_CUDA_ARCH_LIST=9.0
date -u > $OUT/date.txt; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $OUT/date.txt
timeout 200 python -m hf_sparse.ops.build > $OUT/build.txt 2>&1; echo "build rc=$?"; tail -3 $OUT/build.txt
timeout 60 python - > $OUT/smoke.txt 2>&1 <<'PY'
import os, torch
from hf_sparse.ops import pack, sddmm, scatter_dense
from tests.ops._helpers import random_masked
for m, v in [(8, 64), (4, 64), (16, 64), (8, 128)]:
    for kern in ("mma", "wgmma"):
        os.environ["HF_SPARSE_SDDMM_KERNEL"] = kern
        w, mask = random_masked(256, 64 * m * 2, v, m, device="cuda", seed=1)
        p = pack(w, mask, v, m, torch.bfloat16)
        x = torch.randn(300, w.shape[1], device="cuda").bfloat16(); dy = torch.randn(300, 256, device="cuda").bfloat16()
        got = scatter_dense(sddmm(dy, x, p), p, torch.float32); torch.cuda.synchronize()
        ref = torch.where(mask, dy.float().t() @ x.float(), 0.0)
        print(m, v, kern, float((got - ref).norm() / ref.norm()), flush=True)
PY
echo "smoke rc=$?"; cat $OUT/smoke.txt | tail -12
timeout ${TEST_T:-120} python -m pytest -q -m gpu tests/ops/test_kernels_gpu.py -k sddmm -x > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -5 $OUT/tests.txt
timeout ${BENCH_T:-200} python benchmarks/bench_kernels.py --sddmm-only --tokens 8192 --patterns 2:4 64:2:8 64:2:16 64:2:32 128:2:8 --no-train --csv $OUT/sddmm.csv > $OUT/bench.txt 2>&1; echo "bench rc=$?"; cat $OUT/bench.txt
date -u >> $OUT/date.txt
cat > /tmp/prof.py <<'PY'
import os, torch
os.environ["HF_SPARSE_SDDMM_KERNEL"] = "wgmma"
from hf_sparse.masks import vnm_mask
from hf_sparse.ops import pack, sddmm
w = torch.randn(11008, 4096, device="cuda"); mask = vnm_mask(w.abs(), 64, 2, 8)
p = pack(torch.where(mask, w, 0.0), mask, 64, 8, torch.bfloat16)
x = torch.randn(8192, 4096, device="cuda").bfloat16(); dy = torch.randn(8192, 11008, device="cuda").bfloat16()
for _ in range(3): sddmm(dy, x, p)
torch.cuda.synchronize()
PY
timeout ${PROF_T:-90} ncu --clock-control none -k regex:sddmm_sm90 --launch-count 1 --launch-skip 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis python /tmp/prof.py > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"; grep -E "Throughput|Busy|Pipe|Stall|Duration|Issued|Bandwidth|Hit" $OUT/ncu.txt | head -40
