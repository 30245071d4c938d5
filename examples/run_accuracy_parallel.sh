#!/usr/bin/env bash
# Sparse-vs-dense accuracy, all runs of a sweep at once on one GPU (MiniLM-sized models leave an H200 mostly idle,
# so concurrent runs cost little more wall time than one). Every run of a task has the same training budget.
#
# Usage: [TASKS='sst2 mrpc squad'] [PATTERNS='...'] [KD_PATTERNS='...'] [SCORES='magnitude obs']
#        examples/run_accuracy_parallel.sh MODEL_DIR DATA_DIR OUT_DIR [SEED]
#   DATA_DIR holds glue/SST-2, glue/MRPC and squad/{train-v1.1.reconstructed.json,dev-v1.1.json}.
#   GLUE_TRAIN_SAMPLES / EVAL_SAMPLES (all; small for a CPU smoke test, with EXTRA_ARGS='--use_cpu true'), EPOCHS_SST2 (2), EPOCHS_MRPC (5), EPOCHS_SQUAD (1), SQUAD_TRAIN_SAMPLES (all), LR_GLUE (5e-5), LR_SQUAD (1e-4),
#   START (0.05), END (0.5): cubic schedule from START to END of training, masks updated every 50 steps (10 on MRPC).
#   KD_PATTERNS: patterns also trained with distillation (alpha 0.5, T 2), once per score in SCORES, from a dense
#   teacher fine-tuned first on the same task (SST-2/SQuAD: one epoch; MRPC: the dense run of the sweep), or from
#   TEACHER_DIR (the distilled runs start once TEACHER_DIR/eval_results.json exists, e.g. another sweep's teacher).
# Prints a markdown table; every run's log and eval_results.json stay under OUT_DIR.
set -uo pipefail
model=${1:?model dir}; data=${2:?data dir}; out=${3:?out dir}; seed=${4:-42}
tasks=${TASKS:-"sst2 mrpc"}
patterns=${PATTERNS-"dense 2:4 64:2:8 64:2:16 unstructured:0.5 unstructured:0.75"}  # PATTERNS="" runs none
kd_patterns=${KD_PATTERNS:-""}
scores=${SCORES:-magnitude}
start=${START:-0.05}; end=${END:-0.5}
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

name() { echo "$1-${2//:/_}${3:+-$3}-$seed"; }  # task pattern [variant]

launch() {  # task pattern variant extra-args... ; runs in the background, logs to OUT/<name>.log
  local task=$1 pattern=$2 variant=$3; shift 3
  local dir="$out/$(name "$task" "$pattern" "$variant")" flags=()
  if [ "$pattern" != dense ]; then
    local every=50; [ "$task" = mrpc ] && every=10
    flags=(--sparsity_pattern "$pattern" --sparsity_schedule cubic --sparsity_start "$start" --sparsity_end "$end"
           --sparsity_update_every "$every")
  fi
  local evals=(); [ -n "${EVAL_SAMPLES:-}" ] && evals=(--max_eval_samples "$EVAL_SAMPLES")
  local common=("${evals[@]}" --do_train --do_eval --per_device_train_batch_size 32 --bf16 --eval_strategy no --save_strategy no
                --logging_steps 100 --report_to none --seed "$seed" --output_dir "$dir" --disable_tqdm true
                ${EXTRA_ARGS:-})
  case $task in
    sst2|mrpc)
      local sub=SST-2 epochs=${EPOCHS_SST2:-2}; [ "$task" = mrpc ] && sub=MRPC epochs=${EPOCHS_MRPC:-5}
      local limit=(); [ -n "${GLUE_TRAIN_SAMPLES:-}" ] && limit=(--max_train_samples "$GLUE_TRAIN_SAMPLES")
      python examples/run_glue.py --model_name_or_path "$model" --task_name "$task" --data_dir "$data/glue/$sub" \
        "${limit[@]}" --max_seq_length 128 --learning_rate "${LR_GLUE:-5e-5}" --num_train_epochs "$epochs" \
        "${common[@]}" "${flags[@]}" "$@" > "$dir.log" 2>&1 & ;;
    squad)
      local limit=(); [ -n "${SQUAD_TRAIN_SAMPLES:-}" ] && limit=(--max_train_samples "$SQUAD_TRAIN_SAMPLES")
      python examples/run_qa.py --model_name_or_path "$model" \
        --train_file "$data/squad/train-v1.1.reconstructed.json" --validation_file "$data/squad/dev-v1.1.json" \
        --max_seq_length 384 --doc_stride 128 --learning_rate "${LR_SQUAD:-1e-4}" \
        --num_train_epochs "${EPOCHS_SQUAD:-1}" --per_device_eval_batch_size 128 "${limit[@]}" \
        "${common[@]}" "${flags[@]}" "$@" > "$dir.log" 2>&1 & ;;
  esac
}

