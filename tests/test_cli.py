import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from conftest import tiny_config
from helpers import prune_now
from transformers import AutoModelForSequenceClassification

import hf_sparse
from hf_sparse.cli import main
from hf_sparse.demo import DemoReport, checkpoint_fields


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


def _damaged(checkpoint, how: str) -> bytes:
    """``model.safetensors`` of ``checkpoint`` damaged as a failed copy or a bad disk would leave it."""
    data = (checkpoint / "model.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    if how == "half":
        return data[: len(data) // 2]
    if how == "last byte missing":
        return data[:-1]
    if how == "empty":
        return b""
    if how == "header overwritten":
        return data[:8] + b"\xff" * 32 + data[40:]
    if how == "column indices overwritten":  # a valid header, but V:N:M columns out of range [0, 8)
        entry = json.loads(data[8 : 8 + length])["bert.encoder.layer.0.intermediate.dense.weight_columns"]
        start, end = (8 + length + offset for offset in entry["data_offsets"])
        return data[:start] + b"\xff" * (end - start) + data[end:]
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["half", "last byte missing", "empty", "header overwritten", "column indices overwritten"]
)
def test_inspect_truncated_or_corrupt_file_is_a_clear_error(checkpoint, capsys, how):
    (checkpoint / "model.safetensors").write_bytes(_damaged(checkpoint, how))
    assert main(["inspect", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-sparse inspect: ") and "model.safetensors" in err and "corrupt" in err
    assert "Traceback" not in err


def test_inspect_corrupt_config_is_a_clear_error(checkpoint, capsys):
    (checkpoint / "config.json").write_text('{"quantization_config": {"quant_method": "hf_sp')
    assert main(["inspect", str(checkpoint)]) == 2
    assert "config.json: not valid JSON" in capsys.readouterr().err


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
    assert report["checkpoint_bytes"] == os.path.getsize(tmp_path / "model" / "model.safetensors")
    assert report["pruned_bytes"] / report["pruned_dense_bytes"] < 0.6


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--pattern", "3:2"], "--pattern '3:2': SparsityConfig.pattern='3:2'"),
        (["--pattern", "2:4:8"], "v=2"),
        (["--max_steps", "0"], "--max_steps 0: the demo trains dense for a third of its steps"),
        (["--max_steps", "-5"], "needs at least 3 steps"),
    ],
)
def test_demo_bad_arguments_are_a_clear_error_and_create_nothing(tmp_path, monkeypatch, capsys, argv, text):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the demo's default output folder goes
    (tmp_path / "tmp").mkdir()
    assert main(["demo", "--output_dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-sparse demo: ") and text in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert main(["demo", *argv]) == 2
    assert list((tmp_path / "tmp").iterdir()) == []


def test_demo_report_gives_the_whole_file_and_the_pruned_layers(checkpoint):
    from safetensors.torch import load_file

    fields = checkpoint_fields(checkpoint)
    file_bytes = os.path.getsize(checkpoint / "model.safetensors")
    layers = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["layers"]
    tensors = load_file(checkpoint / "model.safetensors")
    pruned = sum(
        t.numel() * t.element_size() for k, t in tensors.items() if any(k.startswith(f"{n}.weight") for n in layers)
    )
    dense_pruned = sum(rows * cols * 2 for rows, cols in (spec["shape"] for spec in layers.values()))  # bf16
    assert fields["checkpoint_bytes"] == file_bytes and fields["pruned_bytes"] == pruned
    assert fields["pruned_dense_bytes"] == dense_pruned
    assert fields["checkpoint_dense_bytes"] == file_bytes - pruned + dense_pruned
    report = DemoReport("64:2:8", 0.5, 0.5, 0.5, max_logit_diff=0.0, seconds=1.0, output_dir="x", **fields)
    text = report.to_text()
    assert f"checkpoint file (model.safetensors):    {file_bytes / 1e6:.2f} MB" in text
    assert f"pruned layers' weights in it:           {pruned / 1e6:.2f} MB" in text
