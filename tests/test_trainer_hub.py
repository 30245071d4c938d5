"""SparseTrainer.save_model writes a model card; SparseTrainer.push_to_hub uploads the compressed model in one commit."""

from pathlib import Path

import torch
from conftest import ToyClassification, random_ids, tiny_config
from helpers import logits
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, TrainingArguments

from hf_sparse import SparseTrainer, SparsityConfig


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
    config = SparsityConfig(pattern="64:2:8", schedule="linear", start=0, end=3, update_every=1)
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
