"""``hf-sparse demo``: the whole product in two minutes on a laptop CPU.

Fine-tunes a small BERT classifier on the sentiment sample shipped in the package (``data/demo_sentiment.csv``),
prunes it gradually to a sparse pattern with :class:`~hf_sparse.SparseTrainer`, saves the compressed checkpoint,
reloads it with plain ``AutoModelForSequenceClassification.from_pretrained``, checks the reloaded logits against the
trained model's and prints a report. With no ``--model_name_or_path`` the encoder is a freshly initialised
4-layer BERT (no download); pass a local model folder to prune a real pretrained one instead.
"""

from __future__ import annotations

import csv
import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import TrainerCallback

__all__ = ["DemoReport", "check_demo_arguments", "checkpoint_fields", "run_demo"]

logger = logging.getLogger(__name__)


#: The demo trains dense for a third of its steps, ramps to the pattern in the second third and recovers in the last.
MIN_STEPS = 3


@dataclass
class DemoReport:
    """What ``hf-sparse demo`` measured. Sizes in bytes: ``checkpoint_bytes`` is the saved ``model.safetensors``
    (every tensor), ``checkpoint_dense_bytes`` what it would be with the pruned layers dense; ``pruned_bytes`` and
    ``pruned_dense_bytes`` count the pruned layers' weights alone."""

    pattern: str
    accuracy_before_pruning: float
    accuracy_sparse: float
    accuracy_reloaded: float
    sparsity: float
    checkpoint_bytes: int
    checkpoint_dense_bytes: int
    pruned_bytes: int
    pruned_dense_bytes: int
    max_logit_diff: float
    seconds: float
    output_dir: str

    def to_text(self) -> str:
        def sizes(sparse: int, dense: int) -> str:
            return f"{sparse / 1e6:.2f} MB, dense: {dense / 1e6:.2f} MB ({sparse / max(1, dense):.1%})"

        return "\n".join(
            [
                f"hf_sparse demo — pattern {self.pattern}",
                f"  eval accuracy, dense (before pruning):  {self.accuracy_before_pruning:.3f}",
                f"  eval accuracy, sparse (after training): {self.accuracy_sparse:.3f}",
                f"  eval accuracy, reloaded checkpoint:     {self.accuracy_reloaded:.3f}",
                f"  sparsity of pruned layers:              {self.sparsity:.3f}",
                f"  checkpoint file (model.safetensors):    {sizes(self.checkpoint_bytes, self.checkpoint_dense_bytes)}",
                f"  pruned layers' weights in it:           {sizes(self.pruned_bytes, self.pruned_dense_bytes)}",
                f"  max |logit difference| after reload:    {self.max_logit_diff:.3g}",
                f"  saved to {self.output_dir} in {self.seconds:.0f} s",
            ]
        )


def check_demo_arguments(pattern: str, max_steps: int) -> None:
    """Raise a ValueError saying what is wrong with the demo's arguments, before anything is created."""
    from .config import SparsityConfig

    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < MIN_STEPS:
        raise ValueError(
            f"--max_steps {max_steps}: the demo trains dense for a third of its steps, prunes in the second third "
            f"and recovers in the last, so it needs at least {MIN_STEPS} steps (default 240)"
        )
    try:
        SparsityConfig(pattern=pattern)
    except ValueError as err:
        raise ValueError(f"--pattern {pattern!r}: {err}") from None


def checkpoint_fields(folder: str | Path) -> dict[str, float | int]:
    """The sparsity and size fields of :class:`DemoReport` for the checkpoint saved in ``folder``."""
    from .inspect import inspect_checkpoint

    summary = inspect_checkpoint(folder)
    return {
        "sparsity": summary["pruned_sparsity"],
        "checkpoint_bytes": summary["file_bytes"],
        "checkpoint_dense_bytes": summary["file_dense_bytes"],
        "pruned_bytes": summary["pruned_bytes"],
        "pruned_dense_bytes": summary["pruned_dense_bytes"],
    }


def _load_rows() -> list[tuple[str, int]]:
    text = resources.files("hf_sparse").joinpath("data/demo_sentiment.csv").read_text()
    return [(row["sentence"], int(row["label"])) for row in csv.DictReader(text.splitlines())]


