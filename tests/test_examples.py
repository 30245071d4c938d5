"""``examples/run_glue.py`` and ``examples/run_qa.py`` end to end on the CPU, with a tiny random BERT and tiny files.

The scripts run in-process (``main(argv)``) so the ~10 s import of transformers is paid once. Their pieces that
are easy to get subtly wrong (reading GLUE TSVs as downloaded, recipe/flag precedence, labelling answer spans in
sliding windows, post-processing logits into answers) are checked on their own first.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _tiny_models import build_tiny_bert

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

SENTENCES = [
    ("a good film .", 1),
    ("a bad film .", 0),
    ("great acting and a good plot", 1),
    ("boring , bad and long", 0),
]
LONG_CONTEXT = "The cat sat on the mat in the small house near the river . " * 3 + "Paris is the capital of France ."
SHORT_CONTEXT = "Water boils at one hundred degrees , and ice melts at zero degrees ."
QAS = [
    ("q1", LONG_CONTEXT, "What is the capital of France ?", "Paris"),
    ("q2", LONG_CONTEXT, "Where did the cat sit ?", "on the mat"),
    ("q3", SHORT_CONTEXT, "When does ice melt ?", "at zero degrees"),
]


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_glue():
    return _script("run_glue")


@pytest.fixture(scope="module")
def run_qa():
    return _script("run_qa")


def _squad_json(qas, version="1.1"):
    paragraphs = {}
    for qid, context, question, answer in qas:
        qa = {"id": qid, "question": question, "answers": [{"text": answer, "answer_start": context.index(answer)}]}
        paragraphs.setdefault(context, []).append(qa)
    return {
        "version": version,
        "data": [{"title": "t", "paragraphs": [{"context": c, "qas": q} for c, q in paragraphs.items()]}],
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    texts = [s for s, _ in SENTENCES] + [c + " " + q for _, c, q, _ in QAS] + ["entailment neutral contradiction"]
    model = build_tiny_bert(root / "model", texts)
    sst2 = root / "SST-2"
    sst2.mkdir()
    (sst2 / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in SENTENCES * 3))
    (sst2 / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in SENTENCES))
    (sst2 / "test.tsv").write_text("index\tsentence\n" + "".join(f"{i}\t{s}\n" for i, (s, _) in enumerate(SENTENCES)))
    mnli = root / "MNLI"
    mnli.mkdir()
    header = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label\n"
    rows = [
        f"{i}\t0\t0\tfiction\t{a}\t{b}\tx\t{lab}\n"
        for i, (a, b, lab) in enumerate(
            [
                ("a good film .", "a good plot", "entailment"),
                ("a bad film .", "great acting", "contradiction"),
                ("a good film .", "long", "neutral"),
            ]
        )
    ]
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        (mnli / name).write_text(header + "".join(rows))
    stsb = root / "stsb.jsonl"
    stsb.write_text(
        "".join(
            json.dumps({"sentence1": s, "sentence2": t, "label": float(i)}) + "\n"
            for i, (s, t) in enumerate([("a good film", "a bad film"), ("good", "bad"), ("long", "film")])
        )
    )
    squad = root / "squad.json"
    squad.write_text(json.dumps(_squad_json(QAS)))
    return {"root": root, "model": model, "sst2": sst2, "mnli": mnli, "stsb": stsb, "squad": squad}


FAST = [
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--dataloader_pin_memory",
    "false",
    "--disable_tqdm",
    "true",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "4",
    "--learning_rate",
    "1e-3",
]


def _glue_argv(files, tmp_path, task: str, out, *extra: str) -> list[str]:
    """Flags every GLUE run here shares (the tiny model, 16-token sequences, ``FAST``), then the test's own."""
    common = ["--model_name_or_path", str(files["model"]), "--task_name", task, "--max_seq_length", "16"]
    return [*common, "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"), *extra, *FAST]


# -------------------------------------------------------------------------------------------------- GLUE input


