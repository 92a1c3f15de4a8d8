"""The ``vitlab`` command: a thin layer that parses arguments and calls the library."""
from __future__ import annotations

import argparse
import sys


def cmd_models(args: argparse.Namespace) -> int:
    from .models.summary import model_table
    print(model_table(args.pattern))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="vitlab", description="Build, train, distil and understand Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vitlab {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    m = sub.add_parser("models", help="list models with parameters and GFLOPs")
    m.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'vit_*' or cifar")
    m.set_defaults(func=cmd_models)
    from .analysis.command import register as register_inspect
    register_inspect(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"vitlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
