"""The image store: a data set decoded once into a uint8 array file on disk, memory-mapped by every process.

A store is a folder::

    header.json   format, classes, shape (N, C, H, W), train rows, mean/std, source and its fingerprint
    images.u8     the images, uint8 (N, C, H, W) in C order: rows 0..n_train-1 are the train split
    labels.npy    int64 (N,)

``open_store`` checks all three (a truncated, foreign or out-of-date store is an error that names
it) and maps the images read-only: a batch is a gather of rows, the pages stay in the OS's cache,
shared by every process that maps the file. ``build_store`` fills ``<folder>.partial`` (the count of
finished rows in ``progress.json``), puts the rows in split order when they are not already and
renames the folder into place: a killed build continues where it stopped, and a folder with a
header is always complete. A lock file keeps two processes from building the same store at once.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import atomic_path, atomic_write_json
from ..errors import VitlabError
from .download import Log
from .owned import mark_owned, owner_marker

STORE_FORMAT = 1
MAGIC = "vitlab-image-store"
HEADER, IMAGES, LABELS = "header.json", "images.u8", "labels.npy"
_ROWS, _PROGRESS = "rows.u8", "progress.json"
STORE_FILES = frozenset({HEADER, IMAGES, LABELS, _ROWS, _PROGRESS})  # all a store's folder holds (and its marker)
_COPY_BYTES = 64 << 20  # bytes per read when rows are reordered or counted


@dataclass
class Store:
    """An opened store: ``images`` (N, C, H, W) uint8 mapped from disk, ``labels`` (N,) int64, its header."""

    path: Path
    header: dict[str, Any]
    images: np.ndarray
    labels: np.ndarray

    @property
    def n_train(self) -> int:
        return int(self.header["n_train"])

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) of 'train' or 'test' as tensors over the mapped file (no copy)."""
        rows = slice(0, self.n_train) if name == "train" else slice(self.n_train, len(self.labels))
        return torch.from_numpy(self.images[rows]), torch.from_numpy(self.labels[rows])


def is_store(path: Path) -> bool:
    """Whether ``path`` is a folder that holds a store header."""
    return path.is_dir() and (path / HEADER).is_file()


def _bad(path: Path, problem: str) -> ValueError:
    return VitlabError(f"{path} is not a usable vitlab image store: {problem}")