def _word_tokenizer(sentences: list[str], folder: Path):
    """A word-level fast tokenizer over the demo vocabulary (no download), saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])}
    for sentence in sentences:
        for word in sentence.split():
            vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


class _Encoded(torch.utils.data.Dataset):
    def __init__(self, tokenizer, rows: list[tuple[str, int]], max_length: int = 24) -> None:
        enc = tokenizer([s for s, _ in rows], padding="max_length", truncation=True, max_length=max_length)
        self.items = [
            {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(att), "labels": label}
            for ids, att, (_, label) in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _accuracy(model, dataset: _Encoded) -> tuple[float, torch.Tensor]:
    model.eval()
    batch = {k: torch.stack([item[k] for item in dataset.items]) for k in ("input_ids", "attention_mask")}
    labels = torch.tensor([item["labels"] for item in dataset.items])
    with torch.no_grad():
        logits = model(**batch).logits
    return float((logits.argmax(-1) == labels).float().mean()), logits


class _DenseProbe(TrainerCallback):
    """Measures the dense model once, right before the first mask update (runs before the pruner's callback)."""

    def __init__(self, evaluation: _Encoded) -> None:
        self.evaluation = evaluation
        self.start_step = 0
        self.accuracy: float | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.accuracy is None and state.global_step >= self.start_step:
            self.accuracy = _accuracy(model, self.evaluation)[0]
            model.train()


def run_demo(
    output_dir: str | None = None,
    pattern: str = "64:2:8",
    max_steps: int = 240,
    model_name_or_path: str | None = None,
    seed: int = 0,
) -> DemoReport:
    """Train, prune, save, reload and check; returns the report (also printed by the CLI)."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        TrainingArguments,
        set_seed,
    )

    from . import SparseTrainer, SparsityConfig

    check_demo_arguments(pattern, max_steps)
    started = time.time()
    set_seed(seed)
    output_dir = output_dir or tempfile.mkdtemp(prefix="hf_sparse_demo_")
    out = Path(output_dir)
    rows = _load_rows()
    random.Random(seed).shuffle(rows)
    train_rows, eval_rows = rows[:1000], rows[1000:]
    if model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(model_name_or_path, num_labels=2)
    else:
        tokenizer = _word_tokenizer([s for s, _ in rows], out / "tokenizer")
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=64,
            num_labels=2,
        )
        model = BertForSequenceClassification(config)
    train, evaluation = _Encoded(tokenizer, train_rows), _Encoded(tokenizer, eval_rows)
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=32,
        learning_rate=1e-3 if not model_name_or_path else 5e-5,
        warmup_steps=max_steps // 10,
        weight_decay=0.01,
        logging_steps=max(1, max_steps // 8),
        save_strategy="no",
        report_to=[],
        seed=seed,
        use_cpu=True,
        disable_tqdm=False,
    )
    # Dense for the first third, cubic ramp to the pattern by two thirds, then recover at the final pattern.
    sparsity = SparsityConfig(pattern=pattern, schedule="cubic", start=1 / 3, end=2 / 3, update_every=10)
    probe = _DenseProbe(evaluation)
    trainer = SparseTrainer(model=model, args=args, train_dataset=train, sparsity_config=sparsity, callbacks=[probe])
    probe.start_step = trainer.pruner.bind(max_steps).start_step
    trainer.train()
    sparse_acc, logits = _accuracy(model, evaluation)

    checkpoint = out / "model"
    trainer.save_model(str(checkpoint))
    tokenizer.save_pretrained(checkpoint)
    reloaded = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    reloaded_acc, reloaded_logits = _accuracy(reloaded, evaluation)
    max_diff = float((reloaded_logits - logits).abs().max())
    if max_diff != 0.0:
        raise RuntimeError(f"reloaded logits differ from the trained model's by {max_diff}: please report this")

    report = DemoReport(
        pattern=pattern,
        accuracy_before_pruning=probe.accuracy if probe.accuracy is not None else float("nan"),
        accuracy_sparse=sparse_acc,
        accuracy_reloaded=reloaded_acc,
        **checkpoint_fields(checkpoint),
        max_logit_diff=max_diff,
        seconds=time.time() - started,
        output_dir=str(checkpoint),
    )
    (out / "demo_report.json").write_text(json.dumps(report.__dict__, indent=2))
    return report
