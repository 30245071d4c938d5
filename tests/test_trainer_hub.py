"""SparseTrainer.save_model writes a model card; SparseTrainer.push_to_hub uploads the compressed model in one commit."""

import json
from pathlib import Path

import pytest
import torch
from conftest import ToyClassification, random_ids, tiny_config
from helpers import logits, trainer_args
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, TrainingArguments

import hf_sparse
from hf_sparse import SparseTrainer, SparsityConfig
from hf_sparse.hub import model_card_kwargs_from_trainer, push_to_hub, write_model_card


def _trained(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        per_device_train_batch_size=8,
        report_to=[],
        use_cpu=True,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        disable_tqdm=True,
        hub_model_id="me/tiny-64-2-8",
    )
    config = SparsityConfig(score="magnitude", pattern="64:2:8", schedule="linear", start=0, end=3, update_every=1)
    trainer = SparseTrainer(
        model=model,
        args=args,
        train_dataset=ToyClassification(),
        eval_dataset=ToyClassification(16),
        sparsity_config=config,
    )
    trainer.train()
    return trainer


def test_save_model_writes_a_card(tmp_path):
    trainer = _trained(tmp_path)
    trainer.save_model(str(tmp_path / "out"))
    card = ModelCard((tmp_path / "out" / "README.md").read_text())
    assert "hf_sparse" in card.data.tags and "v:n:m" in card.data.tags
    assert "| Sparsity of the pruned layers | 75.00% |" in card.text and "import hf_sparse" in card.text


def test_push_to_hub_commits_compressed_model_and_card(tmp_path, monkeypatch):
    commits = []

    def create_repo(self, repo_id, **kwargs):
        return repo_id

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            src = op.path_or_fileobj
            files[op.path_in_repo] = src if isinstance(src, bytes) else Path(src).read_bytes()
        commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    trainer = _trained(tmp_path)
    assert trainer.push_to_hub(commit_message="sparse", dataset="toy") == "commit-info"
    (commit,) = commits
    assert commit["repo_id"] == "me/tiny-64-2-8" and commit["commit_message"] == "sparse"
    files = commit["files"]
    assert {"README.md", "config.json", "model.safetensors"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert "| Sparsity of the pruned layers | 75.00% |" in card.text and "eval_loss" in card.text
    folder = tmp_path / "pushed"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    pushed = load_file(folder / "model.safetensors")
    assert trainer._compressed_model_bytes() == sum(t.numel() * t.element_size() for t in pushed.values())
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert torch.equal(logits(loaded, random_ids()), logits(trainer.model, random_ids()))


# ------------------------------------------------------------------- a schedule that cannot finish inside the run
def _short_run(tmp_path, **schedule):
    """4 optimizer steps (0 to 3) under ``schedule``; returns the trainer and the schedule warnings of train()."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    config = SparsityConfig(score="magnitude", pattern="2:8", **schedule)
    args = trainer_args(tmp_path / "run", max_steps=4)
    trainer = SparseTrainer(model=model, args=args, train_dataset=ToyClassification(), sparsity_config=config)
    with pytest.warns(UserWarning, match="hf_sparse: the sparsity schedule") as record:
        trainer.train()
    return trainer, [str(w.message) for w in record if "the sparsity schedule" in str(w.message)]


def _pushed_files(model, pruner, monkeypatch) -> dict[str, bytes]:
    commits = []

    def create_commit(self, repo_id, operations, **kwargs):
        commits.append({op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations})

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: repo_id)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    push_to_hub(model, "me/never-pruned", pruner=pruner)
    (files,) = commits
    return files


def test_schedule_that_never_starts_warns_once_and_no_card_claims_sparsity(tmp_path, monkeypatch):
    """start/end beyond max_steps: one warning at train start, and a dense checkpoint whose cards (save_model's,
    the examples' write_model_card, push_to_hub's) all say that no layer is pruned."""
    trainer, warned = _short_run(tmp_path, schedule="cubic", start=500, end=600, update_every=10)
    assert len(warned) == 1
    assert "starts at step 500" in warned[0] and "reaches 2:8 at step 600" in warned[0]
    assert "no layer will be pruned and the saved model will be dense" in warned[0]
    assert "steps below 4" in warned[0] and "train for at least 601 steps" in warned[0]

    def assert_dense_card(text):
        card = ModelCard(text)
        assert "no layer of this checkpoint is pruned" in card.text and "pruned to" not in card.text
        assert "training ended before the sparsity schedule below pruned any layer" in card.text
        assert "| Pruned layers | 0 |" in card.text and "compressed format" not in card.text
        assert "sparsity" not in card.data.tags and "sparsity-2:8" not in card.data.tags

    out = tmp_path / "out"
    trainer.save_model(str(out))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert_dense_card((out / "README.md").read_text())
    # what the examples do after save_model
    write_model_card(out, **model_card_kwargs_from_trainer(trainer, task="text-classification"))
    assert_dense_card((out / "README.md").read_text())
    with pytest.warns(UserWarning, match="nothing pruned yet"):
        hf_sparse.save_pretrained(trainer.model, tmp_path / "direct", trainer.pruner)
    assert not (tmp_path / "direct" / "README.md").exists()  # save_pretrained writes no card at all
    with pytest.warns(UserWarning, match="nothing pruned yet"):  # push_to_hub saves through save_pretrained too
        files = _pushed_files(trainer.model, trainer.pruner, monkeypatch)
    assert "quantization_config" not in json.loads(files["config.json"])
    assert "no layer of this checkpoint is pruned" in files["README.md"].decode()
    assert "pruned to" not in files["README.md"].decode()


def test_schedule_that_ends_after_the_run_warns_and_the_card_gives_the_level_reached(tmp_path):
    # linear 0 -> 8 with updates every 2 steps: the last update of a 4-step run is step 2, at 7 of every 8 kept
    trainer, warned = _short_run(tmp_path, schedule="linear", start=0, end=8, update_every=2)
    assert len(warned) == 1 and "the masks stop at 7:8 and the saved model holds that, not 2:8" in warned[0]
    out = tmp_path / "out"
    trainer.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["patterns"] == ["7:8"]
    text = (out / "README.md").read_text()
    assert "pruned to **7:8**" in text and "**2:8**" not in text
    assert "ended before the sparsity schedule reached its final pattern, 2:8: the layers hold\n7:8" in text
    assert "| Sparsity of the pruned layers | 12.50% |" in text


def test_a_card_written_next_to_a_checkpoint_gives_that_checkpoint_s_pattern(tmp_path):
    """write_model_card on a folder holding a dense config.json: the card says dense, whatever ``pattern`` says."""
    AutoModelForSequenceClassification.from_config(tiny_config("bert")).save_pretrained(tmp_path)
    rows = {"bert.encoder.layer.0.output.dense": {"pattern": "2:4", "sparsity": 0.5, "shape": [64, 128]}}
    card = ModelCard(
        write_model_card(
            tmp_path,
            base_model=None,
            task=None,
            dataset=None,
            pattern="2:4",
            schedule={"pattern": "2:4"},
            layer_table=rows,
            dense_bytes=None,
            metrics=None,
        ).read_text()
    )
    assert "no layer of this checkpoint is pruned" in card.text and "pruned to" not in card.text
    assert "output.dense" not in card.text and "sparsity-2:4" not in card.data.tags
