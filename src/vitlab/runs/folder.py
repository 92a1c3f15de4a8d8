"""The folders (and single files) vitlab commands write, and the claim each command takes on them before it writes.

A command writes into a folder only when the folder is new or empty, or holds nothing but what the same kind of
command wrote there before (its mark, or the lock of a command that was killed, says which); it never writes into a
folder holding anyone else's files, nor into one that another live process is writing (an exclusive ``flock`` on
the lock file, held for the life of the command and released by the kernel however the process ends: the pid in the
file is for messages only, so a lock can never go stale). A command that ends leaves no lock: a run folder says
what it is by its files, any other folder keeps a mark naming the kind of command that wrote it. A command that
writes a single file (a figure) writes a new one, or rewrites one that the same kind of command wrote (its mark in
the figure's metadata).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import fnmatch
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from ..atomic import TEMP_PATTERN, atomic_write_bytes, remove_stale_temps
from ..checkpoint import CONFIG as MODEL_CONFIG
from ..checkpoint import WEIGHTS as MODEL_WEIGHTS
from ..errors import VitlabError
from .format import (
    CHECKPOINT_SHARDS,
    CONFIG_YAML,
    CONFUSION_PNG,
    FILES,
    RUN_JSON,
    SUMMARY,
    check_out_dir,
    has_config,
    read_history,
    run_command,
)

LOCK = ".vitlab.lock"  # flocked while a command writes the folder; holds "KIND PID [LAUNCH]" for messages
LOCK_BYTES = 256  # the lock's text, padded with spaces: every write of it is one write of this many bytes
MARK = ".vitlab"  # "KIND": the kind of command that wrote the folder, left in place of the lock when it ends
STARTED = (CONFIG_YAML, RUN_JSON, "tb")  # all a run holds before its first checkpoint: a new run may start it over
_CLAIMED: dict[Path, int] = {}  # folder (absolute) -> the fd of its lock, while this process writes it


RUNS = "runs"  # where a run goes that is given no folder: runs/<model>-<time>


def new_run_folder(name: str, when: datetime.datetime | None = None, root: str | os.PathLike = RUNS) -> Path:
    """``runs/<name>-<YYYYmmdd-HHMMSS>`` (local time), with -2, -3, ... when that folder exists: the folder of a run
    given none."""
    stamp = (when or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{Path(str(name)).name or 'model'}-{stamp}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


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
    # summary-epoch*: the summary of a finished run that went on (vitlab.fit); the sharded checkpoints of --shard fsdp
    "train": (*FILES, "tb", "summary-epoch*.json", f"{CHECKPOINT_SHARDS}*"),
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
        raise VitlabError(f"{flag} {path} is a folder; accepted: a file name")
    if path.exists() and not _marked(path, kind):
        raise VitlabError(f"{flag} {path} is a file that vitlab {kind} did not write (it knows its own "
                          f"{', '.join(FIGURE_MARKS)} figures by their metadata); choose a new file name")
    return path


def _owner(text: str) -> tuple[str, str]:
    kind, pid, *_ = (*text.split(), "", "")
    return kind, pid


class LockHeld(Exception):
    """Another live process holds the lock; ``pid`` is what its file says ("" when it says nothing yet)."""

    def __init__(self, pid: str):
        super().__init__(pid)
        self.pid = pid


# the lock fds this process holds, each with its file's (device, inode): a forked child (a DataLoader worker, a
# decoding pool's process) closes its copies at once, so that a child outliving its parent (kill -9) does not hold
# the parent's lock until it notices; closing a copy leaves the parent's lock held
_HELD: dict[int, tuple[int, int]] = {}


def _close_inherited_locks() -> None:
    for fd, ident in list(_HELD.items()):
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == ident:  # still the lock file, not another file given the same number
                os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def take_lock(path: Path) -> int:
    """An fd holding an exclusive ``flock`` on the file ``path`` (made if missing), which the kernel releases when
    the fd is closed or the process ends, however it ends; raises LockHeld when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            text = os.pread(fd, 64, 0).decode(errors="replace")
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise LockHeld(_pid(text)) from None
        if _is_at(fd, path):
            st = os.fstat(fd)
            _HELD[fd] = (st.st_dev, st.st_ino)
            return fd
        os.close(fd)  # its holder removed the file as this process opened it: lock the one there now


def write_lock(fd: int, text: str) -> None:
    """Put ``text`` (for messages) in a held lock file: one write of LOCK_BYTES, never an empty or half-old file."""
    line = text.rstrip().encode()[:LOCK_BYTES - 1] + b"\n"
    os.pwrite(fd, line.ljust(LOCK_BYTES), 0)
    os.ftruncate(fd, LOCK_BYTES)


def release_lock(path: Path, fd: int) -> None:
    """Remove the lock file ``path`` if it is still the one ``fd`` holds, then release it."""
    with contextlib.suppress(OSError):
        if _is_at(fd, path):
            path.unlink()
    _HELD.pop(fd, None)
    os.close(fd)


