"""Atomic file writes: a reader, or a run killed midway, sees the old file or the whole new one.

The new content goes to ``.<name>.<8 hex digits>.tmp`` beside the file, created with the mode the
umask gives any new file, and is renamed onto it when complete. The writer holds a lock on the
temporary file while it exists; a temporary file nobody holds a lock on (its writer was killed) is
removed by the next write of the same file, or by ``remove_stale_temps`` (which also removes the folders of
``locked_temp_folder`` left by a killed process).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import VitlabError

TEMP_PATTERN = re.compile(r"\.(?P<name>.+)\.[0-9a-z_]{8}\.tmp")  # also matches tempfile.mkstemp's names
STALE_AFTER_S = 60.0  # a temporary file this old with no writer holding its lock is debris


def is_stale_temp(path: str | os.PathLike, now: float | None = None, older_than: float = STALE_AFTER_S) -> bool:
    """Whether ``path`` is a temporary file (or folder) of a write whose writer is gone: named like one, older
    than ``older_than`` seconds and locked by nobody (0: any age, for a caller that rules out a writer that has
    created its file and not yet locked it, e.g. by holding the folder's lock)."""
    path = Path(path)
    if not TEMP_PATTERN.fullmatch(path.name):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        old = (time.time() if now is None else now) - os.fstat(fd).st_mtime >= older_than
        if not old or path.is_symlink():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live writer holds it (or locks are unsupported here: never guess)
        return True
    finally:
        os.close(fd)  # releases the probe's lock


@contextlib.contextmanager
def locked_temp_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new folder ``.<name>.<8 hex digits>.tmp`` in ``parent``, locked while the block runs and removed after
    it (whatever the block moved out of it stays); if the process is killed, ``remove_stale_temps`` removes it."""
    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            tmp.mkdir(parents=True)
            break
        except FileExistsError:
            continue
    fd = os.open(tmp, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def remove_stale_temps(folder: str | os.PathLike, name: str | None = None, now: float | None = None,
                       older_than: float = STALE_AFTER_S) -> list[Path]:
    """Remove the stale temporary files of atomic writes in ``folder`` (of the file ``name`` only, when given);
    returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = TEMP_PATTERN.fullmatch(entry.name)
        if m and (name is None or m["name"] == name) and is_stale_temp(entry.path, now, older_than):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _create_temp(path: Path) -> tuple[Path, int]:
    """A new temporary file beside ``path`` (mode from the umask, as any new file) and an fd that locks it."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        with contextlib.suppress(OSError):  # a file system without locks: the file is then never called stale
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return tmp, fd
    raise FileExistsError(f"could not create a temporary file beside {path}")


class DiskFullError(VitlabError):
    """A write that failed for lack of space; the file it was to replace is unchanged."""


def _disk_full(path: Path, e: BaseException, written: int = 0) -> DiskFullError | None:
    """The error to raise when ``e`` came from a full disk: an OSError by its errno, an error of a library that
    writes the file itself by its message (safetensors) or, for torch.save's RuntimeError, by the space left."""
    errno_ = getattr(e, "errno", None)
    try:
        st = os.statvfs(path.parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return None
    said = os.strerror(errno.ENOSPC) in str(e) or os.strerror(errno.EDQUOT) in str(e)
    if errno_ not in (errno.ENOSPC, errno.EDQUOT) and not said and not (
            isinstance(e, RuntimeError) and errno_ is None and free < (1 << 20)):
        return None
    kept = f"the previous {path.name} is kept" if path.exists() else f"no half-written {path.name} is left"
    return DiskFullError(f"disk full: writing {path} stopped after {written / 2**20:.2f} MiB, with "
                         f"{free / 2**20:.2f} MiB free on its file system; {kept}; free some space and run again")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path``: renamed onto it when the block succeeds, removed when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, path.name)
    try:
        tmp, fd = _create_temp(path)
    except OSError as e:
        raise _disk_full(path, e) or e from None
    mode = stat.S_IMODE(os.fstat(fd).st_mode)  # what the umask gives a new file
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
            if stat.S_IMODE(os.fstat(f.fileno()).st_mode) != mode:  # a writer that made its own (safetensors: 0600)
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException as e:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        full = _disk_full(path, e, written) if isinstance(e, Exception) else None
        if full is not None:
            raise full from None
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_files(path: str | os.PathLike) -> Iterator[Path]:
    """A path inside a locked temporary folder beside ``path``, for a writer that may add files next to it (ONNX's
    external data): when the block succeeds, every file it wrote is moved into ``path``'s folder, ``path`` last;
    when it fails, nothing is left (a full disk is a DiskFullError that names ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, path.name)
    with locked_temp_folder(path.parent, path.name) as tmp:
        try:
            yield tmp / path.name
            written = sorted(tmp.iterdir(), key=lambda p: p.name == path.name)
            for p in written:
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            for p in written:
                os.replace(p, path.parent / p.name)
        except Exception as e:
            full = _disk_full(path, e, sum(p.stat().st_size for p in tmp.iterdir() if p.is_file()))
            if full is not None:
                raise full from None
            raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON file that must hold an object (what atomic_write_json writes); one-line ValueError otherwise."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VitlabError(f"{path} is not valid JSON ({e})") from None
    except RecursionError:  # 100k nested '[': Python's JSON reader gives up
        raise VitlabError(f"{path} nests its JSON values deeper than vitlab reads; accepted: a JSON object of "
                          "ordinary depth") from None
    if not isinstance(value, dict):
        raise VitlabError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value
