#!/usr/bin/env bash
# Sparse-vs-dense accuracy on GLUE (and SQuAD v1.1) with the same training budget for every pattern and score;
# prints a markdown table.
# Usage: [TASKS='sst2 mrpc squad'] [PATTERNS='dense 2:4 ...'] [SCORES='magnitude obs'] [SQUAD_DIR=DIR]
#        [SQUAD_TRAIN_SAMPLES=N] examples/run_accuracy_sweep.sh MODEL_DIR GLUE_DIR OUT_DIR [SEED] [EPOCHS_SST2] [EPOCHS_MRPC]
#   MODEL_DIR: e.g. the MiniLM folder from ../shared/tools/get_minilm.sh; GLUE_DIR holds SST-2/ and MRPC/;
#   SQUAD_DIR (default GLUE_DIR/../squad) holds dev-v1.1.json and train-v1.1.reconstructed.json(.xz).
# Every run: fp32 master weights with bf16 autocast, batch 32, cubic schedule from 10% to 60% of training, masks
# updated every 50 steps (10 for MRPC); GLUE max_seq_length 128, lr 5e-5; SQuAD max_seq_length 384, stride 128,
# lr 1e-4, one epoch on the first SQUAD_TRAIN_SAMPLES questions (default 32000). A dense run with the same budget
# is the baseline; each sparse pattern runs once per score in SCORES (default magnitude). Output folders:
# OUT_DIR/<task>-<pattern>-<score>-<seed> (':' written '_'), OUT_DIR/<task>-dense-<seed> for the baseline.
set -euo pipefail
model=${1:?model dir}; glue=${2:?glue dir}; out=${3:?out dir}; seed=${4:-42}; ep_sst2=${5:-1}; ep_mrpc=${6:-5}
squad=${SQUAD_DIR:-$glue/../squad}; squad_n=${SQUAD_TRAIN_SAMPLES:-32000}
mkdir -p "$out"
sparse_flags() {  # pattern score update_every
  flags=()
  [ "$1" = dense ] && return
  flags=(--sparsity_pattern "$1" --sparsity_score "$2" --sparsity_schedule cubic --sparsity_start 0.1
         --sparsity_end 0.6 --sparsity_update_every "$3")
}
dir_of() {  # task pattern score
  if [ "$2" = dense ]; then echo "$out/$1-dense-$seed"; else echo "$out/$1-${2//:/_}-$3-$seed"; fi
}
run() {  # task epochs update_every pattern data_subdir score
  local task=$1 epochs=$2 every=$3 pattern=$4 datadir=$5 score=$6 dir
  dir=$(dir_of "$task" "$pattern" "$score"); sparse_flags "$pattern" "$score" "$every"
  python examples/run_glue.py --model_name_or_path "$model" --task_name "$task" --data_dir "$glue/$datadir" \
    --do_train --do_eval --max_seq_length 128 --per_device_train_batch_size 32 --learning_rate 5e-5 \
    --num_train_epochs "$epochs" --bf16 --eval_strategy no --logging_steps 100 --save_strategy no --report_to none \
    --seed "$seed" --output_dir "$dir" --disable_tqdm true "${flags[@]}" > "$dir.log" 2>&1 \
    || { echo "FAILED: $task $pattern $score (see $dir.log)"; tail -20 "$dir.log"; }
}
run_squad() {  # pattern score
  local dir train="$squad/train-v1.1.reconstructed.json"
  [ -f "$train" ] || train="$train.xz"
  dir=$(dir_of squad "$1" "$2"); sparse_flags "$1" "$2" 50
  python examples/run_qa.py --model_name_or_path "$model" --train_file "$train" \
    --validation_file "$squad/dev-v1.1.json" --max_train_samples "$squad_n" --preprocessing_num_workers 8 \
    --do_train --do_eval --max_seq_length 384 --doc_stride 128 --per_device_train_batch_size 32 --learning_rate 1e-4 \
    --num_train_epochs 1 --bf16 --eval_strategy no --logging_steps 100 --save_strategy no --report_to none \
    --seed "$seed" --output_dir "$dir" --disable_tqdm true "${flags[@]}" > "$dir.log" 2>&1 \
    || { echo "FAILED: squad $1 $2 (see $dir.log)"; tail -20 "$dir.log"; }
}
patterns=${PATTERNS:-"dense 2:4 64:2:8 64:2:16 unstructured:0.5 unstructured:0.75"}
scores=${SCORES:-magnitude}
tasks=${TASKS:-"sst2 mrpc"}
each() {  # command...: run once for dense, once per score for every sparse pattern
  for p in $patterns; do
    if [ "$p" = dense ]; then "$@" "$p" magnitude; else for s in $scores; do "$@" "$p" "$s"; done; fi
  done
}
glue_run() { run "$1" "$2" "$3" "$5" "$4" "$6"; }  # task epochs every subdir pattern score
case " $tasks " in *" sst2 "*) each glue_run sst2 "$ep_sst2" 50 SST-2 ;; esac
case " $tasks " in *" mrpc "*) each glue_run mrpc "$ep_mrpc" 10 MRPC ;; esac
case " $tasks " in *" squad "*) each run_squad ;; esac
python - "$out" "$seed" "$patterns" "$scores" <<'PY'
import json, sys, pathlib
out, seed, patterns, scores = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
columns = [("sst2", "eval_accuracy", "SST-2 acc"), ("mrpc", "eval_accuracy", "MRPC acc"), ("mrpc", "eval_f1", "MRPC F1"),
           ("squad", "eval_exact_match", "SQuAD EM"), ("squad", "eval_f1", "SQuAD F1")]
print("| pattern | score | " + " | ".join(c[2] for c in columns) + f" |  (seed {seed})")
print("| --- | --- |" + " ---: |" * len(columns))
for p in patterns:
    for s in (["—"] if p == "dense" else scores):
        cells = []
        for task, key, _ in columns:
            name = f"{task}-dense-{seed}" if p == "dense" else f"{task}-{p.replace(':', '_')}-{s}-{seed}"
            f = out / name / "eval_results.json"
            r = json.loads(f.read_text()) if f.is_file() else {}
            scale = 1 if task == "squad" else 100  # SQuAD metrics are already in percent
            cells.append(f"{scale * r[key]:.2f}" if key in r else "—")
        print(f"| {p} | {s} | " + " | ".join(cells) + " |")
PY
