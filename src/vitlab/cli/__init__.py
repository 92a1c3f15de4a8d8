"""The ``vitlab`` command: a thin layer that parses arguments and calls the library.

One module per command group (``train``; ``eval`` and ``predict``; ``inspect``; ``export``; ``models``;
``compare`` and ``study``), each with ``register(subparsers)``; options that more than one command takes are
made from their one declaration in the training recipe (``options.add_option``).
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import importlib
import os
import signal
import sys
import tempfile
import threading
import traceback
import typing
from pathlib import Path

from safetensors import SafetensorError

from ..errors import VitlabError
from ..text import clip_quotes

# each command's module (one module a command group), in the order `vitlab --help` lists them; a command line that
# names a command imports its module alone, so `vitlab models` starts without torch
COMMANDS = {"models": "models", "train": "train", "pretrain": "pretrain", "eval": "infer", "predict": "infer",
            "probe": "probe", "export": "export", "compare": "runs", "study": "runs", "inspect": "inspect",
            "data": "data", "cache": "cache"}
# each command's line in `vitlab --help`, which lists them without importing their modules (torch, matplotlib)
HELP = {
    "models": "list models with parameters and multiply-adds an image (GMACs)",
    "train": "train (or fine-tune, or distil) a model and write a run folder",
    "pretrain": "self-supervised pre-training (MAE, masked patch prediction, DINO, iBOT or distillation from a frozen "
                "backbone) of a ViT encoder on images, labelled or not; writes a run folder",
    "eval": "evaluate a model on a data set's test split (metrics and plots)",
    "predict": "top-k classes for image files",
    "probe": "judge a frozen model on a data set: k-NN and linear-probe top-1",
    "export": "write a model as ONNX, a timm Hub folder or a Hugging Face folder",
    "compare": "a table of run folders and their curves in one figure",
    "study": "a paper's claim as runs that differ in one factor: table, figure, answer",
    "inspect": "the ViT paper's analyses of a model: attention, rollout, distances, embeddings",
    "data": "write a data set as WebDataset shards (pack), or shards as a folder (unpack)",
    "cache": "list the data cache (stores, sizes, which are superseded) or clean it",
}


def add_command(sub: argparse._SubParsersAction, name: str, **kwargs: typing.Any) -> argparse.ArgumentParser:
    """The parser of command ``name``, with its line of ``HELP``."""
    return sub.add_parser(name, help=HELP[name], **kwargs)


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line is one line on stderr (and exit status 2)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None = None, overview: bool = False) -> argparse.ArgumentParser:
    """The command line's parser: every command's, or only ``command``'s where it names one; with ``overview``,
    the commands' names and lines alone (what `vitlab --help` and a mistyped command need), no module imported."""
    from .. import __version__
    p = Parser(prog="vitlab", description="Build, train, distil and understand Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vitlab {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    if overview:
        for name in COMMANDS:
            add_command(sub, name)
        return p
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for module in modules:
        importlib.import_module(f".{module}", __name__).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    parser = build_parser(command) if command in COMMANDS else build_parser(overview=True)
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        sub = subparser(parser, command) if command else parser
        sub.error(unrecognized(sub, command, extra))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command not in ("train", "pretrain", "study") and getattr(args, "threads", None):
        import torch  # eval, predict, inspect, export, probe: the CPU threads of their forward passes
        torch.set_num_threads(args.threads)
    try:
        for option in ("out", "resume"):
            if getattr(args, option, None):
                check_writable(getattr(args, option), option)
        with sigterm_interrupts():
            return args.func(args)
    except RecursionError:  # a file nested deeper than Python's readers go (a JSON or YAML of 100k '['), wherever
        # read (before RuntimeError, its base class)
        print(f"vitlab {args.command}: error: an input file nests deeper than vitlab reads ({sys.getrecursionlimit()} "
              "levels); accepted: a file of ordinary depth", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if args.command != "study":
            raise
        print(f"vitlab study: error: {e}", file=sys.stderr)
        return 1
    except (VitlabError, FileNotFoundError) as e:  # a refusal of what the user gave, or a path that is not there
        print(f"vitlab {args.command}: error: {clip_quotes(str(e))}", file=sys.stderr)
        return 2
    except SafetensorError as e:  # a weights file that safetensors cannot read, reached by a reader that did not say
        print(f"vitlab {args.command}: error: a safetensors file is truncated or corrupt "
              f"({clip_quotes(str(e))})", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional package the work needs (onnx for an ONNX export, ...)
        print(f"vitlab {args.command}: error: this needs the Python package {e.name!r}, which is not installed; "
              f"install it: pip install {PACKAGES.get(e.name or '', e.name)}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if not stdout_closed():  # another pipe (a worker's, a child's): a failure like any other
            print(f"vitlab {args.command}: error: {clip_quotes(os_error_line(e))}", file=sys.stderr)
            return 1
        # the reader of the output went away (`vitlab models | head -1`): what it read is what it wanted; end
        # quietly, as a command killed by SIGPIPE does, with nothing more written to the closed pipe at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as e:  # the file system failed the work (a full disk, say): the line says which file and why
        print(f"vitlab {args.command}: error: {clip_quotes(os_error_line(e))}", file=sys.stderr)
        return 1
    except FloatingPointError as e:
        print(f"vitlab {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except ValueError:  # not a refusal: a fault in vitlab or beneath it, which keeps its traceback
        traceback.print_exc()
        print(f"vitlab {args.command}: internal error: the traceback above is a bug in vitlab or a library beneath it, "
              "not a problem with your input; please report it with the command line", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank is stopped: the first says so, once
            print(f"vitlab {args.command}: interrupted{how_to_continue(args)}", file=sys.stderr)
        return 130


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM (`kill`, a job scheduler's stop) stops the command as Ctrl-C does: through its cleanup (a study
    stops its runs, the run folder's lock is released), with the same last line, instead of dying mid-write."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one does not cut the cleanup short
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def how_to_continue(args: argparse.Namespace) -> str:
    """The end of the 'interrupted' line: the command that continues the work, where there is one."""
    from ..runs.format import CHECKPOINT
    if args.command in ("train", "pretrain"):
        folder = getattr(args, "resume", None) or getattr(args, "out", None)
        if folder and (Path(folder) / CHECKPOINT).is_file():
            return f"; continue from its last finished epoch with: {launcher()}vitlab {args.command} --resume {folder}"
    if args.command == "study":
        return "; the same command again continues it (finished runs are kept, unfinished ones resume)"
    return ""


def launcher() -> str:
    """How this process was started, as the head of a command line: "" alone, torchrun's when torchrun started it
    (a run it trains resumes under the same launch)."""
    from ..train.distributed import started_by_torchrun
    if not started_by_torchrun():
        return ""
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = "" if local == world else f"--nnodes {world // local} (and the same rendezvous options) "
    return f"torchrun {nodes}--nproc-per-node {local} -m "


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def unrecognized(sub: argparse.ArgumentParser, command: str | None, extra: list[str]) -> str:
    """argparse's 'unrecognized arguments' line, with the closest options of the command for mistyped ones."""
    options = [o for o in sub._option_string_actions if o.startswith("--")]
    close = {m for word in extra if word.startswith("-")
             for m in difflib.get_close_matches(word.split("=")[0], options, n=2, cutoff=0.75)}
    hint = f"; did you mean {' or '.join(sorted(close))}?" if close else ""
    return f"unrecognized arguments: {' '.join(extra)}{hint} (`vitlab {command or ''} --help` lists them)".replace(
        "  ", " ")


# import names whose package is installed under another name or through vitlab's extras
PACKAGES = {"onnx": "'vitlab[onnx]'", "onnxruntime": "'vitlab[onnx]'", "onnxscript": "onnxscript",
            "tensorboard": "tensorboard", "yaml": "pyyaml", "PIL": "pillow",
            "webdataset": "'vitlab[shards]'", "braceexpand": "'vitlab[shards]'"}
ADVICE = {errno.ENOSPC: "free some space and run again", errno.EDQUOT: "free some space and run again",
          errno.EROFS: "choose a place on a writable file system", errno.EACCES: "check the permissions"}


def os_error_line(e: OSError) -> str:
    """An OSError as one line that names the file, what went wrong and what to do, never a bare '[Errno N]'."""
    if e.strerror is None:
        return str(e)
    where = f"{e.filename}: " if e.filename is not None else ""
    advice = ADVICE.get(e.errno)
    return f"{where}{e.strerror.lower()}" + (f"; {advice}" if advice else "")


def stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll says POLLERR for its write end)."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout): not a closed pipe
        return False


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
        raise VitlabError(f"--{option} {path}: {folder} cannot be written ({e.strerror}); accepted: a place on a "
                          "writable file system") from None


if __name__ == "__main__":
    sys.exit(main())
