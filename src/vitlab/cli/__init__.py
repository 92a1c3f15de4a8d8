"""The ``vitlab`` command: a thin layer that parses arguments and calls the library.

One module per command group (``train``; ``eval`` and ``predict``; ``inspect``; ``export``; ``models``;
``compare`` and ``study``), each with ``register(subparsers)``; options that more than one command takes are
made from their one declaration in the training recipe (``options.add_option``).
"""
from __future__ import annotations

import argparse
import errno
import sys
import tempfile
import typing
from pathlib import Path

from . import cache, export, infer, inspect, models, pretrain, probe, runs, train

# in the order `vitlab --help` lists them
COMMANDS = (models, train, pretrain, infer, probe, export, runs, inspect, cache)


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
        for option in ("out", "resume"):
            if getattr(args, option, None):
                check_writable(getattr(args, option), option)
        return args.func(args)
    except RuntimeError as e:
        if args.command != "study":
            raise
        print(f"vitlab study: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"vitlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system failed the work (a full disk, say): the line says which file and why
        print(f"vitlab {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 1
    except FloatingPointError as e:
        print(f"vitlab {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"vitlab {args.command}: interrupted", file=sys.stderr)
        return 130


ADVICE = {errno.ENOSPC: "free some space and run again", errno.EDQUOT: "free some space and run again",
          errno.EROFS: "choose a place on a writable file system", errno.EACCES: "check the permissions"}


def os_error_line(e: OSError) -> str:
    """An OSError as one line that names the file, what went wrong and what to do, never a bare '[Errno N]'."""
    if e.strerror is None:
        return str(e)
    where = f"{e.filename}: " if e.filename is not None else ""
    advice = ADVICE.get(e.errno)
    return f"{where}{e.strerror.lower()}" + (f"; {advice}" if advice else "")


def check_writable(path: str, option: str) -> None:
    """Refuse, before any work, a folder (or file) to write on a file system that takes no writes: the nearest
    existing folder must hold a new file (a permission check alone misses a read-only mount)."""
    folder = Path(path).absolute()
    while not folder.is_dir():
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"--{option} {path}: {folder} cannot be written ({e.strerror}); accepted: a place on a "
                         "writable file system") from None


if __name__ == "__main__":
    sys.exit(main())
