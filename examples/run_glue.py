#!/usr/bin/env python
"""Fine-tune (and optionally prune) a sequence classifier on a GLUE task or on your own CSV/JSON data.

The arguments and outputs are those of the Transformers ``run_glue.py`` example, plus the sparsity flags of
``sparse_args.py``; everything is read from local files and the metrics are computed locally, so it runs where the
Hugging Face Hub is out of reach. GLUE TSV files are read as downloaded (CoLA without a header row, MRPC with its
byte-order mark, no quoting anywhere) and renamed to the columns of the Hub ``glue`` dataset.

    python examples/run_glue.py --model_name_or_path bert-base-uncased --task_name mrpc \
        --data_dir glue/MRPC --do_train --do_eval --output_dir out/mrpc-2of4 --sparsity_pattern 2:4
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sparse_args.py next to this script

from sparse_args import (  # noqa: E402
    distillation_kwargs,
    end_process_group,
    parse_args_and_setup,
    per_batch_mean_loss,
    trainer_class,
    write_card,
)

logger = logging.getLogger(__name__)

#: task -> (text columns of the Hub glue dataset, label names in id order; None = regression)
GLUE_TASKS: dict[str, tuple[tuple[str, ...], list[str] | None]] = {
    "cola": (("sentence",), ["unacceptable", "acceptable"]),
    "sst2": (("sentence",), ["negative", "positive"]),
    "mrpc": (("sentence1", "sentence2"), ["not_equivalent", "equivalent"]),
    "qqp": (("question1", "question2"), ["not_duplicate", "duplicate"]),
    "stsb": (("sentence1", "sentence2"), None),
    "mnli": (("premise", "hypothesis"), ["entailment", "neutral", "contradiction"]),
    "qnli": (("question", "sentence"), ["entailment", "not_entailment"]),
    "rte": (("sentence1", "sentence2"), ["entailment", "not_entailment"]),
    "wnli": (("sentence1", "sentence2"), ["not_entailment", "entailment"]),
}
#: task -> (TSV text columns, TSV label column) as in the GLUE downloads
GLUE_TSV_COLUMNS: dict[str, tuple[tuple[str, ...], str]] = {
    "cola": (("sentence",), "label"),
    "sst2": (("sentence",), "label"),
    "mrpc": (("#1 String", "#2 String"), "Quality"),
    "qqp": (("question1", "question2"), "is_duplicate"),
    "stsb": (("sentence1", "sentence2"), "score"),
    "mnli": (("sentence1", "sentence2"), "gold_label"),
    "qnli": (("question", "sentence"), "label"),
    "rte": (("sentence1", "sentence2"), "label"),
    "wnli": (("sentence1", "sentence2"), "label"),
}
#: CoLA's train/dev files have no header row.
COLA_COLUMNS = ["source", "label", "original_label", "sentence"]
#: task -> (train, dev, extra dev, test) file names in a GLUE task folder
GLUE_FILES = {"mnli": ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv", "test_matched.tsv")}


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Local path (or cached Hub id) of the pretrained model."})
    config_name: str | None = field(default=None, metadata={"help": "Config path if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer path if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache models."})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers-backed) tokenizer."})
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit)."})
    token: str | None = field(default=None, metadata={"help": "Hub token, for private models and push_to_hub."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in: float32 (default) keeps fp32 master weights, as mixed precision "
            "(--bf16/--fp16) expects; 'auto' takes the checkpoint's dtype (bf16 checkpoints then train in pure bf16, "
            "where small AdamW updates round away)",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Load a checkpoint whose classifier has a different number of labels."}
    )


@dataclass
class DataTrainingArguments:
    task_name: str | None = field(default=None, metadata={"help": "GLUE task: " + ", ".join(GLUE_TASKS)})
    data_dir: str | None = field(
        default=None, metadata={"help": "A GLUE task folder as downloaded (train.tsv, dev.tsv, test.tsv)."}
    )
    train_file: str | None = field(default=None, metadata={"help": "Training data: GLUE .tsv, .csv or .json(l)."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data (same formats)."})
    validation_mismatched_file: str | None = field(
        default=None, metadata={"help": "MNLI mismatched dev set (found next to dev_matched.tsv by default)."}
    )
    test_file: str | None = field(default=None, metadata={"help": "Data to predict on (labels not needed)."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated, shorter padded."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenized datasets."})
    pad_to_max_length: bool = field(
        default=True, metadata={"help": "Pad to max_seq_length; if False, pad each batch dynamically."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set(s)."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction set."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})

    def __post_init__(self):
        if self.task_name is not None:
            self.task_name = self.task_name.lower().replace("-", "")
            if self.task_name not in GLUE_TASKS:
                raise ValueError(f"unknown --task_name {self.task_name!r}; choose one of {', '.join(GLUE_TASKS)}")
        if self.data_dir is not None:
            if self.task_name is None:
                raise ValueError("--data_dir needs --task_name (it says how to read the GLUE files)")
            train, dev, dev_mm, test = GLUE_FILES.get(self.task_name, ("train.tsv", "dev.tsv", None, "test.tsv"))
            for attr, name in (
                ("train_file", train),
                ("validation_file", dev),
                ("validation_mismatched_file", dev_mm),
                ("test_file", test),
            ):
                if getattr(self, attr) is None and name and os.path.isfile(os.path.join(self.data_dir, name)):
                    setattr(self, attr, os.path.join(self.data_dir, name))
        if self.task_name == "mnli" and self.validation_file and self.validation_mismatched_file is None:
            sibling = Path(self.validation_file).with_name("dev_mismatched.tsv")
            if Path(self.validation_file).name == "dev_matched.tsv" and sibling.is_file():
                self.validation_mismatched_file = str(sibling)
        if not (self.train_file or self.validation_file or self.test_file):
            raise ValueError(
                "no data: give --data_dir with --task_name, or --train_file/--validation_file/--test_file"
            )
        for f in (self.train_file, self.validation_file, self.validation_mismatched_file, self.test_file):
            if f is not None and Path(f).suffix.lower() not in {".tsv", ".csv", ".json", ".jsonl"}:
                raise ValueError(f"{f}: expected a .tsv, .csv, .json or .jsonl file")


def load_glue_tsv(path: str, task: str, cache_dir: str | None = None):
    """A GLUE ``.tsv`` as downloaded, renamed to the Hub ``glue`` columns, with integer (or float) labels."""
    from datasets import Features, Value, load_dataset

    with open(path, encoding="utf-8-sig") as f:
        first = next(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), [])
    text_cols, label_col = GLUE_TSV_COLUMNS[task]
    has_header = not (task == "cola" and len(first) == len(COLA_COLUMNS) and first[0] != "index")
    columns = first if has_header else COLA_COLUMNS
    missing = [c for c in text_cols if c not in columns]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing for task {task} (found {columns}); is it the right task?")
    ds = load_dataset(
        "csv",
        data_files=path,
        split="train",
        delimiter="\t",
        quoting=csv.QUOTE_NONE,
        encoding="utf-8-sig",
        header=0 if has_header else None,
        column_names=None if has_header else COLA_COLUMNS,
        keep_default_na=False,
        na_filter=False,
        on_bad_lines="warn",  # a few QQP rows carry extra tabs: skip them loudly, as the GLUE readers do
        features=Features({c: Value("string") for c in columns}),
        cache_dir=cache_dir,
    )
    _, label_names = GLUE_TASKS[task]
    rename = dict(zip(text_cols, GLUE_TASKS[task][0], strict=True))

    def convert(batch, indices):
        out = {new: batch[old] for old, new in rename.items()}
        out["idx"] = list(indices)
        if label_col in batch:
            raw = batch[label_col]
            if label_names is None:
                out["label"] = [float(v) for v in raw]
            else:
                lookup = {name: i for i, name in enumerate(label_names)} | {str(i): i for i in range(len(label_names))}
                bad = sorted({v for v in raw if v not in lookup})
                if bad:
                    raise ValueError(f"{path}: labels {bad[:5]} are not {task} labels ({label_names} or their ids)")
                out["label"] = [lookup[v] for v in raw]
        return out

    return ds.map(
        convert, batched=True, with_indices=True, remove_columns=ds.column_names, desc=f"reading {Path(path).name}"
    )


def load_split(path: str, task: str | None, cache_dir: str | None):
    from datasets import load_dataset

    suffix = Path(path).suffix.lower()
    if suffix == ".tsv":
        if task is None:
            return load_dataset("csv", data_files=path, split="train", delimiter="\t", cache_dir=cache_dir)
        return load_glue_tsv(path, task, cache_dir)
    builder = "csv" if suffix == ".csv" else "json"
    return load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir)


def _labels_as_ids(ds, label_names: list[str]):
    """CSV/JSON labels may be names (``"entailment"``) or ids; make them ids."""
    if "label" not in ds.column_names or ds.features["label"].dtype != "string":
        return ds
    lookup = {name: i for i, name in enumerate(label_names)} | {str(i): i for i in range(len(label_names))}
    return ds.map(lambda b: {"label": [lookup[v] for v in b["label"]]}, batched=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        EvalPrediction,
        default_data_collator,
    )

    from hf_sparse.hub import dense_weight_bytes
    from hf_sparse.metrics import accuracy, glue_metrics, pearson, spearman

    model_args, data_args, training_args, sparsity_config, distill_args = parse_args_and_setup(
        ModelArguments, DataTrainingArguments, argv, logger
    )
    sparse = sparsity_config is not None

    task = data_args.task_name
    files = {
        "train": data_args.train_file,
        "validation": data_args.validation_file,
        "validation_mismatched": data_args.validation_mismatched_file,
        "test": data_args.test_file,
    }
    raw = {split: load_split(path, task, model_args.cache_dir) for split, path in files.items() if path}
    reference = raw.get("train") or raw.get("validation") or raw["test"]

    if task is not None:
        text_keys, label_list = GLUE_TASKS[task]
        is_regression = label_list is None
        raw = {s: _labels_as_ids(d, label_list) if label_list else d for s, d in raw.items()}
    else:
        is_regression = "label" in reference.column_names and reference.features["label"].dtype in {
            "float32",
            "float64",
        }
        label_list = None
        if not is_regression:
            if "label" not in reference.column_names:
                raise ValueError("without --task_name the data needs a 'label' column")
            label_list = sorted({v for d in raw.values() if "label" in d.column_names for v in d.unique("label")})
        non_label = [c for c in reference.column_names if c not in {"label", "idx", "id"}]
        text_keys = (
            ("sentence1", "sentence2") if {"sentence1", "sentence2"} <= set(non_label) else tuple(non_label[:2])
        )
    num_labels = 1 if is_regression else len(label_list)

    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        num_labels=num_labels,
        finetuning_task=task,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        use_fast=model_args.use_fast_tokenizer,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    if not is_regression:
        config.label2id = {str(name): i for i, name in enumerate(label_list)}
        config.id2label = {i: str(name) for i, name in enumerate(label_list)}
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        dtype=model_args.dtype,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    per_batch_mean_loss(model)
    dense_bytes = dense_weight_bytes(model)
    label_to_id = None
    if task is None and not is_regression:
        label_to_id = {v: i for i, v in enumerate(label_list)}

    if data_args.max_seq_length > tokenizer.model_max_length:
        logger.warning(
            "max_seq_length %d > the model's %d: using the latter",
            data_args.max_seq_length,
            tokenizer.model_max_length,
        )
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(batch):
        texts = [batch[k] for k in text_keys]
        result = tokenizer(*texts, padding=padding, max_length=max_seq_length, truncation=True)
        if label_to_id is not None and "label" in batch:
            result["label"] = [label_to_id[v] if v != -1 else -1 for v in batch["label"]]
        return result

    limits = {
        "train": data_args.max_train_samples,
        "validation": data_args.max_eval_samples,
        "validation_mismatched": data_args.max_eval_samples,
        "test": data_args.max_predict_samples,
    }
    processed = {}
    with training_args.main_process_first(desc="dataset map pre-processing"):
        for split, ds in raw.items():
            if limits[split] is not None:
                ds = ds.select(range(min(limits[split], len(ds))))
            processed[split] = ds.map(
                preprocess,
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=f"tokenizing {split}",
            )
    for split, need in (
        ("train", training_args.do_train),
        ("validation", training_args.do_eval),
        ("test", training_args.do_predict),
    ):
        if need and split not in processed:
            raise ValueError(f"--do_{'predict' if split == 'test' else split[:5]} needs a {split} file")

    metric_task = task or ("stsb" if is_regression else None)

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        if metric_task is not None:
            result = glue_metrics(metric_task, preds, p.label_ids)
        elif is_regression:
            result = {"pearson": pearson(preds, p.label_ids), "spearmanr": spearman(preds, p.label_ids)}
        else:
            result = {"accuracy": accuracy(preds, p.label_ids)}
        if len(result) > 1:
            result["combined_score"] = float(np.mean(list(result.values())))
        return result

    if data_args.pad_to_max_length:
        collator = default_data_collator
    else:
        collator = DataCollatorWithPadding(
            tokenizer, pad_to_multiple_of=8 if training_args.fp16 or training_args.bf16 else None
        )

    trainer_kwargs = {"sparsity_config": sparsity_config} if sparse else {}
    trainer_kwargs.update(
        distillation_kwargs(distill_args, AutoModelForSequenceClassification, model_args.dtype, sparse)
    )
    trainer = trainer_class(sparse)(
        model=model,
        args=training_args,
        train_dataset=processed.get("train") if training_args.do_train else None,
        eval_dataset=processed.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        data_collator=collator,
        **trainer_kwargs,
    )

    all_metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = dict(result.metrics)
        metrics["train_samples"] = len(processed["train"])
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        all_metrics.update(metrics)

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(eval_dataset=processed["validation"])
        metrics["eval_samples"] = len(processed["validation"])
        if "validation_mismatched" in processed:
            mm = trainer.evaluate(eval_dataset=processed["validation_mismatched"])
            mm["eval_samples"] = len(processed["validation_mismatched"])
            metrics.update({f"{k}_mm": v for k, v in mm.items()})
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        all_metrics.update(metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        test = processed["test"].remove_columns([c for c in ("label",) if c in processed["test"].column_names])
        predictions = trainer.predict(test, metric_key_prefix="predict").predictions
        predictions = np.squeeze(predictions) if is_regression else np.argmax(predictions, axis=1)
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / f"predict_results_{task or 'custom'}.txt"
            with open(path, "w", encoding="utf-8") as writer:
                writer.write("index\tprediction\n")
                for i, item in enumerate(np.atleast_1d(predictions)):
                    writer.write(f"{i}\t{item:.3f}\n" if is_regression else f"{i}\t{label_list[int(item)]}\n")
            logger.info("predictions written to %s", path)

    if trainer.is_world_process_zero() and (training_args.do_train or training_args.do_eval):
        with open(Path(training_args.output_dir) / "all_results.json", "w", encoding="utf-8") as f:
            json.dump(all_metrics, f, indent=4, sort_keys=True)

    card = {
        "base_model": model_args.model_name_or_path,
        "task": "text-classification",
        "dataset": f"GLUE {task.upper()}" if task else None,
        "dataset_id": "nyu-mll/glue" if task else None,
    }
    if training_args.do_train:
        write_card(
            trainer,
            training_args.output_dir,
            sparse=sparse,
            dense_bytes=dense_bytes,
            metrics={k: v for k, v in all_metrics.items() if k.startswith("eval_")} or None,
            **card,
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(
            finetuned_from=model_args.model_name_or_path,
            tasks="text-classification",
            dataset_tags="glue" if task else None,
            dataset=card["dataset"],
        )
    return all_metrics


if __name__ == "__main__":
    try:
        main()
    finally:
        end_process_group()
