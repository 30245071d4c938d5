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


def test_prune_command_writes_a_loadable_checkpoint_and_card(tmp_path, capsys):
    from _tiny_models import build_tiny_bert
    from transformers import AutoModel

    texts = [f"the film number {i} was {'good' if i % 2 else 'bad'} and long" for i in range(40)]
    model_dir = build_tiny_bert(tmp_path / "model", texts)
    calibration = tmp_path / "train.tsv"
    calibration.write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(texts)))
    out = tmp_path / "pruned"
    argv = [
        "prune",
        str(model_dir),
        "--pattern",
        "2:4",
        "--score",
        "sparsegpt",
        "--calibration_file",
        str(calibration),
    ]
    assert main([*argv, "--num_calibration_samples", "16", "--max_seq_length", "16", "--output_dir", str(out)]) == 0
    assert "pruned 12 layers to 2:4 (sparsegpt); sparsity 50.00%" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["sparsity_config"]["score"] == "sparsegpt"
    card = (out / "README.md").read_text()
    assert "2:4" in card and "train.tsv" in card
    loaded = AutoModel.from_pretrained(out)
    assert isinstance(loaded.encoder.layer[0].attention.self.query, hf_sparse.SparseLinear)
    assert main(["prune", str(model_dir), "--calibration_file", str(tmp_path / "x.txt"), "--output_dir", "o"]) == 2
    assert "expected one of .tsv, .csv, .json, .jsonl" in capsys.readouterr().err


def test_calibration_texts_from_every_format(tmp_path):
    from hf_sparse.calibration_data import read_texts

    (tmp_path / "a.csv").write_text('id,body\n1,"first text, with comma"\n2,second text\n')
    assert read_texts(tmp_path / "a.csv") == ["first text, with comma", "second text"]  # detected: has spaces
    (tmp_path / "b.jsonl").write_text('{"text": "one line"}\n{"text": ""}\n{"text": "two"}\n')
    assert read_texts(tmp_path / "b.jsonl") == ["one line", "two"]
    squad = {"data": [{"title": "t", "paragraphs": [{"context": "a context here", "qas": []}]}]}
    (tmp_path / "c.json").write_text(json.dumps(squad))
    assert read_texts(tmp_path / "c.json") == ["a context here"]
    (tmp_path / "d.json").write_text(json.dumps([{"q": "x y", "sentence": "s t"}]))
    assert read_texts(tmp_path / "d.json", "q") == ["x y"]
    with pytest.raises(ValueError, match="no column 'nope'"):
        read_texts(tmp_path / "d.json", "nope")
