"""The ``hf-sparse`` command: ``demo`` (train, prune, save, reload, report), ``prune`` (one-shot pruning of a saved
model from calibration text) and ``inspect DIR``."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .demo import check_demo_arguments, run_demo

    try:
        check_demo_arguments(args.pattern, args.max_steps)
    except ValueError as err:
        print(f"hf-sparse demo: {err}", file=sys.stderr)
        return 2
    report = run_demo(args.output_dir, args.pattern, args.max_steps, args.model_name_or_path, args.seed)
    print(report.to_text())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .inspect import format_inspection, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path)
    except (FileNotFoundError, ValueError) as err:
        print(f"hf-sparse inspect: {err}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def _load_model(path: str):
    """The model class ``config.json`` names (keeping its head), else ``AutoModel``; float32 weights."""
    import transformers
    from transformers import AutoConfig, AutoModel, PreTrainedModel

    config = AutoConfig.from_pretrained(path)
    cls = next(
        (
            c
            for name in (config.architectures or [])
            if isinstance(c := getattr(transformers, name, None), type) and issubclass(c, PreTrainedModel)
        ),
        AutoModel,
    )
    return cls.from_pretrained(path, dtype="float32")


def _prune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from transformers import AutoTokenizer

    from . import oneshot, save_pretrained
    from .calibration_data import calibration_batches, read_texts
    from .config import SparsityConfig
    from .hub import dense_weight_bytes, write_model_card

    try:
        config = SparsityConfig(
            pattern=args.pattern,
            score=args.score,
            transposable=args.transposable,
            sparsegpt_damp=args.damp,
            targets=args.targets,
            ignore=args.ignore,
        )
        texts = read_texts(args.calibration_file, args.text_column)
    except (ValueError, FileNotFoundError) as err:
        print(f"hf-sparse prune: {err}", file=sys.stderr)
        return 2
    model = _load_model(args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    batches = calibration_batches(
        texts,
        tokenizer,
        num_samples=args.num_calibration_samples,
        max_seq_length=args.max_seq_length,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    dense_bytes = dense_weight_bytes(model)
    pruner = oneshot(model, config, batches if config.score != "magnitude" else None)
    out = Path(args.output_dir)
    save_pretrained(model, out, pruner)
    tokenizer.save_pretrained(out)
    pruner.config.to_json_file(out / "hf_sparse_config.json")
    write_model_card(
        out,
        base_model=args.model_name_or_path,
        task=None,
        dataset=f"{Path(args.calibration_file).name} ({len(texts)} texts; {args.num_calibration_samples} drawn for "
        "calibration)",
        pattern=pruner.config.pattern,
        schedule=pruner.config.to_dict(),
        layer_table=pruner.sparsity_report(),
        dense_bytes=dense_bytes,
        metrics=None,
        model_name=out.resolve().name,
    )
    print(
        f"pruned {len(pruner.layers)} layers to {config.pattern} ({config.score}); sparsity "
        f"{pruner.metrics()['sparsity']:.2%}; written to {out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-sparse", description="N:M / V:N:M sparse training for Transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fine-tune, prune, save, reload and check a small model (CPU, ~1 min)")
    demo.add_argument("--output_dir", default=None, help="where to write (default: a new temp folder)")
    demo.add_argument("--pattern", default="64:2:8", help="'2:4', '2:8', '64:2:8', 'unstructured:0.75', ...")
    demo.add_argument("--max_steps", type=int, default=240)
    demo.add_argument("--model_name_or_path", default=None, help="a local model folder (default: a small new BERT)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    prune = sub.add_parser("prune", help="one-shot pruning of a saved model from calibration text, no training")
    prune.add_argument("model_name_or_path", help="a local model folder (config.json, weights, tokenizer)")
    prune.add_argument("--output_dir", required=True, help="where to write the compressed checkpoint and its card")
    prune.add_argument("--pattern", default="2:4", help="'2:4', '2:8', '64:2:8', 'unstructured:0.5', ...")
    prune.add_argument("--score", default="sparsegpt", choices=["magnitude", "wanda", "sparsegpt"])
    prune.add_argument("--calibration_file", required=True, help="text to calibrate on: .tsv, .csv, .json, .jsonl")
    prune.add_argument("--text_column", default=None, help="column holding the text (default: detected)")
    prune.add_argument("--num_calibration_samples", type=int, default=128)
    prune.add_argument("--max_seq_length", type=int, default=128)
    prune.add_argument("--batch_size", type=int, default=8)
    prune.add_argument("--transposable", action="store_true", help="transposable 2:4 masks")
    prune.add_argument("--damp", type=float, default=0.01, help="SparseGPT dampening, relative to mean(diag XᵀX)")
    prune.add_argument("--targets", nargs="*", default=None, help="module-name regexes to prune (default: blocks)")
    prune.add_argument("--ignore", nargs="*", default=None, help="module-name regexes never pruned")
    prune.add_argument("--seed", type=int, default=0, help="which calibration texts are drawn")
    prune.set_defaults(func=_prune)
    inspect = sub.add_parser("inspect", help="per-layer pattern, sparsity and size of a saved checkpoint")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(func=_inspect)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
