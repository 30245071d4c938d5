import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_config
from helpers import prune_now
from transformers import AutoModelForSequenceClassification

import hf_sparse
from hf_sparse.cli import main


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert")).to(torch.bfloat16)
    hf_sparse.save_pretrained(model, tmp_path / "ckpt", prune_now(model, "64:2:8"))
    return tmp_path / "ckpt"


def test_inspect_table(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "bert.encoder.layer.1.intermediate.dense" in out and "64:2:8" in out
    # 128x64 bf16 layer: values 128*16*2 B + columns 2*8*4 B + selectors 128*4 B = 4672 B of 16384 dense
    assert "4,672" in out and "16,384" in out and "28.5%" in out


def test_inspect_json(checkpoint, capsys):
    assert main(["inspect", str(checkpoint), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["layers"]) == 12 and info["pruned_sparsity"] == pytest.approx(0.75)
    assert all(row["bytes"] / row["dense_bytes"] <= 0.30 for row in info["layers"])


def test_inspect_dense_folder_is_a_clear_error(tmp_path, capsys):
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    model.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no hf_sparse quantization_config" in capsys.readouterr().err


def test_inspect_missing_folder(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow  # ~2 minutes on 2 CPU cores
def test_demo_end_to_end(tmp_path):
    """The README's main command, shortened: trains, prunes, saves, reloads and checks the logits."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_sparse.cli",
            "demo",
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "45",
            "--pattern",
            "2:4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "max |logit difference| after reload:    0" in result.stdout
    report = json.loads((tmp_path / "demo_report.json").read_text())
    assert report["sparsity"] == pytest.approx(0.5) and report["max_logit_diff"] == 0.0
    assert report["checkpoint_bytes"] / report["dense_bytes"] < 0.6
