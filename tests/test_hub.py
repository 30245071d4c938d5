"""Model card rendering and ``push_to_hub`` with the network cut at ``HfApi.create_repo`` / ``create_commit``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from _tiny_models import build_tiny_bert
from huggingface_hub import HfApi, ModelCard

import hf_sparse
from hf_sparse.hub import (
    HubUnreachableError,
    dense_weight_bytes,
    directory_weight_bytes,
    history_from_log_history,
    push_to_hub,
    render_model_card,
    save_training_plot,
    write_model_card,
)

LAYERS = {
    "bert.encoder.layer.0.attention.self.query": {"pattern": "2:4", "sparsity": 0.5, "shape": [64, 64]},
    "bert.encoder.layer.0.intermediate.dense": {"pattern": "2:4", "sparsity": 0.5, "shape": [128, 64]},
}
LOG_HISTORY = [
    {"loss": 1.0, "sparsity": 0.0, "step": 10},
    {"eval_accuracy": 0.6, "eval_loss": 0.9, "step": 10},
    {"loss": 0.5, "sparsity": 0.5, "sparsity/bert.x": 0.5, "step": 20},
    {"eval_accuracy": 0.8, "eval_loss": 0.5, "step": 20},
    {"train_runtime": 3.0, "step": 20},
]


def _card(**overrides):
    kwargs = dict(
        base_model="sentence-transformers/all-MiniLM-L6-v2",
        task="text-classification",
        dataset="GLUE SST-2",
        dataset_id="nyu-mll/glue",
        pattern="2:4",
        schedule={"pattern": "2:4", "schedule": "cubic", "start": 0.1, "end": 0.6, "update_every": 100},
        layer_table=LAYERS,
        checkpoint_bytes=600_000,
        dense_bytes=1_000_000,
        metrics={"eval_accuracy": 0.8, "eval_loss": 0.5, "eval_runtime": 1.0},
        speedup={"H200 bf16": 1.3},
        repo_id="me/tiny-2of4",
    )
    kwargs.update(overrides)
    return render_model_card(**kwargs)


def test_card_metadata_parses_and_says_how_to_load():
    text = _card()
    card = ModelCard(text)
    data = card.data.to_dict()
    assert {"hf_sparse", "sparsity", "n:m", "sparsity-2:4"} <= set(data["tags"])
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-classification"
    assert data["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    result = data["model-index"][0]["results"][0]
    assert result["dataset"]["type"] == "nyu-mll/glue"
    assert result["metrics"] == [{"type": "accuracy", "value": 0.8}]  # no loss, no runtime in model-index
    assert (
        "import hf_sparse" in card.text
        and 'AutoModelForSequenceClassification.from_pretrained("me/tiny-2of4")' in card.text
    )
    assert "| `bert.encoder.layer.0.intermediate.dense` | 128 × 64 | 2:4 | 50.00% |" in card.text
    assert "| Sparsity of the pruned layers | 50.00% |" in card.text
    assert "| Size against dense | 0.60× |" in card.text
    assert "H200 bf16: 1.30×" in card.text
    assert "| eval_accuracy | 0.8000 |" in card.text and "eval_runtime" not in card.text


def test_card_without_records_still_parses():
    text = render_model_card(
        base_model="/local/path",
        task=None,
        dataset=None,
        pattern="unstructured:0.75",
        schedule=None,
        layer_table=None,
        checkpoint_bytes=None,
        dense_bytes=None,
        metrics=None,
    )
    data = ModelCard(text).data.to_dict()
    assert "base_model" not in data and "model-index" not in data  # a local path is no Hub id
    assert "unstructured-sparsity" in data["tags"] and "n:m" not in data["tags"]
    assert "`/local/path`" in text and "not measured" in text and "No evaluation results" in text


def test_history_from_log_history():
    history = history_from_log_history(LOG_HISTORY)
    assert history == {
        "sparsity": [[10, 0.0], [20, 0.5]],
        "metric": [[10, 0.6], [20, 0.8]],
        "metric_name": "eval_accuracy",
    }
    assert history_from_log_history(LOG_HISTORY, metric_key="loss")["metric"] == [[10, 0.9], [20, 0.5]]


def test_plot_written_or_skipped_with_a_note(tmp_path, caplog):
    history = history_from_log_history(LOG_HISTORY)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with caplog.at_level(logging.INFO, logger="hf_sparse.hub"):
            assert save_training_plot(history, tmp_path / "p.png") is None
        assert "matplotlib is not installed" in caplog.text
        return
    path = save_training_plot(history, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_model_card(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1234)
    readme = write_model_card(
        tmp_path,
        history=history_from_log_history(LOG_HISTORY),
        base_model=None,
        task=None,
        dataset=None,
        pattern="2:4",
        schedule="cubic",
        layer_table=LAYERS,
        dense_bytes=None,
        metrics=None,
    )
    text = readme.read_text()
    assert "| Checkpoint size | 1.2 kB |" in text
    assert ("sparsity_history.png" in text) == (tmp_path / "sparsity_history.png").exists()
    ModelCard(text)


# ------------------------------------------------------------------------------------------------ push_to_hub


class CapturingApi(HfApi):
    """HfApi with its two network calls replaced: records the repo and the exact commit it would make."""

    def __init__(self):
        super().__init__(token="hf_fake")
        self.repos, self.commits = [], []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append((repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            src = op.path_or_fileobj
            files[op.path_in_repo] = src if isinstance(src, bytes) else Path(src).read_bytes()
        self.commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return "commit-info"


def _materialise(files, folder: Path) -> Path:
    folder.mkdir()
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_bert(path, ["a good film", "a bad film"])
    return path


def test_push_dense_model_commit(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    monkeypatch.setattr(HfApi, "create_commit", CapturingApi.create_commit)
    monkeypatch.setattr(HfApi, "create_repo", CapturingApi.create_repo)
    model = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=2)
    tok = AutoTokenizer.from_pretrained(tiny)
    api = HfApi(token="hf_fake")
    api.repos, api.commits = [], []
    assert (
        push_to_hub(
            model,
            "me/dense",
            tokenizer=tok,
            card="# hi",
            private=True,
            api=api,
            extra_files={"notes/plot.png": b"png"},
            commit_message="msg",
        )
        == "commit-info"
    )
    assert api.repos == [("me/dense", {"token": None, "private": True, "exist_ok": True})]
    assert "quantization_config" not in json.loads(api.commits[0]["files"]["config.json"])  # a dense model stays dense
    (commit,) = api.commits
    assert commit["commit_message"] == "msg" and commit["repo_id"] == "me/dense"
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "notes/plot.png"} <= set(
        commit["files"]
    )
    assert commit["files"]["README.md"] == b"# hi"


def _sparse_model(tiny, pattern="2:4"):
    """A tiny classifier pruned one-shot through the Pruner, saved compressed, and loaded back (sparse layers)."""
    from transformers import AutoModelForSequenceClassification

    if not hasattr(hf_sparse, "Pruner") or not hasattr(hf_sparse, "save_pretrained"):
        pytest.skip("this hf_sparse has no Pruner/save_pretrained")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=2)
    pruner = hf_sparse.Pruner(
        model, hf_sparse.SparsityConfig(score="magnitude", pattern=pattern, schedule="oneshot", start=0, end=0)
    )
    pruner.bind(1)
    pruner.update(0)
    pruner.apply()
    return model, pruner


def test_push_sparse_model_loads_back(tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, pruner = _sparse_model(tiny)
    saved = tmp_path / "saved"
    hf_sparse.save_pretrained(model, saved, pruner)
    loaded = AutoModelForSequenceClassification.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(tiny)
    api = CapturingApi()
    push_to_hub(loaded, "me/sparse-2of4", tokenizer=tok, api=api)
    files = api.commits[0]["files"]
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)

    card = ModelCard(files["README.md"].decode())
    assert "sparsity-2:4" in card.data.tags and "import hf_sparse" in card.text
    assert "| Sparsity of the pruned layers | 50.00% |" in card.text

    pushed = _materialise(files, tmp_path / "pushed")
    reloaded = AutoModelForSequenceClassification.from_pretrained(pushed)
    assert reloaded.config.quantization_config is not None
    batch = tok(["a good film"], return_tensors="pt")
    model.eval(), loaded.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)
    assert dense_weight_bytes(loaded) == dense_weight_bytes(model)  # compressed layers count at their dense size
    assert directory_weight_bytes(pushed) < dense_weight_bytes(model)


def test_push_model_pruned_in_place_goes_up_compressed(tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model, pruner = _sparse_model(tiny, pattern="64:2:8")
    api = CapturingApi()
    push_to_hub(model, "me/in-place", pruner=pruner, api=api)
    files = api.commits[0]["files"]
    card = ModelCard(files["README.md"].decode())
    assert "v:n:m" in card.data.tags and "| Sparsity of the pruned layers | 75.00% |" in card.text
    assert card.data.pipeline_tag == "text-classification"
    reloaded = AutoModelForSequenceClassification.from_pretrained(_materialise(files, tmp_path / "pushed"))
    assert any(isinstance(m, hf_sparse.SparseLinear) for m in reloaded.modules())
    ids = torch.tensor([[2, 5, 6, 3]])
    model.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE=1", "no server at the endpoint"])
def test_push_without_the_hub_says_so_and_keeps_the_files(tiny, tmp_path, monkeypatch, how):
    """The real HfApi, offline or pointed at a port nothing listens on: no raw ConnectError, and the files stay."""
    import tempfile

    import huggingface_hub.constants
    from transformers import AutoModelForSequenceClassification

    model, pruner = _sparse_model(tiny)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if how == "HF_HUB_OFFLINE=1":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what the variable sets at import
        api = HfApi(token="hf_fake")
    else:
        api = HfApi(endpoint="http://127.0.0.1:1", token="hf_fake")
    with pytest.raises(HubUnreachableError) as info:
        push_to_hub(model, "me/offline", pruner=pruner, api=api)
    message = str(info.value)
    assert isinstance(info.value, ConnectionError)
    assert f"cannot reach {api.endpoint}" in message and "nothing was uploaded to 'me/offline'" in message
    (folder,) = tmp_path.glob("hf_sparse_push_*")
    assert f"The files are saved in {folder}" in message and "upload_folder" in message
    assert {"README.md", "config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)  # what would have gone up: compressed
    assert loaded.config.quantization_config is not None


def test_push_removes_its_folder_after_an_upload(tiny, tmp_path, monkeypatch):
    import tempfile

    model, pruner = _sparse_model(tiny)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    push_to_hub(model, "me/online", pruner=pruner, api=CapturingApi())
    assert list(tmp_path.glob("hf_sparse_push_*")) == []
