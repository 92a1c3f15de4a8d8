"""A source written as WebDataset shards (``vitlab data pack``), and shards written back as an image folder
(``vitlab data unpack``).

``pack`` writes ``train-000000.tar, ...`` and ``test-000000.tar, ...`` (the split load_data makes: the source's
own, else ``val_fraction`` by ``seed``) of ``KEY.jpg|png|webp`` + ``KEY.cls`` samples, each shard up to
``shard_size`` bytes, the training samples in an order drawn from ``seed`` (a shuffle buffer then mixes classes
from the first batch on); then ``_info.json``: the class names and each shard's sample count, in timm's layout.
Image files are written as they are (JPEG, PNG and WebP; other formats as PNG, losslessly), the images of a
built-in set or a store as PNG. Each shard is written under a temporary name and renamed when complete, and
``_info.json`` comes last: a half-written shard never carries a shard's name, a killed pack leaves no
``_info.json``.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..atomic import atomic_path, atomic_write_json
from ..errors import VitlabError
from ..progress import progress_bar
from .download import Log
from .shards import INFO, Piece, encode_png, image_bytes, label_of, open_shards, read_piece
from .sources import SourceFiles, source_files

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


def parse_size(text: str | int) -> int:
    """Bytes from '1GB', '500MB', '64KB' or a plain number (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise VitlabError(f"--shard-size {text!r} is not a size; accepted: a number of bytes or e.g. 64KB, 500MB, 1GB")
    unit = m.group(2) if m.group(2).endswith("B") or not m.group(2) else m.group(2) + "B"
    return max(1, int(float(m.group(1)) * _UNITS[unit]))


def _encoded(image: bytes | np.ndarray) -> tuple[str, bytes]:
    """(suffix, bytes) of an image as a shard holds it: JPEG, PNG and WebP as they are, any other format (and a
    uint8 (C, H, W) array) as PNG."""
    if isinstance(image, np.ndarray):
        return "png", encode_png(image)
    with Image.open(io.BytesIO(image)) as img:
        if img.format in _FORMATS:
            return _FORMATS[img.format], image
        img.load()
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return "png", buf.getvalue()


class _Shards:
    """Shards ``<out>/<prefix>-NNNNNN.tar`` written one after another, each renamed into place when complete."""

    def __init__(self, out: Path, prefix: str, shard_size: int):
        self.out, self.prefix, self.shard_size = out, prefix, shard_size
        self.names: list[str] = []
        self.counts: list[int] = []
        self.stack: contextlib.ExitStack | None = None
        self.sink = self.file = None

    def write(self, key: str, image: bytes | np.ndarray, label: int) -> None:
        suffix, data = _encoded(image)
        if self.sink is None:
            self._open()
        self.sink.write({"__key__": key, suffix: data, "cls": str(label).encode()})
        self.counts[-1] += 1
        # the archive's own count of what it holds (headers and padded contents): the file's position lags behind
        # it by what tarfile keeps in its record buffer (10 KB)
        if self.sink.tarstream.offset >= self.shard_size:
            self.close()

    def _open(self) -> None:
        import webdataset as wds

        name = f"{self.prefix}-{len(self.names):06d}.tar"
        self.stack = contextlib.ExitStack()
        tmp = self.stack.enter_context(atomic_path(self.out / name))
        self.file = self.stack.enter_context(open(tmp, "wb"))
        self.sink = wds.TarWriter(self.file, encoder=False)
        self.names.append(name)
        self.counts.append(0)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.stack.close()
            self.sink = self.file = self.stack = None

    def abort(self, error: BaseException) -> None:
        """Remove the shard being written (``error`` stopped it): its temporary file goes."""
        if self.stack is not None:
            with contextlib.suppress(Exception):
                self.sink.close()  # the tar's end, written into the file that goes
            self.stack.__exit__(type(error), error, error.__traceback__)
            self.sink = self.file = self.stack = None

    def split(self) -> dict[str, Any]:
        return {"name": self.prefix, "num_samples": int(sum(self.counts)), "filenames": self.names,
                "shard_lengths": self.counts}


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise VitlabError(f"--out {out} is a file; accepted: a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise VitlabError(f"--out {out} is not empty (nothing in it is overwritten); accepted: a new or empty folder")


def pack(source: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1 << 30, *, val_fraction: float = 0.2,
         seed: int = 0, cache_dir: str | os.PathLike | None = None, download: bool = False,
         log: Log = print) -> dict[str, Any]:
    """Write ``source`` (anything load_data reads) as shards in the new folder ``out``; returns ``_info.json``."""
    out = Path(out).expanduser()
    _check_out(out)
    files = source_files(source, val_fraction=val_fraction, seed=seed, cache_dir=cache_dir, download=download,
                         log=log)
    train = files.train[np.random.default_rng(seed).permutation(len(files.train))] if files.random_access \
        else files.train
    if not files.random_access:
        log(f"{source}: its files are read in their order (no reading out of order), so the training shards keep "
            "that order; the shuffle buffer mixes within its reach")
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    with progress_bar(total=len(train) + len(files.test), desc=f"packing {files.name}", unit="img") as bar:
        for prefix, rows in (("train", train), ("test", files.test)):
            splits[prefix] = _write_split(files, rows, _Shards(out, prefix, shard_size), bar)
    info = {"name": files.name, "source": str(source), "classes": files.classes, "splits": splits}
    atomic_write_json(out / INFO, info)
    log(f"packed {splits['train']['num_samples']} train / {splits['test']['num_samples']} test images of {source} "
        f"into {len(splits['train']['filenames'])} + {len(splits['test']['filenames'])} shards in {out}")
    return info


def _write_split(files: SourceFiles, rows: np.ndarray, shards: _Shards, bar) -> dict[str, Any]:
    try:
        for row, image in files.read(rows):
            shards.write(f"{shards.prefix}{row:08d}", image, int(files.labels[row]))
            bar.update(1)
        shards.close()
    except BaseException as e:
        shards.abort(e)
        raise
    return shards.split()


def unpack(pattern: str, out: str | os.PathLike, log: Log = print) -> int:
    """Write shards back as an image folder ``out/<split>/<class>/<key>.<suffix>`` (``wds:DIR``: its train and test
    shards; a pattern: ``out/<class>/...``); returns the images written."""
    from .shards import folder_patterns

    out = Path(out).expanduser()
    _check_out(out)
    parts = folder_patterns(pattern) if pattern.startswith("wds:") else (pattern, None)
    n = 0
    for split, part in zip(("train", "test"), parts):
        if part is None:
            continue
        s = open_shards(part)
        root = out / split if pattern.startswith("wds:") else out
        with progress_bar(total=s.count, desc=f"unpacking {split}", unit="img") as bar:
            for shard, (url, count) in enumerate(zip(s.urls, s.counts)):
                for key, sample in read_piece(url, Piece(shard, 0, count)):
                    suffix = next(k for k in ("jpg", "jpeg", "png", "webp") if k in sample)
                    folder = root / s.classes[label_of(sample, url, key, s.classes)]
                    folder.mkdir(parents=True, exist_ok=True)
                    with atomic_path(folder / f"{Path(key).name}.{suffix}") as tmp:
                        tmp.write_bytes(image_bytes(sample))
                    n += 1
                    bar.update(1)
    log(f"unpacked {n} images of {pattern} into {out}")
    return n
