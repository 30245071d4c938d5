#!/usr/bin/env bash
# Sparse-vs-dense accuracy on GLUE with the same training budget for every pattern; prints a markdown table.
# Usage: [TASKS='sst2 mrpc'] [PATTERNS='dense 2:4 ...'] examples/run_accuracy_sweep.sh MODEL_DIR GLUE_DIR OUT_DIR [SEED] [EPOCHS_SST2] [EPOCHS_MRPC]
#   MODEL_DIR: e.g. the MiniLM folder from ../shared/tools/get_minilm.sh; GLUE_DIR holds SST-2/ and MRPC/.
# Every run: fp32 master weights with bf16 autocast, max_seq_length 128, batch 32, lr 5e-5, cubic schedule from 10% to 60% of training,
# masks updated every 50 steps (10 for MRPC), a dense run with the same budget as the baseline.
set -euo pipefail
model=${1:?model dir}; glue=${2:?glue dir}; out=${3:?out dir}; seed=${4:-42}; ep_sst2=${5:-1}; ep_mrpc=${6:-5}
mkdir -p "$out"
run() {  # task epochs update_every pattern data_subdir
  local task=$1 epochs=$2 every=$3 pattern=$4 datadir=$5 dir="$out/$1-${4//:/_}-$seed" flags=()
  [ "$pattern" != dense ] && flags=(--sparsity_pattern "$pattern" --sparsity_schedule cubic --sparsity_start 0.1
                                    --sparsity_end 0.6 --sparsity_update_every "$every")
  python examples/run_glue.py --model_name_or_path "$model" --task_name "$task" --data_dir "$glue/$datadir" \
    --do_train --do_eval --max_seq_length 128 --per_device_train_batch_size 32 --learning_rate 5e-5 \
    --num_train_epochs "$epochs" --bf16 --eval_strategy no --logging_steps 100 --save_strategy no --report_to none \
    --seed "$seed" --output_dir "$dir" --disable_tqdm true "${flags[@]}" > "$dir.log" 2>&1 \
    || { echo "FAILED: $task $pattern (see $dir.log)"; tail -20 "$dir.log"; }
}
patterns=${PATTERNS:-"dense 2:4 64:2:8 64:2:16 unstructured:0.5 unstructured:0.75"}
tasks=${TASKS:-"sst2 mrpc"}
case " $tasks " in *" sst2 "*) for p in $patterns; do run sst2 "$ep_sst2" 50 "$p" SST-2; done ;; esac
case " $tasks " in *" mrpc "*) for p in $patterns; do run mrpc "$ep_mrpc" 10 "$p" MRPC; done ;; esac
python - "$out" "$seed" <<'PY'
import json, sys, pathlib
out, seed = pathlib.Path(sys.argv[1]), sys.argv[2]
print(f"| pattern | SST-2 acc | MRPC acc | MRPC F1 |  (seed {seed})\n| --- | ---: | ---: | ---: |")
for p in ["dense", "2:4", "64:2:8", "64:2:16", "unstructured:0.5", "unstructured:0.75"]:
    cells = []
    for task, keys in [("sst2", ["eval_accuracy"]), ("mrpc", ["eval_accuracy", "eval_f1"])]:
        f = out / f"{task}-{p.replace(':', '_')}-{seed}" / "eval_results.json"
        r = json.loads(f.read_text()) if f.is_file() else {}
        cells += [f"{100 * r[k]:.2f}" if k in r else "—" for k in keys]
    print(f"| {p} | " + " | ".join(cells) + " |")
PY
