#!/usr/bin/env python
"""Fine-tune (and optionally prune) an extractive question-answering model on SQuAD v1.1 / v2.0-style data.

Arguments, preprocessing (sliding windows of ``max_seq_length`` tokens over long contexts, ``doc_stride`` apart)
and post-processing (``n_best_size`` start/end candidates, spans of at most ``max_answer_length`` tokens, the
null answer against ``null_score_diff_threshold`` for v2) are those of the Transformers ``run_qa.py`` example, plus
the sparsity flags of ``sparse_args.py``. Files are local: the original nested SQuAD JSON (``.json``, or
``.json.xz``/``.json.gz``), flat JSON/JSON Lines in the Hub ``squad`` layout, or CSV with ``answers`` as JSON.
Metrics are computed locally with the official SQuAD normalisation.

    python examples/run_qa.py --model_name_or_path bert-base-uncased \
        --train_file squad/train-v1.1.json --validation_file squad/dev-v1.1.json \
        --do_train --do_eval --output_dir out/squad-2of4 --sparsity_pattern 2:4
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sparse_args.py and utils_qa.py next to this script

from sparse_args import (  # noqa: E402
    distillation_kwargs,
    end_process_group,
    parse_args_and_setup,
    per_batch_mean_loss,
    trainer_class,
    write_card,
)
from utils_qa import load_squad_file, postprocess_qa_predictions  # noqa: E402

logger = logging.getLogger(__name__)

_SUFFIXES = (".json", ".jsonl", ".csv", ".json.xz", ".json.gz", ".jsonl.xz", ".jsonl.gz")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Local path (or cached Hub id) of the pretrained model."})
    config_name: str | None = field(default=None, metadata={"help": "Config path if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer path if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache models."})
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


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "Training data (SQuAD JSON, JSONL or CSV)."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data, same formats."})
    test_file: str | None = field(default=None, metadata={"help": "Data to predict on, same formats."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenized datasets."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    max_seq_length: int = field(default=384, metadata={"help": "Tokens per window (question + context part)."})
    pad_to_max_length: bool = field(
        default=True, metadata={"help": "Pad to max_seq_length; if False, pad each batch dynamically."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction examples."})
    version_2_with_negative: bool = field(default=False, metadata={"help": "Some questions have no answer (v2)."})
    null_score_diff_threshold: float = field(
        default=0.0, metadata={"help": "v2: answer empty when null score - best span score > this."}
    )
    doc_stride: int = field(default=128, metadata={"help": "Overlap, in tokens, between windows of a long context."})
    n_best_size: int = field(default=20, metadata={"help": "Start/end candidates considered per window."})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens."})

    def __post_init__(self):
        if not (self.train_file or self.validation_file or self.test_file):
            raise ValueError("no data: give --train_file, --validation_file and/or --test_file")
        for f in (self.train_file, self.validation_file, self.test_file):
            if f is not None and not f.lower().endswith(_SUFFIXES):
                raise ValueError(f"{f}: expected one of {', '.join(_SUFFIXES)}")


def load_qa_split(path: str, cache_dir: str | None = None):
    """A ``datasets.Dataset`` with the Hub ``squad`` columns: id, title, context, question, answers."""
    from datasets import Dataset, Features, List, Value, load_dataset

    features = Features(
        {
            "id": Value("string"),
            "title": Value("string"),
            "context": Value("string"),
            "question": Value("string"),
            "answers": {"text": List(Value("string")), "answer_start": List(Value("int32"))},
        }
    )
    if path.lower().endswith(".csv"):
        ds = load_dataset("csv", data_files=path, split="train", cache_dir=cache_dir)
        if "answers" in ds.column_names and ds.features["answers"].dtype == "string":
            ds = ds.map(lambda b: {"answers": [json.loads(a) for a in b["answers"]]}, batched=True)
        records = ds.to_list()
    else:
        records = load_squad_file(path)
    missing = {"id", "context", "question"} - set(records[0] if records else {})
    if missing:
        raise ValueError(
            f"{path}: records lack {sorted(missing)}; expected SQuAD fields id, question, context, answers"
        )
    empty = {"text": [], "answer_start": []}
    rows = [
        {
            "id": str(r["id"]),
            "title": r.get("title") or "",
            "context": r["context"],
            "question": r["question"],
            "answers": r.get("answers") or empty,
        }
        for r in records
    ]
    return Dataset.from_list(rows, features=features)


class QuestionAnsweringMixin:
    """Adds SQuAD post-processing and metrics to ``Trainer.evaluate`` / ``predict`` (mix in before the Trainer).

    The model sees windows (features); scores are about questions (examples). ``evaluation_loop`` therefore runs
    with metrics off, turns the windows' logits into one answer per question, and scores those, so evaluation
    during training (``--eval_strategy steps``) logs exact match and F1 like the final evaluation does.
    """

    def __init__(self, *args, eval_examples=None, eval_features=None, post_process_function=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_examples = eval_examples
        self.eval_features = eval_features
        self.post_process_function = post_process_function
        self._qa_current = None
        self.last_answers: dict[str, str] | None = None

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", *, eval_examples=None, eval_features=None
    ):
        self._qa_current = (eval_examples or self.eval_examples, eval_features or self.eval_features)
        try:
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self._qa_current = None

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="predict", *, examples=None, features=None):
        self._qa_current = (examples, features)
        try:
            return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self._qa_current = None

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        from transformers.trainer_utils import EvalLoopOutput

        examples, features = self._qa_current or (None, None)
        if examples is None or self.post_process_function is None:
            return super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        compute_metrics, self.compute_metrics = self.compute_metrics, None
        try:
            output = super().evaluation_loop(dataloader, description, False, ignore_keys, metric_key_prefix)
        finally:
            self.compute_metrics = compute_metrics
        metrics = dict(output.metrics)
        # every rank post-processes (predictions are gathered), so all ranks log the same metrics
        answers = self.post_process_function(examples, features, output.predictions, metric_key_prefix)
        self.last_answers = answers
        if compute_metrics is not None and any(len(a["text"]) for a in examples["answers"]):
            for key, value in compute_metrics(answers, examples).items():
                metrics[f"{metric_key_prefix}_{key}"] = value
        return EvalLoopOutput(output.predictions, output.label_ids, metrics, output.num_samples)


def _tokenize_windows(batch, tokenizer, args: DataTrainingArguments, padding, max_seq_length):
    """Question + context in overlapping windows of ``max_seq_length`` tokens, ``doc_stride`` apart.

    Returns ``(encoding, window -> example index, the sequence id of context tokens)``.
    """
    pad_on_right = tokenizer.padding_side == "right"
    questions = [q.lstrip() for q in batch["question"]]  # leading spaces waste window budget
    enc = tokenizer(
        questions if pad_on_right else batch["context"],
        batch["context"] if pad_on_right else questions,
        truncation="only_second" if pad_on_right else "only_first",
        max_length=max_seq_length,
        stride=args.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=padding,
    )
    return enc, enc.pop("overflow_to_sample_mapping"), 1 if pad_on_right else 0


def prepare_train_features(batch, tokenizer, args: DataTrainingArguments, padding, max_seq_length):
    """Tokenize question + context into overlapping windows and label each with the answer's token span.

    A window that does not contain the whole answer (or an unanswerable question) points at the CLS token,
    which is how these models learn "no answer in this window".
    """
    enc, sample_map, context_seq = _tokenize_windows(batch, tokenizer, args, padding, max_seq_length)
    offsets_all = enc.pop("offset_mapping")
    enc["start_positions"], enc["end_positions"] = [], []
    for i, offsets in enumerate(offsets_all):
        ids = enc["input_ids"][i]
        cls = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
        answers = batch["answers"][sample_map[i]]
        seq = enc.sequence_ids(i)
        ctx = [t for t, s in enumerate(seq) if s == context_seq]
        start = end = cls
        if answers["answer_start"] and ctx:
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            if offsets[ctx[0]][0] <= start_char and offsets[ctx[-1]][1] >= end_char:
                start = max(t for t in ctx if offsets[t][0] <= start_char)
                end = min(t for t in ctx if offsets[t][1] >= end_char)
        enc["start_positions"].append(start)
        enc["end_positions"].append(end)
    return enc


def prepare_validation_features(batch, tokenizer, args: DataTrainingArguments, padding, max_seq_length):
    """Windows as for training, plus the example id of each and offsets kept only for context tokens."""
    enc, sample_map, context_seq = _tokenize_windows(batch, tokenizer, args, padding, max_seq_length)
    enc["example_id"] = []
    for i in range(len(enc["input_ids"])):
        seq = enc.sequence_ids(i)
        enc["example_id"].append(batch["id"][sample_map[i]])
        enc["offset_mapping"][i] = [
            o if seq[k] == context_seq else None for k, o in enumerate(enc["offset_mapping"][i])
        ]
    return enc


def main(argv: list[str] | None = None) -> dict[str, float]:
    from transformers import (
        AutoConfig,
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        DataCollatorWithPadding,
        default_data_collator,
    )

    from hf_sparse.hub import dense_weight_bytes
    from hf_sparse.metrics import squad_metrics, squad_v2_metrics

    model_args, data_args, training_args, sparsity_config, distill_args = parse_args_and_setup(
        ModelArguments, DataTrainingArguments, argv, logger
    )
    sparse = sparsity_config is not None

    for split, need, path in (
        ("train", training_args.do_train, data_args.train_file),
        ("validation", training_args.do_eval, data_args.validation_file),
        ("test", training_args.do_predict, data_args.test_file),
    ):
        if need and not path:
            raise ValueError(f"--do_{'predict' if split == 'test' else split[:5]} needs --{split}_file")

    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        use_fast=True,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("run_qa.py needs a fast tokenizer (offset mappings map answers back to characters)")
    model = AutoModelForQuestionAnswering.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        dtype=model_args.dtype,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    per_batch_mean_loss(model)
    dense_bytes = dense_weight_bytes(model)

    if data_args.max_seq_length > tokenizer.model_max_length:
        logger.warning(
            "max_seq_length %d > the model's %d: using the latter",
            data_args.max_seq_length,
            tokenizer.model_max_length,
        )
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    if data_args.doc_stride >= max_seq_length:
        raise ValueError(f"--doc_stride {data_args.doc_stride} must be smaller than --max_seq_length {max_seq_length}")
    padding = "max_length" if data_args.pad_to_max_length else False
    fn_kwargs = {"tokenizer": tokenizer, "args": data_args, "padding": padding, "max_seq_length": max_seq_length}

    def featurize(path, limit, prepare, desc):
        examples = load_qa_split(path, model_args.cache_dir)
        if limit is not None:
            examples = examples.select(range(min(limit, len(examples))))
        with training_args.main_process_first(desc=desc):
            feats = examples.map(
                prepare,
                batched=True,
                remove_columns=examples.column_names,
                fn_kwargs=fn_kwargs,
                num_proc=data_args.preprocessing_num_workers,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=desc,
            )
        return examples, feats

    train_features = eval_examples = eval_features = predict_examples = predict_features = None
    if training_args.do_train:
        _, train_features = featurize(
            data_args.train_file, data_args.max_train_samples, prepare_train_features, "train windows"
        )
    if training_args.do_eval:
        eval_examples, eval_features = featurize(
            data_args.validation_file, data_args.max_eval_samples, prepare_validation_features, "eval windows"
        )
    if training_args.do_predict:
        predict_examples, predict_features = featurize(
            data_args.test_file, data_args.max_predict_samples, prepare_validation_features, "predict windows"
        )

    def for_model(features):
        return None if features is None else features.remove_columns(["example_id", "offset_mapping"])

    def post_process(examples, features, predictions, stage="eval"):
        return postprocess_qa_predictions(
            examples,
            features,
            predictions,
            version_2_with_negative=data_args.version_2_with_negative,
            n_best_size=data_args.n_best_size,
            max_answer_length=data_args.max_answer_length,
            null_score_diff_threshold=data_args.null_score_diff_threshold,
            output_dir=training_args.output_dir if training_args.should_save else None,
            prefix=stage,
        )

    def compute_metrics(answers, examples):
        references = {e["id"]: e["answers"] for e in examples}
        return (
            squad_v2_metrics(answers, references)
            if data_args.version_2_with_negative
            else squad_metrics(answers, references)
        )

    if data_args.pad_to_max_length:
        collator = default_data_collator
    else:
        collator = DataCollatorWithPadding(
            tokenizer, pad_to_multiple_of=8 if training_args.fp16 or training_args.bf16 else None
        )

    base = trainer_class(sparse)
    qa_trainer_cls = type(f"QuestionAnswering{base.__name__}", (QuestionAnsweringMixin, base), {})
    trainer_kwargs = {"sparsity_config": sparsity_config} if sparse else {}
    trainer_kwargs.update(distillation_kwargs(distill_args, AutoModelForQuestionAnswering, model_args.dtype, sparse))
    trainer = qa_trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_features,
        eval_dataset=for_model(eval_features),
        eval_examples=eval_examples,
        eval_features=eval_features,
        processing_class=tokenizer,
        data_collator=collator,
        post_process_function=post_process,
        compute_metrics=compute_metrics,
        **trainer_kwargs,
    )

    all_metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = dict(result.metrics)
        metrics["train_samples"] = len(train_features)
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        all_metrics.update(metrics)

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_features)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        all_metrics.update(metrics)
        if training_args.should_save and trainer.last_answers is not None:
            with open(Path(training_args.output_dir) / "predictions.json", "w", encoding="utf-8") as f:
                json.dump(trainer.last_answers, f, indent=2, ensure_ascii=False)  # the official evaluator's input

    if training_args.do_predict:
        logger.info("*** Predict ***")
        output = trainer.predict(for_model(predict_features), examples=predict_examples, features=predict_features)
        metrics = dict(output.metrics)
        metrics["predict_samples"] = len(predict_features)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)

    if trainer.is_world_process_zero() and (training_args.do_train or training_args.do_eval):
        with open(Path(training_args.output_dir) / "all_results.json", "w", encoding="utf-8") as f:
            json.dump(all_metrics, f, indent=4, sort_keys=True)

    dataset_name = "SQuAD v2" if data_args.version_2_with_negative else "SQuAD v1.1"
    dataset_id = "rajpurkar/squad_v2" if data_args.version_2_with_negative else "rajpurkar/squad"
    if training_args.do_train:
        write_card(
            trainer,
            training_args.output_dir,
            sparse=sparse,
            dense_bytes=dense_bytes,
            base_model=model_args.model_name_or_path,
            task="question-answering",
            dataset=dataset_name,
            dataset_id=dataset_id,
            model_name=Path(training_args.output_dir).name,
            metrics={k: v for k, v in all_metrics.items() if k.startswith("eval_")} or None,
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(
            finetuned_from=model_args.model_name_or_path,
            tasks="question-answering",
            dataset_tags="squad",
            dataset=dataset_name,
        )
    return all_metrics


if __name__ == "__main__":
    try:
        main()
    finally:
        end_process_group()