def test_glue_tsv_as_downloaded(tmp_path, run_glue):
    cola = tmp_path / "cola.tsv"  # no header; empty third column
    cola.write_text("gj04\t1\t\tThe sailors rode the breeze clear of the rocks.\ngj04\t0\t*\tnull\n")
    ds = run_glue.load_glue_tsv(str(cola), "cola", str(tmp_path / "cache"))
    assert ds["sentence"] == ["The sailors rode the breeze clear of the rocks.", "null"] and ds["label"] == [1, 0]

    mrpc = tmp_path / "mrpc.tsv"  # byte-order mark, unbalanced quotes that must not be parsed
    mrpc.write_text(
        '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tHe said " no .\t" No , he said .\n',
        encoding="utf-8",
    )
    ds = run_glue.load_glue_tsv(str(mrpc), "mrpc", str(tmp_path / "cache"))
    assert ds[0] == {"sentence1": 'He said " no .', "sentence2": '" No , he said .', "idx": 0, "label": 1}

    mnli = tmp_path / "mnli.tsv"
    mnli.write_text("sentence1\tsentence2\tgold_label\na\tb\tneutral\nc\td\tcontradiction\n")
    ds = run_glue.load_glue_tsv(str(mnli), "mnli", str(tmp_path / "cache"))
    assert ds["premise"] == ["a", "c"] and ds["label"] == [1, 2]

    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence1\tsentence2\tgold_label\na\tb\tmaybe\n")
    with pytest.raises(ValueError, match="labels \\['maybe'\\] are not mnli labels"):
        run_glue.load_glue_tsv(str(bad), "mnli", str(tmp_path / "cache"))


def test_recipe_sets_everything_and_flags_win(tmp_path):
    from sparse_args import SparsityArguments, load_recipe, sparsity_config_kwargs

    yaml_recipe = tmp_path / "r.yaml"
    yaml_recipe.write_text(
        "sparsity:\n  pattern: '64:2:8'\n  schedule: cubic\n  start: 0.1\n  end: 0.6\n"
        "  update_every: 100\n  prune_ignore: ['classifier']\n  transposable: false\n"
    )
    assert sparsity_config_kwargs(SparsityArguments(recipe=str(yaml_recipe), sparsity_end="500")) == {
        "pattern": "64:2:8",
        "schedule": "cubic",
        "start": 0.1,
        "end": 500,
        "update_every": 100,
        "ignore": ["classifier"],
        "transposable": False,
    }
    json_recipe = tmp_path / "r.json"
    json_recipe.write_text(json.dumps({"sparsity_pattern": "2:4", "transposable_masks": True}))
    assert load_recipe(json_recipe) == {"pattern": "2:4", "transposable": True}
    assert sparsity_config_kwargs(SparsityArguments()) is None  # dense
    assert sparsity_config_kwargs(SparsityArguments(sparsity_start="0.25", sparsity_pattern="2:8"))["start"] == 0.25
    json_recipe.write_text(json.dumps({"patern": "2:4"}))
    with pytest.raises(ValueError, match=r"unknown key 'patern' \(did you mean 'pattern'\?\)"):
        load_recipe(json_recipe)


@pytest.mark.parametrize(
    "line, field, text",
    [
        ("dynamic: 'false'", "dynamic", "must be a bool"),
        ('sparsity_dynamic: "no"', "dynamic", "must be a bool"),
        ("transposable_masks: 'yes'", "transposable", "must be a bool"),
        ("pattern: 2:4", "pattern", 'quote the pattern, e.g. pattern: "2:4"'),
        ("pattern: 64:2:8", "pattern", 'quote the pattern, e.g. pattern: "64:2:8"'),
    ],
)
def test_yaml_recipe_values_of_the_wrong_type_are_errors(tmp_path, line, field, text):
    from sparse_args import build_sparsity_config, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"sparsity:\n  {line}\n")
    with pytest.raises(ValueError) as info:
        build_sparsity_config(load_recipe(recipe))
    assert f"SparsityConfig.{field}=" in str(info.value) and text in str(info.value)


