"""The ``hf-sparse`` command: ``demo`` (train, prune, save, reload, report) and ``inspect DIR``."""

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
    inspect = sub.add_parser("inspect", help="per-layer pattern, sparsity and size of a saved checkpoint")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(func=_inspect)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
