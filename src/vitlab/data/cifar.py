"""CIFAR-10/100 python batches: found in a folder or archive, or downloaded, and read without unpickling code.

CIFAR batch files go through an unpickler that only rebuilds numpy arrays, lists, dicts, numbers and strings.
"""
from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import DiskFullError
from ..errors import VitlabError
from .disk import DISK_FULL, check_writable, free_bytes, space_message
from .download import Log, download_url, safe_extract
from .owned import mark_owned


@dataclass(frozen=True)
class _Remote:
    url: str
    md5: str
    filename: str  # the archive's file name
    folder: str  # the batches folder inside it


CIFAR_REMOTES = {
    "cifar10": _Remote("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                       "c58f30108f718f92721af3b95e74349a", "cifar-10-python.tar.gz", "cifar-10-batches-py"),
    "cifar100": _Remote("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                        "eb9058c3a382ffc7106e4002c42a8d85", "cifar-100-python.tar.gz", "cifar-100-python"),
}


@dataclass(frozen=True)
class _CifarLayout:
    train: tuple[str, ...]
    test: tuple[str, ...]
    meta: str
    labels_key: str
    names_key: str


CIFAR_LAYOUTS = {
    "cifar10": _CifarLayout(tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "batches.meta",
                            "labels", "label_names"),
    "cifar100": _CifarLayout(("train",), ("test",), "meta", "fine_labels", "fine_label_names"),
}
CIFAR_FILE_NAMES = {n for lay in CIFAR_LAYOUTS.values() for n in (*lay.train, *lay.test, lay.meta)}


try:  # numpy >= 2
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]

_PICKLE_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
for _mod in ("numpy.core", "numpy._core"):
    _PICKLE_GLOBALS[(f"{_mod}.multiarray", "_reconstruct")] = _multiarray._reconstruct
    _PICKLE_GLOBALS[(f"{_mod}.multiarray", "scalar")] = _multiarray.scalar
    if hasattr(_numeric, "_frombuffer"):  # how pickle protocol 5 stores arrays
        _PICKLE_GLOBALS[(f"{_mod}.numeric", "_frombuffer")] = _numeric._frombuffer


class _NumpyUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds plain containers and numpy arrays and refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _PICKLE_GLOBALS[(module, name)]
        except KeyError:
            raise VitlabError(f"refusing to unpickle {module}.{name}: CIFAR batch files may only hold numpy "
                              "arrays, lists, dicts, numbers and strings") from None


def _read_batch(data: bytes, what: str) -> dict[str, Any]:
    """A CIFAR batch file's dict with str keys, read by the restricted unpickler."""
    try:
        obj = _NumpyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except ValueError as e:
        raise VitlabError(f"{what}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any other failure means a broken file
        raise VitlabError(f"{what} is not a readable CIFAR batch file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise VitlabError(f"{what} is not a CIFAR batch file: it holds a {type(obj).__name__}, not a dict")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def cifar_variant(folder: Path) -> tuple[str, Path] | None:
    """('cifar10' or 'cifar100', batches folder) when ``folder`` is or holds a CIFAR batches folder."""
    for variant, remote in CIFAR_REMOTES.items():
        layout = CIFAR_LAYOUTS[variant]
        for cand in (folder, folder / remote.folder):
            if all((cand / f).is_file() for f in (layout.meta, *layout.train, *layout.test)):
                return variant, cand
    return None


def load_cifar(variant: str, read: Callable[[str], bytes],
                where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """(train images, train labels, test images, test labels, classes) from CIFAR python batches."""
    layout = CIFAR_LAYOUTS[variant]
    meta = _read_batch(read(layout.meta), f"{where}/{layout.meta}")
    if layout.names_key not in meta:
        raise VitlabError(f"{where}/{layout.meta} has no {layout.names_key!r} entry (keys: {', '.join(meta)})")
    classes = [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in meta[layout.names_key]]

    def split(files: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for f in files:
            what = f"{where}/{f}"
            batch = _read_batch(read(f), what)
            x, y = batch.get("data"), batch.get(layout.labels_key)
            if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
                got = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
                raise VitlabError(f"{what}: 'data' must be a uint8 array of shape (N, 3072), got {got}")
            y = np.asarray(y, dtype=np.int64) if y is not None else None
            if y is None or y.shape != (len(x),) or (len(y) and (y.min() < 0 or y.max() >= len(classes))):
                raise VitlabError(f"{what}: {layout.labels_key!r} must hold {len(x)} labels in 0..{len(classes) - 1}")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(y)
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    train_x, train_y = split(layout.train)
    test_x, test_y = split(layout.test)
    return train_x, train_y, test_x, test_y, classes


_NEEDS_BYTES = 360 << 20  # a CIFAR archive (163 MiB) and its extracted batches (178 MiB), with a margin


def _fetch_and_extract(variant: str, archive: Path, cache: Path, log: Log) -> Path:
    """Download (when it is not there) and extract a CIFAR archive into ``cache``; the download is removed after."""
    remote = CIFAR_REMOTES[variant]
    check_writable(cache)
    downloaded = False
    if not archive.is_file():
        free = free_bytes(cache)
        if free is not None and free < _NEEDS_BYTES:
            raise VitlabError(space_message("not enough disk space", variant, cache, _NEEDS_BYTES, free))
        log(f"downloading {variant} from {remote.url}")
        download_url(remote.url, archive, md5=remote.md5, log=log)
        downloaded = True
    log(f"extracting {archive} into {cache}")
    try:
        folder = safe_extract(archive, cache, remote.folder)
        mark_owned(folder, "download", [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()])
        return folder
    finally:
        if downloaded:
            archive.unlink(missing_ok=True)


def find_or_fetch_cifar(variant: str, cache: Path, download: bool, log: Log) -> Path:
    """The batches folder of a built-in CIFAR set under ``cache``, downloaded and extracted on request."""
    remote = CIFAR_REMOTES[variant]
    found = cifar_variant(cache / remote.folder)
    if found and found[0] == variant:
        return found[1]
    archive = cache / remote.filename
    if not archive.is_file() and not download:
        raise VitlabError(f"{variant} is not in the cache folder: looked for {cache / remote.folder} and "
                          f"{archive}. Pass download=True (CLI: --download) to fetch it from {remote.url}, "
                          f"or give the path of a {remote.folder} folder or of {remote.filename}")
    try:
        folder = _fetch_and_extract(variant, archive, cache, log)
    except (OSError, DiskFullError) as e:
        if isinstance(e, DiskFullError) or e.errno in DISK_FULL:
            raise VitlabError(space_message("disk full", f"{variant}", cache, _NEEDS_BYTES)) from None
        raise VitlabError(str(e)) from None
    found = cifar_variant(folder)
    if not found or found[0] != variant:
        raise VitlabError(f"{archive} does not hold the {variant} batch files in {remote.folder}/")
    return folder


