#!/usr/bin/env bash
# ncu profiles of the 2:4 sparse-wgmma SpMM and dense cuBLAS at two shapes (8192 tokens), text reports into $1.
#   [NODENSE=1] bash benchmarks/profile_spmm.sh OUTDIR [CONFIG ...]   (default configs: 4 10; NODENSE: no cuBLAS)
# One launch each (the 4th call: the first three warm up), clocks as the GPU runs them (--clock-control none).
# The configurations are the lab build's (csrc/lab.h): the script builds and runs the lab extension.
set -u
export HF_SPARSE_BUILD_LAB=1
out=${1:?outdir}; shift
configs=${*:-4 10}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; "$NCU" --version
"$NCU" --query-metrics --chip gh100 > "$out/ncu_metrics.txt" 2>&1
tm=$(grep -oE '^sm__(pipe_tensor|inst_executed_pipe_tensor)[a-z_]*' "$out/ncu_metrics.txt" | sort -u)
mets=""
for m in $tm; do
  case $m in *cycles_active*) mets="$mets,$m.avg.pct_of_peak_sustained_active";; *) mets="$mets,$m.sum";; esac
done
mets="${mets#,}"
echo "tensor metrics: $mets"
secs="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
--section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
--section LaunchStats --section InstructionStats"
prof() {  # name, kernel regex, profile_spmm.py args
  local name=$1 regex=$2; shift 2
  "$NCU" --clock-control none -k "regex:$regex" --launch-skip 3 --launch-count 1 $secs \
    ${mets:+--metrics $mets} --print-details all \
    python3 benchmarks/profile_spmm.py "$@" > "$out/ncu_$name.txt" 2>&1
  local rc=$?
  if [ $rc -ne 0 ] && [ -n "$mets" ]; then  # an unknown metric name fails the whole run: retry without them
    echo "retrying $name without --metrics"; mets=""
    "$NCU" --clock-control none -k "regex:$regex" --launch-skip 3 --launch-count 1 $secs --print-details all \
      python3 benchmarks/profile_spmm.py "$@" > "$out/ncu_$name.txt" 2>&1
    rc=$?
  fi
  echo "== $name rc=$rc"; grep -E "Duration|Compute \(SM\) Throughput|L2 Cache Throughput|Achieved Occupancy|pipe_tensor" "$out/ncu_$name.txt" | head -12
}
for shape in "1024 4096" "4096 11008"; do
  set -- $shape
  for c in $configs; do prof "k$1_r$2_cfg$c" spmm_sm90 --k $1 --r $2 --config $c; done
  [ -n "${NODENSE:-}" ] || prof "k$1_r$2_dense" 'nvjet|gemm|xmma|cutlass' --k $1 --r $2 --mode dense
done
