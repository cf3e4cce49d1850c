"""The `slimtune` command: one subcommand per job; every failure prints one clear line and exits 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slimtune.errors import SlimtuneError


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def cmd_demo(args: argparse.Namespace) -> None:
    from slimtune.demo import run_demo

    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else None
    run_demo(args.out, args.base, steps=args.steps, targets=targets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimtune", description="QLoRA fine-tuning with bounded-memory checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train and save the embedded tiny model end to end (offline)")
    demo.add_argument("--out", type=Path, default=Path("slimtune-demo"), help="output directory (default: ./slimtune-demo)")
    demo.add_argument("--base", type=Path, default=None, help="use this local Hugging Face checkpoint instead of the embedded tiny model")
    demo.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    demo.add_argument("--targets", default=None, help="comma-separated LoRA target modules (default: all attention and MLP projections)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_transformers()
    try:
        args.func(args)
    except SlimtuneError as e:
        print(f"slimtune {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slimtune {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
