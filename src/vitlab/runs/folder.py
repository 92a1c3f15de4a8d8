"""The folders (and single files) vitlab commands write, and the claim each command takes on them before it writes.

A command writes into a folder only when the folder is new or empty, or holds nothing but what the same kind of
command wrote there before (its lock file says which); it never writes into a folder holding anyone else's
files, nor into one that another live process is writing (an exclusive ``flock`` on the lock file, held for the
life of the command and released by the kernel if the process dies). A command that writes a single file (a
figure) writes a new one, or rewrites one that the same kind of command wrote (its mark in the figure's metadata).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from ..atomic import TEMP_PATTERN, remove_stale_temps
from ..checkpoint import CONFIG as MODEL_CONFIG
from ..checkpoint import WEIGHTS as MODEL_WEIGHTS
from .format import CONFIG_YAML, CONFUSION_PNG, FILES, RUN_JSON, SUMMARY, check_out_dir, run_command

LOCK = ".vitlab.lock"  # holds "KIND PID [LAUNCH]" of the command that writes (or last wrote) the folder
LOCK_BYTES = 256  # the lock's text, padded with spaces: every write of it is one write of this many bytes
STARTED = (CONFIG_YAML, RUN_JSON, "tb")  # all a run holds before its first checkpoint: a new run may start it over
UNLOCK_WHEN_DONE = ("train", "export")  # the kinds whose folders are handed on: the lock goes when they succeed
_CLAIMED: dict[Path, int] = {}  # folder (absolute) -> the fd of its lock, while this process writes it


class FolderGone(OSError):
    """The folder a command was writing was deleted (or replaced) under it: the command stops."""


def check_claimed(out: str | os.PathLike, what: str = "the run") -> None:
    """Raise FolderGone (one line) when the folder this process claimed is no longer there: its lock file was
    unlinked, or another file now stands in its place. Writes that follow would make a new folder that no command
    claimed (atomic writes make missing folders)."""
    fd = _CLAIMED.get(Path(out).absolute())
    if fd is None:
        return
    held = os.fstat(fd)
    try:
        there = os.stat(Path(out) / LOCK)
    except OSError:
        there = None
    if held.st_nlink == 0 or there is None or (there.st_dev, there.st_ino) != (held.st_dev, held.st_ino):
        raise FolderGone(f"{out} was deleted (or replaced) while {what} was writing it: stopped, and nothing more is "
                         "written; what it had written is gone with the folder")


STUDY_RUNS, STUDY_FEATURES = "runs", "features"  # a study folder's run folders and its probes' cached features
WRITES: dict[str, tuple[str, ...]] = {  # what each kind of command writes in its folder (names or patterns)
    "train": (*FILES, "tb"),
    "eval": (SUMMARY, CONFUSION_PNG),
    "inspect": ("*.png", "*.html", "*.json"),
    "export": (MODEL_CONFIG, MODEL_WEIGHTS, "model.onnx", "model.onnx.data", "preprocess.json",
               "preprocessor_config.json"),
    "study": (STUDY_RUNS, STUDY_FEATURES, "*.md", "*.json", "*.png"),
    "probe": ("probe.json",),
}

FIGURE_MARKS = {  # the figure formats whose metadata names the command that wrote them: (how the file begins, the mark)
    ".png": (b"\x89PNG", "tEXtCreator\x00{}"),
    ".pdf": (b"%PDF", "/Creator ({})"),
    ".svg": (b"<?xml", "<dc:title>{}</dc:title>"),
    ".ps": (b"%!PS", "%%Creator: {}"),
    ".eps": (b"%!PS", "%%Creator: {}"),
}


def figure_metadata(path: str | os.PathLike, kind: str) -> dict[str, str] | None:
    """The metadata that marks a figure at ``path`` as written by vitlab ``kind`` (None: its format carries none)."""
    return {"Creator": f"vitlab {kind}"} if Path(path).suffix.lower() in FIGURE_MARKS else None


def _marked(path: Path, kind: str) -> bool:
    begins, mark = FIGURE_MARKS.get(path.suffix.lower(), (b"", ""))
    if not mark or not path.is_file() or path.stat().st_size > 64 << 20:  # a figure vitlab writes is far smaller
        return False
    data = path.read_bytes()
    return data.startswith(begins) and mark.format(f"vitlab {kind}").encode() in data


def claim_file(path: str | os.PathLike, kind: str, flag: str = "--out") -> Path:
    """Check that a command of ``kind`` may write the file ``path``: a new one, or a figure this kind of command wrote
    (figure_metadata); anything else is refused (a ValueError, one line) before the work."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; accepted: a file name")
    if path.exists() and not _marked(path, kind):
        raise ValueError(f"{flag} {path} is a file that vitlab {kind} did not write (it knows its own "
                         f"{', '.join(FIGURE_MARKS)} figures by their metadata); choose a new file name")
    return path