def open_store(path: str | os.PathLike, key: str | None = None) -> Store:
    """Open and check a store folder; ``key`` (when given) must match the one it was built for."""
    path = Path(path)
    try:
        header = json.loads((path / HEADER).read_text())
    except FileNotFoundError:
        partial = path.with_name(path.name + ".partial")
        why = f" (an unfinished build is in {partial})" if partial.exists() else ""
        raise _bad(path, f"it has no {HEADER}{why}") from None
    except (OSError, ValueError) as e:
        raise _bad(path, f"{HEADER} is unreadable ({e})") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise _bad(path, f"{HEADER} is not a vitlab store header")
    if header.get("format") != STORE_FORMAT:
        raise _bad(path, f"store format {header.get('format')!r}, this vitlab reads format {STORE_FORMAT}; "
                         "delete the folder to rebuild it")
    if key is not None and header.get("key") != key:
        raise _bad(path, "it was built from another source or with other settings (fingerprint mismatch)")
    shape = tuple(header.get("shape", ()))
    if len(shape) != 4 or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise _bad(path, f"{HEADER} has a bad shape {shape!r}")
    images_file = path / IMAGES
    expected = int(np.prod(shape))
    try:
        got = images_file.stat().st_size
    except OSError:
        raise _bad(path, f"{IMAGES} is missing") from None
    if got != expected:
        raise _bad(path, f"{images_file} holds {got} bytes, the header's {shape} needs {expected} (truncated?)")
    try:
        labels = np.load(path / LABELS, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise _bad(path, f"{LABELS} is unreadable ({e})") from None
    n_classes = len(header.get("classes", []))
    if labels.dtype != np.int64 or labels.shape != (shape[0],):
        raise _bad(path, f"{LABELS} holds {labels.dtype} {labels.shape}, expected int64 ({shape[0]},)")
    if len(labels) and (labels.min() < 0 or labels.max() >= n_classes):
        raise _bad(path, f"{LABELS} has labels outside 0..{n_classes - 1}")
    if not 0 <= header.get("n_train", -1) <= shape[0]:
        raise _bad(path, f"{HEADER} has a bad n_train {header.get('n_train')!r}")
    # copy-on-write mapping: writable for torch.from_numpy, shared pages unless a process writes to them
    images = np.memmap(images_file, np.uint8, "c", shape=shape) if expected else np.zeros(shape, np.uint8)
    return Store(path, header, images, labels)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file."""
    lock = path.with_name(f".{path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _allocate(path: Path, size: int) -> None:
    """Make ``path`` ``size`` bytes long with its blocks allocated: a full disk is an OSError (ENOSPC) here,
    not a SIGBUS when a mapped page is written later. Where the file system cannot allocate ahead, the
    file is only extended."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        if os.fstat(f.fileno()).st_size != size:
            f.truncate(size)
        if size:
            try:
                os.posix_fallocate(f.fileno(), 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def store_needs(path: Path, shape: tuple[int, ...], reorder: bool) -> int:
    """Bytes of disk a build of the store at ``path`` still needs: the rows not yet allocated, a second copy
    of them when they must be put in split order, the labels and a margin for the small files."""
    rows = int(np.prod(shape))
    part = path.with_name(path.name + ".partial")
    need = max(0, rows - _allocated(part / _ROWS)) if not (part / IMAGES).exists() else 0
    if reorder:
        need += max(0, rows - _allocated(part / IMAGES))
    return need + 8 * int(shape[0]) + (1 << 20)


Fill = Callable[[Path, int, Callable[[int, list[int]], None]], None]
Arrange = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def build_store(path: Path, header: dict[str, Any], shape: tuple[int, int, int, int], labels: np.ndarray,
                fill: Fill, arrange: Arrange, log: Log, names: Callable[[int], str] | None = None,
                fill_order: np.ndarray | None = None) -> tuple[Store, list[int]]:
    """Build (or finish building) the store at ``path``; returns it and the source rows that were unreadable.

    ``fill(rows_file, start, done)`` writes rows ``start``..N-1 of ``shape`` into the array file, in
    source order or, given ``fill_order``, source row ``fill_order[i]`` at row i (the split order, so
    that no reordering is needed unless images turn out unreadable), and calls
    ``done(finished_rows, unreadable_rows)`` as it goes (rows of the file); ``arrange(keep)``
    turns the mask of readable rows into (train rows, test rows); ``names(row)`` names an unreadable
    row in the header. ``header`` must hold ``key``,
    which identifies the source and settings (a partial build with another key starts over).
    """
    with _locked(path):
        if is_store(path):  # built by another process while this one waited for the lock
            with contextlib.suppress(ValueError):
                store = open_store(path, header["key"])
                return store, list(store.header.get("unreadable_rows", []))
        part = path.with_name(path.name + ".partial")
        rows_file, progress_file = part / _ROWS, part / _PROGRESS
        row_bytes = int(np.prod(shape[1:]))
        state = _read_progress(progress_file)
        if state.get("key") == header["key"] and state.get("shape") == list(shape) and (
                state.get("arranged") or rows_file.is_file() and rows_file.stat().st_size == shape[0] * row_bytes):
            if owner_marker(part) is None:  # a build of an older vitlab: its progress file with this key is ours
                mark_owned(part, "store")
            if state["done"] < shape[0]:
                log(f"resuming the unfinished build of {path} at image {state['done']} of {shape[0]}")
        else:
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir(parents=True)
            mark_owned(part, "store")
            state = {"key": header["key"], "shape": list(shape), "done": 0, "bad": [], "arranged": False}
            atomic_write_json(progress_file, state)
        if not state["arranged"]:
            _allocate(rows_file, shape[0] * row_bytes)

        def done(rows: int, bad: list[int]) -> None:
            state["done"] = rows
            state["bad"] = sorted(set(state["bad"]) | set(bad))
            atomic_write_json(progress_file, state)

        if state["done"] < shape[0]:
            fill(rows_file, state["done"], done)
        at = np.arange(shape[0]) if fill_order is None else np.asarray(fill_order, dtype=np.int64)
        bad = sorted(int(at[i]) for i in state["bad"])  # source rows
        keep = np.ones(shape[0], dtype=bool)
        keep[bad] = False
        train_rows, test_rows = arrange(keep)
        order = np.concatenate([train_rows, test_rows]).astype(np.int64)
        if not state["arranged"]:
            where = np.empty(shape[0], dtype=np.int64)
            where[at] = np.arange(shape[0])  # source row -> row of the file
            _reorder(rows_file, part / IMAGES, shape, where[order])
            state["arranged"] = True
            atomic_write_json(progress_file, state)
        final_shape = (len(order), *shape[1:])
        images = np.memmap(part / IMAGES, np.uint8, "c", shape=final_shape) if len(order) and row_bytes else \
            np.zeros(final_shape, np.uint8)
        mean, std = mean_std(images[:len(train_rows)])
        del images
        with atomic_path(part / LABELS) as tmp, open(tmp, "wb") as f:
            np.save(f, labels[order].astype(np.int64))
        full = dict(header, magic=MAGIC, format=STORE_FORMAT, shape=list(final_shape), n_train=len(train_rows),
                    mean=list(mean), std=list(std), unreadable_rows=bad,
                    unreadable=[names(r) for r in bad] if names else [])
        atomic_write_json(part / HEADER, full)
        progress_file.unlink()
        if path.exists():
            shutil.rmtree(path)
        os.replace(part, path)
        return open_store(path, header["key"]), bad


def _read_progress(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
        return state if isinstance(state, dict) and isinstance(state.get("done"), int) else {}
    except (OSError, ValueError):
        return {}


def _reorder(src: Path, dest: Path, shape: tuple[int, int, int, int], order: np.ndarray) -> None:
    """Write rows ``order`` of the array file ``src`` to ``dest`` (a rename when it is every row in order)."""
    if len(order) == shape[0] and np.array_equal(order, np.arange(shape[0])):
        os.replace(src, dest)
        return
    row_bytes = int(np.prod(shape[1:]))
    rows = np.memmap(src, np.uint8, "r", shape=shape) if shape[0] and row_bytes else None
    step = max(1, _COPY_BYTES // max(row_bytes, 1))
    with atomic_path(dest) as tmp, open(tmp, "r+b") as out:
        _allocate(tmp, len(order) * row_bytes)
        for i in range(0, len(order), step):
            out.write(np.ascontiguousarray(rows[order[i:i + step]]).tobytes())
    del rows
    src.unlink()


def mean_std(images: np.ndarray | torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 (N, C, H, W) images in [0, 1], exact (256-bin
    histograms), read a slice of rows at a time."""
    c = images.shape[1]
    hist = torch.zeros(c, 256, dtype=torch.float64)
    step = max(1, _COPY_BYTES // max(int(np.prod(images.shape[1:])), 1))
    for i in range(0, images.shape[0], step):
        x = torch.as_tensor(np.asarray(images[i:i + step]))
        for k in range(c):
            hist[k] += torch.bincount(x[:, k].reshape(-1), minlength=256).to(torch.float64)
    values = torch.arange(256, dtype=torch.float64) / 255.0
    n = hist.sum(1).clamp_min(1)
    m = (hist * values).sum(1) / n
    var = ((hist * (values - m[:, None]) ** 2).sum(1) / n).clamp_min(0)
    return tuple(float(v) for v in m), tuple(float(v) for v in var.sqrt())
