#!/usr/bin/env bash
# One lease of a GPU machine, used in full: build the extension, run the GPU tests, then each STAGE (a shell command)
# while time is left, printing what it skips. Everything it prints also goes to $OUT (or ./gpu_session_out).
#
#   LIMIT=570 bash benchmarks/gpu_session.sh "TESTS" "STAGE" ["STAGE" ...]
#
# TESTS: the pytest arguments of the GPU tests, as a shell command line ("" for none; "tests/" for the whole suite;
# quote a -k expression inside it: "tests/ops -k 'split and not vnm'"). LIMIT: seconds the whole call may take
# (default 570, under the device's 600 s a command). Each stage is killed 10 s before the limit, so the files under
# $OUT still come back. The build goes to .carry/build (HF_SPARSE_BUILD_DIR), which a warm machine keeps
# between calls. Example:
#
#   bash benchmarks/gpu_session.sh "tests/" \
#     "python benchmarks/bench_trainer.py --models bert-large --compile eager --worker-timeout 150"
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_session_out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_SPARSE_BUILD_DIR=${HF_SPARSE_BUILD_DIR:-$PWD/.carry/build}
export HF_SPARSE_CUDA_ARCH_LIST=${HF_SPARSE_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)
left() { echo $((${LIMIT:-570} - ($(date +%s) - start))); }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  s=$(date +%s)
  python -m hf_sparse.ops.build 2>&1 | tail -3
  echo "build: $(($(date +%s) - s)) s"
} 2>&1 | tee "$out/session.log"

tests=${1:-}
shift || true
if [ -n "$tests" ]; then
  s=$(date +%s)
  # TESTS is parsed as a shell command line, so a quoted -k expression stays one argument
  timeout $(($(left) - 10)) bash -c "python -m pytest -q -m gpu $tests -p no:cacheprovider -rfE" 2>&1 |
    tee "$out/gputests.log" | tail -25
  echo "GPU tests: $(($(date +%s) - s)) s" | tee -a "$out/session.log"
fi
for stage in "$@"; do
  budget=$(left)
  if [ "$budget" -lt 40 ]; then
    echo "skipped (${budget} s left): $stage" | tee -a "$out/session.log"
    continue
  fi
  echo "== $stage ($budget s left, $(date -u +%H:%M:%S))" | tee -a "$out/session.log"
  timeout $((budget - 10)) bash -c "$stage" 2>&1 | tee -a "$out/bench.log" | grep -v '^\s*$' | tail -30
done
date -u | tee -a "$out/session.log"