def lock_holder(path: str | os.PathLike) -> str | None:
    """The pid a held lock file names ("" when it names none), or None when no live process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return _pid(os.pread(fd, 64, 0).decode(errors="replace"))
    finally:
        os.close(fd)  # and with it the probe's own shared lock


def _pid(text: str) -> str:
    """The pid in a lock's text: the claim's second word, or a lone number."""
    words = text.split()
    pid = words[1] if len(words) > 1 else words[0] if words else ""
    return pid if pid.isdigit() else ""


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``path`` is (still) the file that ``fd`` has open."""
    try:
        there = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def check_model_written(path: str | os.PathLike) -> None:
    """Refuse in one line (a ValueError) a run folder that holds no model yet, saying why: a run still training
    (and its pid) or one that stopped (its last epoch, and the command that resumes it). Anything else passes."""
    folder = Path(path)
    if not folder.is_dir() or (folder / MODEL_CONFIG).exists() or not has_config(folder):
        return
    pid = lock_holder(folder / LOCK)
    if pid is not None:
        raise VitlabError(f"{folder} is unfinished (training{f', pid {pid}' if pid else ''}): its model is written "
                          "when the run ends; wait for it")
    history = read_history(folder)
    when = f"stopped at epoch {history[-1].epoch}" if history else "stopped before its first epoch ended"
    raise VitlabError(f"{folder} is unfinished ({when}; resume with `{run_command(folder)} --resume {folder}`), so it "
                      "holds no model yet")


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
    return sorted(p.name for p in out.iterdir() if p.name not in (LOCK, MARK) and not TEMP_PATTERN.fullmatch(p.name))


def _written_by(out: Path) -> str:
    """The kind of command that wrote ``out``: its lock's (a killed command's), else its mark's, else ""."""
    return _kind_in(out / LOCK) or _mark(out)


def _mark(out: Path) -> str:
    return _kind_in(out / MARK)


def _kind_in(path: Path) -> str:
    """The first word of a lock or mark file ("" when there is none)."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return _owner(f.read(64).decode(errors="replace"))[0]
    return ""


def _check(out: Path, kind: str, marked: bool, resume: bool, flag: str) -> None:
    """Refuse the folder unless this kind of command may write into it (see the module's rule)."""
    entries = _entries(out)
    if kind == "train":
        check_out_dir(out, resume)  # the finished and unfinished runs' own messages
    ours = [e for e in entries if any(fnmatch.fnmatchcase(e, p) for p in WRITES[kind])]
    foreign = [e for e in entries if e not in ours] if marked or (kind == "train" and resume) else entries
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise VitlabError(f"{out} holds files that vitlab {kind} did not write ({shown}); "
                          f"choose a new or empty {flag}")
    if kind == "train" and not resume and not set(entries) <= set(STARTED):
        raise VitlabError(f"{out} holds an unfinished run: continue it with `{run_command(out)} --resume {out}` "
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
        raise VitlabError(f"{flag} {out} is a symbolic link to {os.readlink(out)}, which does not exist; accepted: a "
                          "new or empty folder, or a link to one")
    if out.exists() and not out.is_dir():
        raise VitlabError(f"{flag} {out} is a file; accepted: a new or empty folder")
    if out.is_dir() and not (out / LOCK).exists():
        _check(out, kind, _written_by(out) == kind, resume, flag)  # refused before anything is added to it
    made, fd, succeeded = not out.exists(), None, False
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = take_lock(out / LOCK) if lock else None
    except LockHeld as held:
        raise VitlabError(f"{out} is being written by another vitlab process{f' (pid {held.pid})' if held.pid else ''};"
                          f" wait for it to end or choose another {flag}") from None
    except OSError as e:
        raise VitlabError(f"cannot write {flag} {out}: {os.strerror(e.errno) if e.errno else e}") from None
    try:
        if fd is not None:
            # a killed writer's half-written temporary files: with the folder locked no writer of ours is live here,
            # so they go whatever their age (a temporary file whose writer holds its lock stays)
            remove_stale_temps(out, older_than=0)
        _check(out, kind, _written_by(out) == kind, resume, flag)
        if fd is not None:
            write_lock(fd, f"{kind} {os.getpid()} {launch_id()}")
            _CLAIMED[out.absolute()] = fd
        yield out
        succeeded = True
    finally:
        if fd is not None:
            _CLAIMED.pop(out.absolute(), None)
            _hand_on(out, fd, kind, made, succeeded)


def _hand_on(out: Path, fd: int, kind: str, made: bool, succeeded: bool) -> None:
    """Release the folder at the end of its command, leaving no lock: a folder the command left empty goes (if it
    made it); a run folder says what it is by its files (an unfinished one keeps its lock, for a restart of its
    torchrun launch); any other folder gets the mark of its kind in place of the lock."""
    if not _is_at(fd, out / LOCK):  # the folder was deleted or replaced under the command: touch nothing
        os.close(fd)
        return
    if _left_empty(out):
        release_lock(out / LOCK, fd)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        return
    if kind == "train" and not succeeded:
        os.close(fd)
        return
    if kind != "train" and _mark(out) != kind:  # (a folder marked already needs no write: it may be a full disk's)
        try:
            atomic_write_bytes(out / MARK, f"{kind}\n".encode())
        except (OSError, ValueError):  # no room for the mark: the lock, which names the kind too, stays
            os.close(fd)
            return
    release_lock(out / LOCK, fd)


def _left_empty(out: Path) -> bool:
    try:
        return not _entries(out)
    except OSError:  # the folder itself is gone
        return False
