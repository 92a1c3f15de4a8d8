"""The ``vitlab`` command: a thin layer that parses arguments and calls the library.

One module per command group (``train``; ``eval`` and ``predict``; ``inspect``; ``export``; ``models``;
``compare`` and ``study``), each with ``register(subparsers)``; options that more than one command takes are
made from their one declaration in the training recipe (``options.add_option``).
"""
from __future__ import annotations

import argparse
import sys
import typing

from . import cache, export, infer, inspect, models, runs, train

COMMANDS = (models, train, infer, export, runs, inspect, cache)  # in the order `vitlab --help` lists them


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line is one line on stderr (and exit status 2)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    p = Parser(prog="vitlab", description="Build, train, distil and understand Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vitlab {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except RuntimeError as e:
        if args.command != "study":
            raise
        print(f"vitlab study: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"vitlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"vitlab {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"vitlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
