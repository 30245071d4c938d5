#!/usr/bin/env bash
# One lease of a GPU machine, used in full: build the extension, run the GPU tests, then each STAGE (a shell command)
# while time is left, printing what it skips. Everything it prints also goes to $OUT (or ./gpu_session_out).
#
#   LIMIT=570 bash benchmarks/gpu_session.sh "TESTS" "STAGE" ["STAGE" ...]
#
# TESTS: the pytest arguments of the GPU tests, as a shell command line ("" for none; "tests/" for the whole suite;
# quote a -k expression inside it: "tests/ops -k 'split and not vnm'"). LIMIT: seconds the whole call may take
# (default 570, under the device's 600 s a command). Each stage is killed 10 s before the limit, so the files under
# $OUT still come back; it is killed with SIGABRT, on which Python (PYTHONFAULTHANDLER) prints every thread's stack, so
# a run that hung says where. The build goes to .carry/build (HF_SPARSE_BUILD_DIR), which a warm machine keeps
# between calls. Example:
#
#   bash benchmarks/gpu_session.sh "tests/" \
#     "python benchmarks/bench_trainer.py --models bert-large --compile eager --worker-timeout 150"
#
# TESTS_LAST=1 runs the stages first and the GPU tests after them, in the time the stages leave: for short stages
# (a sweep) that must not lose their time to a long suite.
#
# Against another commit in the same lease (timings compare only within one lease): BASE names a tree holding that
# commit's hf_sparse/ and csrc/, made on the machine with git before the call and carried with it,
#
#   git archive REV hf_sparse csrc | tar -x -C .carry/base      # (mkdir -p .carry/base first)
#   BASE=.carry/base ROUNDS=2 bash benchmarks/gpu_session.sh "TESTS" "STAGE" ...
#
# Both trees' kernels are built at once (BASE's into $HF_SPARSE_BUILD_DIR-base); the GPU tests run on this tree; each
# stage runs ROUNDS times on each tree, alternating base / this, headed "== STAGE [base|this] round i" in bench.log.
# A run has the time left divided among the runs still to come, less 10 s (without BASE a stage has all of it).
set -u
cd "$(dirname "$0")/.."
. benchmarks/pytest_summary.sh
out=${OUT:-gpu_session_out}
mkdir -p "$out"
root=$PWD
export PYTHONPATH=$root PYTHONUNBUFFERED=1 HF_SPARSE_BUILD_DIR=${HF_SPARSE_BUILD_DIR:-$root/.carry/build}
export HF_SPARSE_CUDA_ARCH_LIST=${HF_SPARSE_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONFAULTHANDLER=1
base=${BASE:-}
if [ -n "$base" ]; then
  base=$(cd "$base" && pwd) || exit 2
  [ -d "$base/hf_sparse" ] && [ -d "$base/csrc" ] || { echo "BASE=$base holds no hf_sparse/ and csrc/" >&2; exit 2; }
fi
base_build=$HF_SPARSE_BUILD_DIR-base
start=$(date +%s)
left() { echo $((${LIMIT:-570} - ($(date +%s) - start))); }
# Runs its arguments with the base tree's package and kernels in place of this checkout's.
on_base() { PYTHONPATH=$base HF_SPARSE_BUILD_DIR=$base_build "$@"; }
# Removes torch's build locks under $HF_SPARSE_BUILD_DIR. A run killed while it loads the extension leaves its lock
# behind, and every later load of that tree then waits on it for ever; runs are sequential, so once one has ended no
# load holds a lock.
clear_locks() { rm -f "$HF_SPARSE_BUILD_DIR"/*/lock; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  s=$(date +%s)
  if [ -n "$base" ]; then
    (on_base python -m hf_sparse.ops.build 2>&1 | tail -3 | sed 's/^/[base] /') &
  fi
  python -m hf_sparse.ops.build 2>&1 | tail -3
  wait
  echo "build: $(($(date +%s) - s)) s"
} 2>&1 | tee "$out/session.log"

tests=${1:-}
shift || true
run_tests() {
  [ -n "$tests" ] || return 0
  local s
  s=$(date +%s)
  # TESTS is parsed as a shell command line, so a quoted -k expression stays one argument
  # --durations: the slowest tests, in gputests.log, are what to trim where the suite outgrows a call
  timeout -s ABRT -k 5 $(($(left) - 10)) \
    bash -c "python -m pytest -q -m gpu $tests -p no:cacheprovider -rfE --durations=15" 2>&1 |
    tee "$out/gputests.log" | tail -25
  summarize_tests "$out/gputests.log" | tee -a "$out/session.log"
  clear_locks
  echo "GPU tests: $(($(date +%s) - s)) s" | tee -a "$out/session.log"
}
[ "${TESTS_LAST:-0}" = 1 ] || run_tests
runs=()  # (stage, tree, round) in the order they run
rounds=${ROUNDS:-2}
for stage in "$@"; do
  if [ -n "$base" ]; then
    for ((i = 1; i <= rounds; i++)); do runs+=("$stage" base "$i" "$stage" this "$i"); done
  else
    runs+=("$stage" this 1)
  fi
done
n=$((${#runs[@]} / 3))
for ((j = 0; j < n; j++)); do
  stage=${runs[3 * j]} tree=${runs[3 * j + 1]} round=${runs[3 * j + 2]}
  budget=$(left) head="$stage" least=40
  if [ -n "$base" ]; then
    budget=$((budget / (n - j))) head="$stage [$tree] round $round" least=30
  fi
  if [ "$budget" -lt "$least" ]; then
    echo "skipped ($(left) s left for $((n - j)) runs): $head" | tee -a "$out/session.log"
    continue
  fi
  echo "== $head ($(left) s left, this run ${budget} s, $(date -u +%H:%M:%S))" | tee -a "$out/session.log" "$out/bench.log"
  on=()  # this checkout: as exported above
  [ "$tree" = base ] && on=(on_base)
  "${on[@]}" timeout -s ABRT -k 5 $((budget - 10)) bash -c "$stage" 2>&1 | tee -a "$out/bench.log" | grep -v '^\s*$' | tail -30
  "${on[@]}" clear_locks
done
[ "${TESTS_LAST:-0}" = 1 ] && run_tests
date -u | tee -a "$out/session.log"
