#!/usr/bin/env bash
# One lease, several commits: gpu_session.sh's BASE A/B for more than two trees, so that one build step and one
# machine start serve every branch under test. Each tree is a directory under .carry/trees holding one commit's
# hf_sparse/, csrc/, tests/ and pyproject.toml, made here before the call and carried with it (carry: .carry/trees):
#
#   mkdir -p .carry/trees/NAME && git archive REV hf_sparse csrc tests pyproject.toml | tar -x -C .carry/trees/NAME
#
#   TREES="base a b" PHASES="build tests sweeps" TESTS_a="tests/ops/test_kernels_gpu.py -k 'vnm'" \
#     SWEEP_a="--patterns 64:2:8 --tokens 1 16" RUNS="base a a a" bash benchmarks/ab_trees.sh
#
# build: every tree's product kernels at once, each into .carry/build-NAME (a warm machine keeps them, so a second call
# with the same trees rebuilds nothing). tests: each tree's GPU tests TESTS_NAME (pytest arguments, parsed as a shell
# command line), all trees at once, run in the tree. sweeps: RUNS is a list of (tree, sweep) pairs run in order: tree's
# package and kernels timing `sweep_split_k.py --product-only --cold $SWEEP_<sweep>`, its rows appended to
# $OUT/ab_<sweep>_<tree>.jsonl; alternate base and branch runs ("base a a a base b b b") so that drift hits both. The
# time left is divided evenly among the runs still to come. ENV_<sweep>: environment assignments (NAME=VALUE ...) for
# that sweep's runs, e.g. a branch's experiment switch. LIMIT: seconds the whole call may take (default 575).
set -u
cd "$(dirname "$0")/.."
root=$PWD
. benchmarks/pytest_summary.sh
out=$(mkdir -p "${OUT:-ab_trees_out}" && cd "${OUT:-ab_trees_out}" && pwd) || exit 2
export PYTHONUNBUFFERED=1 HF_SPARSE_CUDA_ARCH_LIST=${HF_SPARSE_CUDA_ARCH_LIST:-9.0} PYTHONFAULTHANDLER=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)
left() { echo $((${LIMIT:-575} - ($(date +%s) - start))); }
# Runs its arguments in tree $1 with that tree's package and kernels.
in_tree() {
  local tree=$1
  shift
  (cd "$root/.carry/trees/$tree" && PYTHONPATH=$PWD HF_SPARSE_BUILD_DIR=$root/.carry/build-$tree "$@")
}
# A run killed while it loads the extension leaves torch's build lock behind; runs are sequential, so none is held.
clear_locks() { rm -f "$root"/.carry/build-*/*/lock; }
log=$out/session.log
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee -a "$log"
phases=" ${PHASES:-build tests sweeps} "
if [[ $phases == *" build "* ]]; then
  s=$(date +%s)
  for tree in ${TREES:?name the trees}; do
    (MAX_JOBS=8 in_tree "$tree" python -m hf_sparse.ops.build 2>&1 | tail -2 | sed "s/^/[$tree] /") &
  done
  wait
  echo "build: $(($(date +%s) - s)) s" | tee -a "$log"
fi
if [[ $phases == *" tests "* ]]; then
  s=$(date +%s)
  for tree in $TREES; do
    var=TESTS_$tree
    [ -n "${!var:-}" ] || continue
    (in_tree "$tree" timeout -s ABRT -k 5 $(($(left) / 2)) bash -c \
      "python -m pytest -q -m gpu ${!var} -p no:cacheprovider -rfE" >"$out/tests_$tree.log" 2>&1
      summarize_tests "$out/tests_$tree.log" | sed "s/^/[$tree] /" | tee -a "$log") &
  done
  wait
  clear_locks
  echo "tests: $(($(date +%s) - s)) s" | tee -a "$log"
fi
if [[ $phases == *" sweeps "* ]]; then
  set -- ${RUNS:-}
  while [ $# -ge 2 ]; do
    tree=$1 sweep=$2
    shift 2
    budget=$(($(left) / ($# / 2 + 1)))
    if [ "$budget" -lt 15 ]; then  # a run killed part-way still leaves the rows it finished
      echo "skipped ($(left) s left): $sweep on $tree" | tee -a "$log"
      continue
    fi
    var=SWEEP_$sweep evar=ENV_$sweep
    echo "== $sweep on $tree ($budget s, $(date -u +%H:%M:%S)) ${!evar:-}" | tee -a "$log"
    in_tree "$tree" env ${!evar:-} timeout -s ABRT -k 5 "$budget" python "$root/benchmarks/sweep_split_k.py" --product-only --cold \
      ${!var} --json "$out/ab_${sweep}_$tree.jsonl" >"$out/sweep_${sweep}_$tree.log" 2>&1
    echo "rc $?, $(wc -l <"$out/ab_${sweep}_$tree.jsonl" 2>/dev/null || echo 0) rows" | tee -a "$log"
    clear_locks
  done
fi
date -u | tee -a "$log"