def _owner(text: str) -> tuple[str, str]:
    kind, pid, *_ = (*text.split(), "", "")
    return kind, pid


def launch_id() -> str:
    """The torchrun launch this process belongs to (its elastic agent, on this host), or "" outside torchrun: the
    worker group that the agent restarts after a failure has the same one, a later launch has another."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    return f"{socket.gethostname()}/{os.getppid()}/{os.environ['TORCHELASTIC_RUN_ID']}"


def written_by_this_launch(out: str | os.PathLike) -> bool:
    """True when ``out``'s lock file says that an earlier worker group of this torchrun launch wrote the folder."""
    path = Path(out) / LOCK
    if not launch_id() or not path.is_file():
        return False
    fields = path.read_text(errors="replace").split()
    return len(fields) == 3 and fields[2] == launch_id()


def _entries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name != LOCK and not TEMP_PATTERN.fullmatch(p.name))


def _check(out: Path, kind: str, marked: bool, resume: bool, flag: str) -> None:
    """Refuse the folder unless this kind of command may write into it (see the module's rule)."""
    entries = _entries(out)
    if kind == "train":
        check_out_dir(out, resume)  # the finished and unfinished runs' own messages
    ours = [e for e in entries if any(fnmatch.fnmatchcase(e, p) for p in WRITES[kind])]
    foreign = [e for e in entries if e not in ours] if marked or (kind == "train" and resume) else entries
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{out} holds files that vitlab {kind} did not write ({shown}); "
                         f"choose a new or empty {flag}")
    if kind == "train" and not resume and not set(entries) <= set(STARTED):
        raise ValueError(f"{out} holds an unfinished run: continue it with `{run_command(out)} --resume {out}` "
                         "or choose another --out")


@contextlib.contextmanager
def claim_folder(out: str | os.PathLike, kind: str, resume: bool = False, lock: bool = True,
                 flag: str = "--out") -> Iterator[Path]:
    """Claim ``out`` for a command of ``kind`` (a key of WRITES) while the block runs: make it, lock it (unless
    ``lock`` is False: a process that writes nothing, e.g. a training rank other than 0), and refuse it (a
    ValueError, one line) when another process holds it or it holds files this kind of command did not write.
    ``resume``: a training run's unfinished folder may be continued."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise ValueError(f"{flag} {out} is a symbolic link to {os.readlink(out)}, which does not exist; accepted: a "
                         "new or empty folder, or a link to one")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file; accepted: a new or empty folder")
    if out.is_dir() and not (out / LOCK).exists():
        _check(out, kind, False, resume, flag)  # refused before anything is added to it
    made, locked = not out.exists(), False
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644) if lock else None
    except OSError as e:
        raise ValueError(f"cannot write {flag} {out}: {os.strerror(e.errno) if e.errno else e}") from None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                _, pid = _owner(os.pread(fd, 64, 0).decode(errors="replace"))
                raise ValueError(f"{out} is being written by another vitlab process{f' (pid {pid})' if pid else ''};"
                                 f" wait for it to end or choose another {flag}") from None
            locked = True
            # a killed writer's half-written temporary files: with the folder locked no writer of ours is live here,
            # so they go whatever their age (a temporary file whose writer holds its lock stays)
            remove_stale_temps(out, older_than=0)
        text = (out / LOCK).read_text(errors="replace") if (out / LOCK).is_file() else ""
        _check(out, kind, _owner(text)[0] == kind, resume, flag)
        if fd is not None:
            line = f"{kind} {os.getpid()} {launch_id()}".rstrip().encode()[:LOCK_BYTES - 1] + b"\n"
            os.pwrite(fd, line.ljust(LOCK_BYTES), 0)  # one write: the old text or the new, never an empty file
            os.ftruncate(fd, LOCK_BYTES)
            _CLAIMED[out.absolute()] = fd
        yield out
        if fd is not None and kind in UNLOCK_WHEN_DONE:
            _unlock_finished(out, fd)
    finally:
        if fd is not None:
            _CLAIMED.pop(out.absolute(), None)
            if locked and made and _left_empty(out):  # a command that failed before writing leaves no folder behind
                (out / LOCK).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    out.rmdir()
            os.close(fd)  # releases the lock


def _unlock_finished(out: Path, fd: int) -> None:
    """Remove the lock file of a folder whose command succeeded, if it is still this process's lock."""
    with contextlib.suppress(OSError):
        held, there = os.fstat(fd), os.stat(out / LOCK)
        if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
            (out / LOCK).unlink()


def _left_empty(out: Path) -> bool:
    try:
        return not _entries(out)
    except OSError:  # the folder itself is gone
        return False