def test_yaml_recipe_booleans_as_yaml_spells_them(tmp_path):
    from sparse_args import build_sparsity_config, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("pattern: '2:4'\ndynamic: true\nmasked_decay: 0.1\ntransposable: false\n")
    config = build_sparsity_config(load_recipe(recipe))
    assert config.dynamic is True and config.transposable is False


def test_shipped_recipes_are_valid():
    from sparse_args import load_recipe

    import hf_sparse

    recipes = sorted((EXAMPLES / "recipes").glob("*.*"))
    assert recipes
    for path in recipes:
        hf_sparse.SparsityConfig(**load_recipe(path))


def test_recipes_by_name_and_their_distillation_section(tmp_path):
    from sparse_args import (
        DistillationArguments,
        available_recipes,
        distillation_kwargs,
        load_recipe,
        merge_distillation,
    )

    assert {"prune_then_recover", "gradual_sparsegpt", "gradual_wanda"} <= set(available_recipes())
    assert load_recipe("prune_then_recover") == {
        "pattern": "2:4",
        "schedule": "oneshot",
        "start": 0.4,
        "end": 0.4,
        "score": "sparsegpt",
        "calibration_batches": 32,
    }
    args = merge_distillation(DistillationArguments(distill_alpha=0.8), "prune_then_recover")
    assert (args.self_distill, args.distill_alpha, args.distill_temperature) == (True, 0.8, 2.0)  # the flag wins
    kwargs = distillation_kwargs(args, None, "float32", sparse=True)
    assert kwargs == {"self_distillation": True, "distill_alpha": 0.8, "distill_temperature": 2.0}
    assert distillation_kwargs(merge_distillation(DistillationArguments(), "gradual_wanda"), None, None, True) == {}
    with pytest.raises(FileNotFoundError, match="nor a shipped recipe"):
        load_recipe("prune_then_recovr")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sparsity:\n  pattern: '2:4'\ndistillation:\n  alpah: 0.5\n")
    with pytest.raises(ValueError, match="distillation keys \\['alpah'\\] unknown"):
        merge_distillation(DistillationArguments(), str(bad))


# ------------------------------------------------------------------------------------------------ GLUE end to end