kd_after() {  # task teacher-dir [teacher-pid]: wait for the teacher, then launch the distilled runs
  local task=$1 teacher=$2 pid=${3:-}
  ( if [ -n "$pid" ]; then
      while kill -0 "$pid" 2>/dev/null; do sleep 5; done
    else  # a teacher trained by another sweep: wait for its results (up to 2 hours)
      for _ in $(seq 1440); do [ -f "$teacher/eval_results.json" ] && break; sleep 5; done
    fi
    [ -f "$teacher/eval_results.json" ] || { echo "teacher $teacher failed (see $teacher.log)"; exit 1; }
    for p in $kd_patterns; do
      for s in $scores; do
        variant=kd; [ "$s" != magnitude ] && variant=$s-kd
        launch "$task" "$p" "$variant" --sparsity_score "$s" \
          --distill_from "$teacher" --distill_alpha 0.5 --distill_temperature 2
      done
    done
    wait ) &
}

for task in $tasks; do
  dense_pid=""
  for p in $patterns; do
    if [ "$p" = dense ]; then launch "$task" dense ""; dense_pid=$!; continue; fi
    for s in $scores; do
      variant=""; [ "$s" != magnitude ] && variant=$s
      launch "$task" "$p" "$variant" --sparsity_score "$s"
    done
  done
  if [ -n "$kd_patterns" ]; then
    if [ -n "${TEACHER_DIR:-}" ]; then
      kd_after "$task" "$TEACHER_DIR"
    elif [ "$task" = mrpc ] && [ -n "$dense_pid" ]; then
      kd_after mrpc "$out/$(name mrpc dense "")" "$dense_pid"
    else
      EPOCHS_SST2=1 EPOCHS_SQUAD=1 EPOCHS_MRPC=${EPOCHS_MRPC:-5} launch "$task" dense teacher
      kd_after "$task" "$out/$(name "$task" dense teacher)" $!
    fi
  fi
done
wait

python - "$out" "$seed" <<'PY'
import json, pathlib, sys
out, seed = pathlib.Path(sys.argv[1]), sys.argv[2]
keys = {"sst2": ["eval_accuracy"], "mrpc": ["eval_accuracy", "eval_f1"], "squad": ["eval_exact_match", "eval_f1"]}
rows = {}
for f in sorted(out.glob(f"*-{seed}/eval_results.json")):
    task, rest = f.parent.name.split("-", 1)
    run = rest.rsplit("-", 1)[0]
    r = json.loads(f.read_text())
    scale = 1 if task == "squad" else 100  # SQuAD metrics are already in percent
    rows.setdefault(run, {})[task] = " / ".join(f"{scale * r[k]:.2f}" for k in keys[task] if k in r)
tasks = [t for t in keys if any(t in v for v in rows.values())]
print(f"| run (seed {seed}) | " + " | ".join(f"{t} ({', '.join(k[5:] for k in keys[t])})" for t in tasks) + " |")
print("| --- |" + " ---: |" * len(tasks))
for run, cells in rows.items():
    print(f"| {run} | " + " | ".join(cells.get(t, "—") for t in tasks) + " |")
PY
