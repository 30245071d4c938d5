#!/usr/bin/env python
"""How far one-shot pruning, before any fine-tuning, moves a pretrained encoder's outputs, per pattern and score.

For each pattern and score, a fresh copy of the pretrained model is pruned in one shot with ``hf_sparse.oneshot``
(calibration: ``--num_calibration_samples`` sentences drawn from ``--calibration_file``), and the relative error of
the last hidden state on held-out text is printed::

    ||h_sparse - h_dense||_F / ||h_dense||_F      over every non-padding token of --eval_file

Run on CPU in a few minutes for all-MiniLM-L6-v2 (``/work/shared/tools/get_minilm.sh /work/minilm``)::

    python benchmarks/oneshot_error.py --model_name_or_path /work/minilm \\
        --calibration_file glue/SST-2/train.tsv --eval_file glue/SST-2/dev.tsv
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
import time
import warnings

import torch


def _hidden_states(model, batches) -> list[torch.Tensor]:
    """Last hidden state of every non-padding token, one ``(tokens, hidden)`` tensor per batch."""
    out = []
    with torch.no_grad():
        for batch in batches:
            hidden = model(**batch).last_hidden_state
            out.append(hidden[batch["attention_mask"].bool()].float())
    return out


def relative_error(sparse: list[torch.Tensor], dense: list[torch.Tensor]) -> float:
    num = sum(float((s - d).square().sum()) for s, d in zip(sparse, dense, strict=True))
    den = sum(float(d.square().sum()) for d in dense)
    return (num / den) ** 0.5


def main(argv: list[str] | None = None) -> list[dict]:
    from transformers import AutoModel, AutoTokenizer

    import hf_sparse
    from hf_sparse import SparsityConfig
    from hf_sparse.calibration_data import calibration_batches, read_texts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--calibration_file", required=True, help=".tsv/.csv/.json/.jsonl with the calibration text")
    parser.add_argument("--eval_file", required=True, help="held-out text, same formats")
    parser.add_argument("--text_column", default=None)
    parser.add_argument("--num_calibration_samples", type=int, default=128)
    parser.add_argument("--num_eval_samples", type=int, default=512)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--patterns", nargs="+", default=["2:4", "64:2:8"])
    parser.add_argument("--scores", nargs="+", default=["magnitude", "wanda", "sparsegpt"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    dense_model = AutoModel.from_pretrained(args.model_name_or_path, dtype="float32").eval()
    batch_args = dict(max_seq_length=args.max_seq_length, batch_size=args.batch_size, seed=args.seed)
    calibration = calibration_batches(
        read_texts(args.calibration_file, args.text_column),
        tokenizer,
        num_samples=args.num_calibration_samples,
        **batch_args,
    )
    held_out = calibration_batches(
        read_texts(args.eval_file, args.text_column), tokenizer, num_samples=args.num_eval_samples, **batch_args
    )
    tokens = sum(int(b["attention_mask"].sum()) for b in held_out)
    print(
        f"model {args.model_name_or_path}; calibration {sum(len(b['input_ids']) for b in calibration)} sequences of "
        f"{args.calibration_file}; held out {sum(len(b['input_ids']) for b in held_out)} sequences ({tokens} tokens) "
        f"of {args.eval_file}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    dense = _hidden_states(dense_model, held_out)
    rows = []
    print(f"{'pattern':<10} {'score':<10} {'rel. error':>10} {'prune s':>8}")
    for pattern in args.patterns:
        for score in args.scores:
            model = copy.deepcopy(dense_model)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf_sparse.oneshot(model, SparsityConfig(pattern=pattern, score=score), calibration, progress=False)
            seconds = time.perf_counter() - start
            error = relative_error(_hidden_states(model, held_out), dense)
            rows.append({"pattern": pattern, "score": score, "relative_error": error, "prune_seconds": seconds})
            print(f"{pattern:<10} {score:<10} {error:>10.4f} {seconds:>8.1f}", flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