def test_run_glue_dense(files, tmp_path, run_glue):
    out = tmp_path / "dense"
    flags = "--do_train --do_eval --do_predict --max_train_samples 8 --num_train_epochs 1".split()
    metrics = run_glue.main(_glue_argv(files, tmp_path, "sst2", out, "--data_dir", str(files["sst2"]), *flags))
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["train_samples"] == 8
    assert json.loads((out / "eval_results.json").read_text())["eval_accuracy"] == metrics["eval_accuracy"]
    assert "eval_accuracy" in json.loads((out / "all_results.json").read_text())
    lines = (out / "predict_results_sst2.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 5 and lines[1].split("\t")[1] in {"negative", "positive"}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["id2label"] == {"0": "negative", "1": "positive"}


@pytest.mark.slow
def test_run_glue_prune_then_recover_recipe(files, tmp_path, run_glue):
    out = tmp_path / "ptr"
    flags = "--do_train --max_train_samples 16 --num_train_epochs 2 --recipe prune_then_recover".split()
    run_glue.main(_glue_argv(files, tmp_path, "sst2", out, "--data_dir", str(files["sst2"]), *flags))
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["sparsity_config"]["score"] == "sparsegpt" and qconfig["sparsity_config"]["pattern"] == "2:4"


def test_run_glue_sparse_recipe_loads_back(files, tmp_path, run_glue):
    import torch
    from huggingface_hub import ModelCard
    from transformers import AutoModelForSequenceClassification

    import hf_sparse

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("pattern: '2:4'\nschedule: cubic\nstart: 0.0\nend: 0.5\nupdate_every: 1\n")
    out = tmp_path / "sparse"
    flags = "--do_train --do_eval --num_train_epochs 2 --sparsity_pattern 64:2:8 --logging_steps 1".split()
    flags += [
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "3",
        "--data_dir",
        str(files["sst2"]),
        "--recipe",
        str(recipe),
    ]
    metrics = run_glue.main(_glue_argv(files, tmp_path, "sst2", out, *flags))
    assert "eval_accuracy" in metrics
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "hf_sparse" and qconfig["sparsity_config"]["pattern"] == "64:2:8"  # flag wins

    card = ModelCard((out / "README.md").read_text())
    assert "sparsity-64:2:8" in card.data.tags and "| Sparsity of the pruned layers | 75.00% |" in card.text
    assert "eval_accuracy" in card.text

    model = AutoModelForSequenceClassification.from_pretrained(out)
    sparse_layers = [m for m in model.modules() if isinstance(m, hf_sparse.SparseLinear)]
    assert len(sparse_layers) == 12
    dense = hf_sparse.to_dense(model)
    w = dense.bert.encoder.layer[0].intermediate.dense.weight
    assert isinstance(dense.bert.encoder.layer[0].intermediate.dense, torch.nn.Linear)
    assert float((w == 0).float().mean()) == pytest.approx(0.75)


def test_run_glue_schedule_beyond_max_steps_warns_and_its_card_says_dense(files, tmp_path, run_glue):
    from huggingface_hub import ModelCard

    out = tmp_path / "never"
    flags = "--do_train --max_train_samples 8 --max_steps 4 --sparsity_pattern 2:4".split()
    flags += ["--sparsity_start", "500", "--sparsity_end", "600", "--data_dir", str(files["sst2"])]
    with pytest.warns(UserWarning, match="starts at step 500.*no layer will be pruned") as record:
        run_glue.main(_glue_argv(files, tmp_path, "sst2", out, *flags))
    assert len([w for w in record if "the sparsity schedule" in str(w.message)]) == 1
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    card = ModelCard((out / "README.md").read_text())
    assert "no layer of this checkpoint is pruned" in card.text and "pruned to" not in card.text
    assert "sparsity-2:4" not in card.data.tags


def test_run_glue_mnli_matched_and_mismatched(files, tmp_path, run_glue):
    out = tmp_path / "mnli"
    metrics = run_glue.main(_glue_argv(files, tmp_path, "mnli", out, "--data_dir", str(files["mnli"]), "--do_eval"))
    assert {"eval_accuracy", "eval_accuracy_mm", "eval_samples_mm"} <= set(metrics)


def test_run_glue_stsb_regression_from_jsonl(files, tmp_path, run_glue):
    out = tmp_path / "stsb"
    data = ["--train_file", str(files["stsb"]), "--validation_file", str(files["stsb"])]
    flags = "--do_train --do_eval --num_train_epochs 1".split()
    metrics = run_glue.main(_glue_argv(files, tmp_path, "stsb", out, *data, *flags))
    assert {"eval_pearson", "eval_spearmanr", "eval_combined_score"} <= set(metrics)


# --------------------------------------------------------------------------------------------------- QA pieces


def test_train_windows_point_at_the_answer(files, run_qa):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files["model"])
    examples = run_qa.load_qa_split(str(files["squad"]))
    args = run_qa.DataTrainingArguments(train_file="x.json", doc_stride=8)
    batch = examples[:]
    enc = run_qa.prepare_train_features(batch, tok, args, padding="max_length", max_seq_length=32)
    assert len(enc["input_ids"]) > len(examples)  # the long context needed several windows
    feats = Dataset.from_dict(dict(enc))
    enc2 = tok(
        [q for q in batch["question"]],
        batch["context"],
        truncation="only_second",
        max_length=32,
        stride=8,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    found = set()
    for i, f in enumerate(feats):
        example = examples[enc2["overflow_to_sample_mapping"][i]]
        s, e = f["start_positions"], f["end_positions"]
        if s == 0:
            assert e == 0
            continue
        offsets = enc2["offset_mapping"][i]
        assert example["context"][offsets[s][0] : offsets[e][1]] == example["answers"]["text"][0]
        found.add(example["id"])
    assert found == {"q1", "q2", "q3"}


def test_postprocess_picks_best_valid_span(run_qa):
    from utils_qa import postprocess_qa_predictions

    context = "Paris is the capital of France"
    examples = [{"id": "a", "context": context}]
    # tokens: [CLS] q [SEP] Paris is the capital of France [SEP]
    offsets = [None, None, None, [0, 5], [6, 8], [9, 12], [13, 20], [21, 23], [24, 30], None]
    features = {"example_id": ["a"], "offset_mapping": [offsets]}
    start = np.full((1, 10), -10.0)
    end = np.full((1, 10), -10.0)
    start[0, 1], end[0, 1] = 20, 20  # the question: not a valid span
    start[0, 6], end[0, 8] = 5, 4  # "capital of France"
    start[0, 3], end[0, 3] = 3, 3  # "Paris"
    start[0, 0], end[0, 0] = 6, 6  # null score 12
    out = postprocess_qa_predictions(examples, features, (start, end), n_best_size=5)
    assert out == {"a": "capital of France"}
    out = postprocess_qa_predictions(examples, features, (start, end), n_best_size=5, max_answer_length=2)
    assert out == {"a": "Paris"}
    # v2: null (12) - best span (9) = 3 > threshold 0 -> no answer; with threshold 5 -> the span
    assert postprocess_qa_predictions(examples, features, (start, end), version_2_with_negative=True) == {"a": ""}
    out = postprocess_qa_predictions(
        examples, features, (start, end), version_2_with_negative=True, null_score_diff_threshold=5.0
    )
    assert out == {"a": "capital of France"}


# ------------------------------------------------------------------------------------------------- QA end to end


def test_run_qa_sparse_and_evaluator_agree(files, tmp_path, run_qa):
    out = tmp_path / "qa"
    metrics = run_qa.main(
        [
            "--model_name_or_path",
            str(files["model"]),
            "--train_file",
            str(files["squad"]),
            "--validation_file",
            str(files["squad"]),
            "--do_train",
            "--do_eval",
            "--max_seq_length",
            "32",
            "--doc_stride",
            "8",
            "--num_train_epochs",
            "2",
            "--output_dir",
            str(out),
            "--sparsity_pattern",
            "2:4",
            "--sparsity_schedule",
            "linear",
            "--sparsity_start",
            "0",
            "--sparsity_end",
            "0.5",
            "--sparsity_update_every",
            "1",
            "--eval_strategy",
            "epoch",
            "--logging_steps",
            "1",
            "--max_train_samples",
            "3",
            *FAST,
        ]
    )
    assert {"eval_exact_match", "eval_f1"} <= set(metrics)
    predictions = json.loads((out / "predictions.json").read_text())
    assert set(predictions) == {"q1", "q2", "q3"} and (out / "eval_nbest_predictions.json").is_file()
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert sum("eval_f1" in entry for entry in history) == 2  # each epoch's evaluation scored answers too

    import evaluate_squad

    scores = evaluate_squad.evaluate(str(files["squad"]), str(out / "predictions.json"))
    assert scores["exact_match"] == pytest.approx(metrics["eval_exact_match"])
    assert scores["f1"] == pytest.approx(metrics["eval_f1"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "hf_sparse"


def test_oracle_logits_recover_gold_answers_on_squad_dev(run_qa, tmp_path):
    """Windows + offsets + post-processing on real data: logits peaked at the labelled span give back the answer."""
    dev = ROOT.parent / "shared" / "data" / "squad" / "dev-v1.1.json"
    tokenizer_dir = ROOT.parent / "minilm"
    if not dev.is_file() or not (tokenizer_dir / "tokenizer.json").is_file():
        pytest.skip("needs ../shared/data/squad/dev-v1.1.json and ../minilm (shared/tools/get_minilm.sh)")
    from transformers import AutoTokenizer
    from utils_qa import postprocess_qa_predictions

    from hf_sparse.metrics import squad_metrics

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    examples = run_qa.load_qa_split(str(dev)).select(range(400))

    def on_word_boundaries(e):
        # this dev copy's answer_start is the answer's first occurrence, sometimes inside a word ("8" in "18")
        s, text, context = e["answers"]["answer_start"][0], e["answers"]["text"][0], e["context"]
        end = s + len(text)
        return (s == 0 or not context[s - 1].isalnum()) and (end == len(context) or not context[end].isalnum())

    examples = examples.filter(on_word_boundaries)
    args = run_qa.DataTrainingArguments(validation_file="x.json", doc_stride=64)
    kwargs = {"tokenizer": tok, "args": args, "padding": "max_length", "max_seq_length": 128}
    labelled = run_qa.prepare_train_features(examples[:], **kwargs)  # same windows, with gold positions
    features = run_qa.prepare_validation_features(examples[:], **kwargs)
    assert len(labelled["input_ids"]) > len(examples)  # long contexts were cut into several windows
    start = np.full((len(labelled["input_ids"]), 128), -5.0)
    end = start.copy()
    rows = np.arange(len(start))
    start[rows, labelled["start_positions"]] = 5.0
    end[rows, labelled["end_positions"]] = 5.0
    answers = postprocess_qa_predictions(examples, features, (start, end))
    scores = squad_metrics(answers, {e["id"]: e["answers"] for e in examples})
    assert scores["exact_match"] == 100.0, scores


def test_run_glue_distills_from_a_dense_run(files, tmp_path, run_glue):
    flags = ["--data_dir", str(files["sst2"]), *"--do_train --max_train_samples 8 --num_train_epochs 1".split()]

    def glue(out, *extra):
        return run_glue.main(_glue_argv(files, tmp_path, "sst2", out, *flags, *extra))

    teacher = tmp_path / "teacher"
    glue(teacher)
    kd = ["--distill_from", str(teacher), "--distill_alpha", "0.7", "--distill_temperature", "3"]
    with pytest.raises(ValueError, match="needs a sparse run"):
        glue(tmp_path / "dense-kd", *kd)
    student = tmp_path / "student"
    metrics = glue(student, "--sparsity_pattern", "2:4", *kd)
    assert metrics["train_samples"] == 8 and (student / "config.json").is_file()
    plain = glue(tmp_path / "plain", "--sparsity_pattern", "2:4")
    assert metrics["train_loss"] != pytest.approx(plain["train_loss"], rel=1e-3)  # the teacher's loss was mixed in


def test_per_batch_mean_loss_makes_accumulation_match_a_full_batch(tmp_path, run_glue):
    """BERT heads average their loss per batch; without the fix, Trainer (transformers 5) skips its division by the
    accumulation steps and the first step's gradient norm doubles with 2 accumulation steps."""
    import torch
    from conftest import ToyClassification, tiny_config
    from sparse_args import per_batch_mean_loss
    from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

    def first_grad_norm(batch: int, accumulation: int, fix: bool) -> float:
        torch.manual_seed(0)
        config = tiny_config("bert")
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        model = AutoModelForSequenceClassification.from_config(config)
        if fix:
            per_batch_mean_loss(model)
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{batch}-{accumulation}-{fix}"),
            max_steps=1,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=ToyClassification(size=8))
        trainer.train()
        return next(log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log)

    full = first_grad_norm(8, 1, fix=True)
    assert first_grad_norm(4, 2, fix=True) == pytest.approx(full, rel=1e-4)
    assert first_grad_norm(4, 2, fix=False) == pytest.approx(2 * full, rel=1e-4)  # the bug the fix is for
