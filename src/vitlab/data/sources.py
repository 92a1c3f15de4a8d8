"""Data sources, decoded once into in-memory uint8 tensors and cached on disk.

``load_data`` takes a built-in name (``digits``, embedded; ``cifar10``/``cifar100``, the official
python batches, downloaded on request), a folder of images (``root/<class>/*`` or
``root/train/<class>/*`` with ``root/test`` or ``root/val``), a tar archive of such a folder, or a
CIFAR batches folder/archive. The decoded bundle is saved as one safetensors file in the cache
folder, so the next run with the same source and settings starts at once.

Nothing here unpickles arbitrary objects: CIFAR batch files go through an unpickler that only
rebuilds numpy arrays. Archives are read member by member and refused if any member has an
absolute path, a ``..`` component, or is a link or special file.
"""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import multiprocessing as mp
import os
import pickle
import re
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, ImageOps
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..fileio import atomic_path

DATASETS = ("digits", "cifar10", "cifar100")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
CACHE_VERSION = 1

_SPLIT_DIRS = ("train", "test", "val")
_PROGRESS_MIN = 2000  # files: show a progress bar from this many on
_PROGRESS_MIN_BYTES = 8 << 20  # archive bytes: show a reading bar from this size on
_POOL_MIN = 2000  # files: decode in worker processes from this many on
_MAX_WORKERS = 8
_CHUNK = 500  # files per worker task

Log = Callable[[str], None]


@dataclass
class ImageSet:
    """Images and their labels: uint8 (N, C, H, W), contiguous, and int64 (N,)."""

    images: torch.Tensor
    labels: torch.Tensor


@dataclass
class DataBundle:
    """A train split and a test split with class names and the train images' channel statistics."""

    name: str
    train: ImageSet
    test: ImageSet
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    skipped: int = 0
    source: str = ""


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


_CIFAR_LAYOUTS = {
    "cifar10": _CifarLayout(tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "batches.meta",
                            "labels", "label_names"),
    "cifar100": _CifarLayout(("train",), ("test",), "meta", "fine_labels", "fine_label_names"),
}
_CIFAR_FILE_NAMES = {n for lay in _CIFAR_LAYOUTS.values() for n in (*lay.train, *lay.test, lay.meta)}


def default_cache_dir() -> Path:
    """The data cache folder: $VITLAB_CACHE, else ~/.cache/vitlab."""
    env = os.environ.get("VITLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vitlab"


# ----------------------------------------------------------------------------------------------
# downloads and archives


def download_url(url: str, dest: str | os.PathLike, md5: str | None = None, sha256: str | None = None,
                 log: Log = print) -> Path:
    """Download ``url`` (http(s) or file://) to ``dest`` through a temp file, check its checksum, rename it in."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    hashes = {"md5": hashlib.md5(usedforsecurity=False), "sha256": hashlib.sha256()}
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                response = urllib.request.urlopen(url, timeout=60)
            except (urllib.error.URLError, OSError, ValueError) as e:
                raise OSError(f"could not download {url}: {getattr(e, 'reason', e)}") from None
            with response:
                total = int(response.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                          desc=f"downloading {dest.name}") as bar:
                    while chunk := response.read(1 << 20):
                        out.write(chunk)
                        for h in hashes.values():
                            h.update(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        for algo, expected in (("md5", md5), ("sha256", sha256)):
            got = hashes[algo].hexdigest()
            if expected is not None and got != expected.lower():
                raise ValueError(f"checksum mismatch for {url}: {algo} is {got}, expected {expected}; "
                                 "the download was deleted (try again, or fetch the file by hand)")
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log(f"downloaded {url} to {dest} ({dest.stat().st_size / 2**20:.1f} MiB)")
    return dest


def _member_parts(name: str) -> tuple[str, ...]:
    """An archive member's path as its parts, without empty and '.' parts."""
    return tuple(p for p in name.replace("\\", "/").split("/") if p not in ("", "."))


def _check_member(member: tarfile.TarInfo, archive: Path) -> None:
    """Raise unless the archive member is a plain file or folder with a relative path inside the archive."""
    name = member.name
    problem = None
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        problem = "has an absolute path"
    elif ".." in _member_parts(name):
        problem = "has a '..' component that points outside the archive"
    elif member.issym() or member.islnk():
        problem = f"is a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r})"
    elif not (member.isfile() or member.isdir()):
        problem = "is a device, FIFO or other special file"
    if problem:
        raise ValueError(f"refusing to read {archive}: member {name!r} {problem}; "
                         "vitlab reads only plain files and folders with relative paths from archives")


def _is_archive(path: Path) -> bool:
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _archive_stem(path: Path) -> str:
    lower = path.name.lower()
    for suffix in ARCHIVE_SUFFIXES:
        if lower.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def _safe_extract(archive: Path, dest: Path, folder: str) -> Path:
    """Extract ``folder/`` from a checked archive into ``dest``, all or nothing."""
    try:
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            for m in members:
                _check_member(m, archive)
            wanted = [m for m in members if _member_parts(m.name)[:1] == (folder,)]
            if not wanted:
                raise ValueError(f"{archive} holds no {folder}/ folder")
            tmp = Path(tempfile.mkdtemp(dir=dest, prefix=f".{folder}.", suffix=".tmp"))
            try:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(tmp, members=wanted, filter="data")
                else:  # pragma: no cover - Python without extraction filters; members were checked above
                    tf.extractall(tmp, members=wanted)
                os.replace(tmp / folder, dest / folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (tarfile.TarError, EOFError) as e:
        raise ValueError(f"{archive} is not a readable tar archive ({e})") from None
    return dest / folder


# ----------------------------------------------------------------------------------------------
# CIFAR python batches


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
            raise ValueError(f"refusing to unpickle {module}.{name}: CIFAR batch files may only hold numpy "
                             "arrays, lists, dicts, numbers and strings") from None


def _read_batch(data: bytes, what: str) -> dict[str, Any]:
    """A CIFAR batch file's dict with str keys, read by the restricted unpickler."""
    try:
        obj = _NumpyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any other failure means a broken file
        raise ValueError(f"{what} is not a readable CIFAR batch file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a CIFAR batch file: it holds a {type(obj).__name__}, not a dict")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _cifar_variant(folder: Path) -> tuple[str, Path] | None:
    """('cifar10' or 'cifar100', batches folder) when ``folder`` is or holds a CIFAR batches folder."""
    for variant, remote in CIFAR_REMOTES.items():
        layout = _CIFAR_LAYOUTS[variant]
        for cand in (folder, folder / remote.folder):
            if all((cand / f).is_file() for f in (layout.meta, *layout.train, *layout.test)):
                return variant, cand
    return None


def _load_cifar(variant: str, read: Callable[[str], bytes],
                where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """(train images, train labels, test images, test labels, classes) from CIFAR python batches."""
    layout = _CIFAR_LAYOUTS[variant]
    meta = _read_batch(read(layout.meta), f"{where}/{layout.meta}")
    if layout.names_key not in meta:
        raise ValueError(f"{where}/{layout.meta} has no {layout.names_key!r} entry (keys: {', '.join(meta)})")
    classes = [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in meta[layout.names_key]]

    def split(files: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for f in files:
            what = f"{where}/{f}"
            batch = _read_batch(read(f), what)
            x, y = batch.get("data"), batch.get(layout.labels_key)
            if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
                got = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
                raise ValueError(f"{what}: 'data' must be a uint8 array of shape (N, 3072), got {got}")
            y = np.asarray(y, dtype=np.int64) if y is not None else None
            if y is None or y.shape != (len(x),) or (len(y) and (y.min() < 0 or y.max() >= len(classes))):
                raise ValueError(f"{what}: {layout.labels_key!r} must hold {len(x)} labels in 0..{len(classes) - 1}")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(y)
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    train_x, train_y = split(layout.train)
    test_x, test_y = split(layout.test)
    return train_x, train_y, test_x, test_y, classes


def _find_or_fetch_cifar(variant: str, cache: Path, download: bool, log: Log) -> Path:
    """The batches folder of a built-in CIFAR set under ``cache``, downloaded and extracted on request."""
    remote = CIFAR_REMOTES[variant]
    found = _cifar_variant(cache / remote.folder)
    if found and found[0] == variant:
        return found[1]
    archive = cache / remote.filename
    downloaded = False
    if not archive.is_file():
        if not download:
            raise ValueError(f"{variant} is not in the cache folder: looked for {cache / remote.folder} and "
                             f"{archive}. Pass download=True (CLI: --download) to fetch it from {remote.url}, "
                             f"or give the path of a {remote.folder} folder or of {remote.filename}")
        log(f"downloading {variant} from {remote.url}")
        download_url(remote.url, archive, md5=remote.md5, log=log)
        downloaded = True
    log(f"extracting {archive} into {cache}")
    try:
        folder = _safe_extract(archive, cache, remote.folder)
    finally:
        if downloaded:
            archive.unlink(missing_ok=True)
    found = _cifar_variant(folder)
    if not found or found[0] != variant:
        raise ValueError(f"{archive} does not hold the {variant} batch files in {remote.folder}/")
    return folder


# ----------------------------------------------------------------------------------------------
# image files


def _as_image_mode(img: Image.Image, chans: int) -> Image.Image:
    """``img`` as 8-bit "L" (chans 1) or "RGB" (chans 3): 16-bit and float scaled, alpha composited on black."""
    mode = img.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        a = np.asarray(img).astype(np.float64)
        a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if mode == "F" and lo >= 0 and hi <= 1:
            scale, offset = 255.0, 0.0
        elif mode == "F" and lo >= 0 and hi <= 255:
            scale, offset = 1.0, 0.0
        elif lo >= 0 and hi <= 65535 and mode != "F":
            scale, offset = 255.0 / 65535.0, 0.0  # 16-bit range -> 8-bit
        else:  # values outside any standard range: stretch min..max
            scale, offset = (255.0 / (hi - lo) if hi > lo else 0.0), lo
        img = Image.fromarray(np.clip(np.rint((a - offset) * scale), 0, 255).astype(np.uint8), "L")
    elif mode == "P" or mode == "PA":
        img = img.convert("RGBA" if mode == "PA" or "transparency" in img.info else "RGB")
    elif mode == "1":
        img = img.convert("L")
    if img.mode in ("RGBA", "RGBa", "LA", "La"):
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba).convert("RGB")
    if img.mode not in ("L", "RGB"):  # CMYK, YCbCr, RGBX, HSV, ...
        img = img.convert("RGB")
    target = "L" if chans == 1 else "RGB"
    return img if img.mode == target else img.convert(target)


def _decode(payload: str | bytes, size: tuple[int, int] | None, chans: int) -> np.ndarray:
    """One image file (path or bytes) as a uint8 (H, W, C) array; raises whatever Pillow raises."""
    with Image.open(payload if isinstance(payload, str) else io.BytesIO(payload)) as img:
        img.load()
        if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            img = ImageOps.exif_transpose(img)
        img = _as_image_mode(img, chans)
        if size is not None and img.size != (size[1], size[0]):
            img = img.resize((size[1], size[0]), Image.Resampling.BICUBIC)
        arr = np.asarray(img, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


def _decode_image(payload: str | bytes, size: tuple[int, int] | None, chans: int) -> np.ndarray | None:
    """One image file as a uint8 (H, W, C) array, or None when it cannot be read."""
    try:
        return _decode(payload, size, chans)
    except Exception:  # noqa: BLE001 - any decoder failure means an unreadable file, which is skipped
        return None


def read_image(path: str | os.PathLike, img_size: int | tuple[int, int] | None = None,
               in_chans: int = 3) -> torch.Tensor:
    """One image file as uint8 (C, H, W), converted and resized exactly as load_data does for image folders."""
    size = _check_args(img_size, in_chans, 0.0, 0)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"image {path} does not exist or is not a file")
    try:
        arr = _decode(str(path), size, in_chans)
    except Exception as e:  # noqa: BLE001 - report any decoder failure as an unreadable file
        raise ValueError(f"{path} is not an image Pillow can read ({type(e).__name__}: {e}); accepted: "
                         f"{' '.join(IMAGE_EXTENSIONS)}") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def _decode_chunk(job: tuple[list[str | bytes], tuple[int, int] | None, int]) -> list[np.ndarray | None]:
    payloads, size, chans = job
    return [_decode_image(p, size, chans) for p in payloads]


class _Decoder:
    """Decodes image files (paths or bytes) into uint8 (H, W, C) arrays, keyed and in order.

    Files are decoded in worker processes once there are many (while the caller goes on reading
    the next ones), else in this process when ``results`` is asked for.
    """

    def __init__(self, size: tuple[int, int] | None, chans: int, desc: str):
        self.size, self.chans, self.desc = size, chans, desc
        self.workers = min(os.cpu_count() or 1, _MAX_WORKERS)
        self.keys: list[Any] = []
        self.pending: list[str | bytes] = []
        self.jobs: list[Future | tuple] = []
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Decoder:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def add(self, key: Any, payload: str | bytes) -> None:
        self.keys.append(key)
        self.pending.append(payload)
        if self.pool is None and self.workers > 1 and len(self.keys) >= _POOL_MIN:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self.pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context(method))
        if len(self.pending) >= _CHUNK and (self.pool is not None or self.workers == 1):
            self._submit()

    def _submit(self) -> None:
        for i in range(0, len(self.pending), _CHUNK):
            job = (self.pending[i:i + _CHUNK], self.size, self.chans)
            self.jobs.append(self.pool.submit(_decode_chunk, job) if self.pool is not None else job)
        self.pending = []

    def results(self) -> dict[Any, np.ndarray | None]:
        """Key -> decoded array, or None for a file that could not be read."""
        self._submit()
        out: list[np.ndarray | None] = []
        n = len(self.keys)
        with tqdm(total=n, desc=self.desc, unit="img", disable=n < _PROGRESS_MIN, file=sys.stderr) as bar:
            for job in self.jobs:
                res = job.result() if isinstance(job, Future) else _decode_chunk(job)
                out.extend(res)
                bar.update(len(res))
        return dict(zip(self.keys, out))


@dataclass
class _Tree:
    """The image files and folders of a source, by relative path parts."""

    where: str  # the folder or archive, for messages
    files: dict[tuple[str, ...], str | bytes] = field(default_factory=dict)  # -> file path, or its bytes
    dirs: set[tuple[str, ...]] = field(default_factory=set)
    prefix: tuple[str, ...] = ()  # the wrapper folders stepped into (see _unwrap)

    def add_file(self, parts: tuple[str, ...], payload: str | bytes) -> None:
        self.files[parts] = payload
        self.dirs.update(parts[:i] for i in range(1, len(parts)))

    def describe(self, parts: tuple[str, ...]) -> str:
        return "/".join((self.where, *parts))


def _hidden(name: str) -> bool:
    return name.startswith(".") or name == "__MACOSX"


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _walk(root: Path):
    """os.walk over ``root`` with hidden entries skipped and symlinked folders followed at most once."""
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not _hidden(d))
        yield dirpath, dirnames, sorted(f for f in filenames if not _hidden(f))


def _scan_folder(root: Path) -> _Tree:
    """The image files and folders under ``root``."""
    tree = _Tree(str(root))
    for dirpath, dirnames, filenames in _walk(root):
        rel = Path(dirpath).relative_to(root).parts
        tree.dirs.update((*rel, d) for d in dirnames)
        for f in filenames:
            if _is_image_name(f):
                tree.add_file((*rel, f), os.path.join(dirpath, f))
    return tree


def _read_archive(path: Path, decoder: _Decoder) -> _Tree:
    """The tree of a tar archive; image members go to ``decoder``, CIFAR batch files are kept as bytes."""
    tree = _Tree(str(path))
    size = path.stat().st_size
    try:
        with open(path, "rb") as raw, tqdm.wrapattr(raw, "read", total=size, desc=f"reading {path.name}",
                                                    disable=size < _PROGRESS_MIN_BYTES, file=sys.stderr) as f:
            with tarfile.open(fileobj=f, mode="r|*") as tf:
                for member in tf:
                    _check_member(member, path)
                    parts = _member_parts(member.name)
                    if not parts or any(_hidden(p) for p in parts):
                        continue
                    if member.isdir():
                        tree.dirs.update(parts[:i] for i in range(1, len(parts) + 1))
                    elif _is_image_name(parts[-1]):
                        decoder.add(parts, tf.extractfile(member).read())
                        tree.add_file(parts, b"")
                    elif parts[-1] in _CIFAR_FILE_NAMES:
                        tree.add_file(parts, tf.extractfile(member).read())
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        raise ValueError(f"{path} is not a readable tar archive ({type(e).__name__}: {e})") from None
    return tree


def _cifar_in_tree(tree: _Tree) -> tuple[str, tuple[str, ...]] | None:
    """('cifar10' or 'cifar100', folder parts) when the archive holds CIFAR batch files."""
    for parts in sorted(tree.files, key=len):
        for variant, layout in _CIFAR_LAYOUTS.items():
            if parts[-1] == layout.meta:
                folder = parts[:-1]
                if all((*folder, f) in tree.files for f in (*layout.train, *layout.test)):
                    return variant, folder
    return None


def _unwrap(tree: _Tree) -> _Tree:
    """Step into a single top-level folder that wraps the layout (e.g. ``cifar10/train/...``)."""
    while True:
        tops = {p[0] for p in tree.files} | {d[0] for d in tree.dirs}
        if len(tops) != 1 or next(iter(tops)) in _SPLIT_DIRS or any(len(p) < 3 for p in tree.files):
            return tree
        top = next(iter(tops))
        inner = _Tree(tree.describe((top,)), prefix=(*tree.prefix, top))
        inner.files = {p[1:]: v for p, v in tree.files.items()}
        inner.dirs = {d[1:] for d in tree.dirs if len(d) > 1}
        tree = inner


_LAYOUT_HELP = ("expected <root>/<class>/<image> (split into train/test with val_fraction) or "
                "<root>/train/<class>/<image> with <root>/test/<class>/<image> or <root>/val/<class>/<image>")


def _classes_under(tree: _Tree, root: tuple[str, ...]) -> dict[str, list[tuple[str, ...]]]:
    """Class name -> sorted image paths for the class folders right under ``root``."""
    n = len(root)
    classes = sorted({d[n] for d in tree.dirs if len(d) > n and d[:n] == root})
    if not classes:
        raise ValueError(f"{tree.describe(root)} has no class sub-folders; {_LAYOUT_HELP}")
    by_class: dict[str, list[tuple[str, ...]]] = {c: [] for c in classes}
    for p in sorted(tree.files):
        if len(p) > n + 1 and p[:n] == root:
            by_class[p[n]].append(p)
    for c, paths in by_class.items():
        if not paths:
            raise ValueError(f"class folder {tree.describe((*root, c))} holds no images "
                             f"(accepted extensions: {' '.join(IMAGE_EXTENSIONS)})")
    return by_class


def _layout(tree: _Tree, log: Log) -> tuple[dict[str, list], dict[str, list] | None]:
    """(train class -> files, test class -> files or None when the train files must be split)."""
    if not tree.files:
        raise ValueError(f"no images found in {tree.where} (accepted extensions: {' '.join(IMAGE_EXTENSIONS)}); "
                         f"{_LAYOUT_HELP}")
    tops = {d[0] for d in tree.dirs}
    if "train" not in tops:
        return _classes_under(tree, ()), None
    train = _classes_under(tree, ("train",))
    test_dir = "test" if "test" in tops else "val" if "val" in tops else None
    if test_dir is None:
        log(f"{tree.where} has train/ but no test/ or val/: holding out a part of train/ as the test split")
        return train, None
    test = _classes_under(tree, (test_dir,))
    extra = sorted(set(test) - set(train))
    if extra:
        raise ValueError(f"{tree.describe((test_dir,))} has class folders that {tree.describe(('train',))} lacks: "
                         f"{', '.join(extra)}; the train classes are {', '.join(train)}")
    if test_dir == "val":
        log(f"{tree.where}: using val/ as the test split")
    return train, test


def _resize_array(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    img = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    out = np.asarray(img.resize((size[1], size[0]), Image.Resampling.BICUBIC), dtype=np.uint8)
    return out[:, :, None] if out.ndim == 2 else out


def _stack(arrays: list[np.ndarray], shape: tuple[int, int, int]) -> torch.Tensor:
    """(N, C, H, W) uint8 from (H, W, C) arrays; ``shape`` is (H, W, C) for an empty list."""
    if not arrays:
        return torch.empty((0, shape[2], shape[0], shape[1]), dtype=torch.uint8)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _load_tree(tree: _Tree, name: str, size: tuple[int, int] | None, chans: int, log: Log,
               decoded: dict[Any, np.ndarray | None] | None = None) -> tuple:
    """(train images, train labels, test images or None, test labels or None, classes, skipped) of an image tree.

    ``decoded`` holds the arrays of an archive's images, decoded while it was read; a folder's
    images are decoded here, the files of the layout only.
    """
    tree = _unwrap(tree)
    train_files, test_files = _layout(tree, log)
    classes = list(train_files)
    index = {c: i for i, c in enumerate(classes)}
    items = [(p, index[c]) for c, paths in train_files.items() for p in paths]
    n_train = len(items)
    for c, paths in (test_files or {}).items():
        items += [(p, index[c]) for p in paths]

    if decoded is None:
        with _Decoder(size, chans, f"decoding {name}") as decoder:
            for p, _ in items:
                decoder.add((*tree.prefix, *p), tree.files[p])
            decoded = decoder.results()
    arrays = [decoded[(*tree.prefix, *p)] for p, _ in items]
    bad = ["/".join(p) for (p, _), a in zip(items, arrays) if a is None]
    if bad:
        log(f"skipped {len(bad)} unreadable files, e.g.: {', '.join(bad[:5])}")
    good = [a for a in arrays if a is not None]
    if not any(a is not None for a in arrays[:n_train]):
        raise ValueError(f"none of the {n_train} training images in {tree.where} could be read")
    if size is None:
        counts = Counter(a.shape[:2] for a in good)
        size = counts.most_common(1)[0][0]
        if len(counts) > 1:
            n_off = sum(n for s, n in counts.items() if s != size)
            log(f"images come in {len(counts)} sizes: resized {n_off} of them to the most common, "
                f"{size[0]}x{size[1]} (pass img_size to choose)")
            arrays = [a if a is None or a.shape[:2] == size else _resize_array(a, size) for a in arrays]
    shape = (size[0], size[1], chans)
    labels = np.array([y for _, y in items], dtype=np.int64)
    keep = np.array([a is not None for a in arrays], dtype=bool)
    tr = np.flatnonzero(keep[:n_train])
    train_x = _stack([arrays[i] for i in tr], shape)
    train_y = torch.from_numpy(labels[tr])
    if test_files is None:
        return train_x, train_y, None, None, classes, len(bad)
    te = n_train + np.flatnonzero(keep[n_train:])
    return train_x, train_y, _stack([arrays[i] for i in te], shape), torch.from_numpy(labels[te]), classes, len(bad)


# ----------------------------------------------------------------------------------------------
# tensors: channels, size, split, statistics


def _match_channels(images: torch.Tensor, chans: int) -> torch.Tensor:
    """(N, C, H, W) uint8 with C made ``chans``: gray replicated, RGB -> gray by ITU-R 601 luma (as Pillow)."""
    c = images.shape[1]
    if c == chans:
        return images
    if c == 1:
        return images.expand(-1, chans, -1, -1).contiguous()
    if c == 3 and chans == 1:
        w = torch.tensor([299, 587, 114], dtype=torch.int32).view(1, 3, 1, 1)
        parts = [((x.to(torch.int32) * w).sum(1, keepdim=True) + 500) // 1000 for x in images.split(4096)]
        return torch.cat(parts).to(torch.uint8)
    raise ValueError(f"cannot turn {c}-channel images into {chans} channels")


def _resize_tensor(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(N, C, H, W) uint8 resized to ``size`` (bicubic, antialiased when reducing)."""
    if len(images) == 0:
        return images.new_empty((0, images.shape[1], *size))
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    out = []
    for x in images.split(1024):
        y = F.interpolate(x.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
        out.append(y.round_().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out).contiguous()


def _stratified_split(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, test indices): ceil(N * fraction) held out, shared among classes by their size.

    Every class with two or more images keeps at least one in each split (when fraction > 0).
    """
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    classes, counts = np.unique(y, return_counts=True)
    n_test = int(np.ceil(len(y) * fraction))
    quota = counts * n_test / max(len(y), 1)
    k = np.floor(quota).astype(np.int64)
    k[np.argsort(-(quota - k), kind="stable")[: n_test - int(k.sum())]] += 1  # largest remainders
    if fraction > 0:
        k = np.where(counts > 1, np.clip(k, 1, counts - 1), 0)
    train, test = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for c, kc in zip(classes, k):
        idx = rng.permutation(np.flatnonzero(y == c))
        test.append(idx[:kc])
        train.append(idx[kc:])
    return (torch.from_numpy(np.sort(np.concatenate(train))).long(),
            torch.from_numpy(np.sort(np.concatenate(test))).long())


def _mean_std(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 images, in [0, 1], exact via a 256-bin histogram."""
    values = torch.arange(256, dtype=torch.float64) / 255.0
    means, stds = [], []
    for c in range(images.shape[1]):
        hist = torch.bincount(images[:, c].reshape(-1), minlength=256).to(torch.float64)
        n = hist.sum().clamp_min(1)
        m = (hist * values).sum() / n
        var = ((hist * (values - m) ** 2).sum() / n).clamp_min(0)
        means.append(float(m))
        stds.append(float(var.sqrt()))
    return tuple(means), tuple(stds)


# ----------------------------------------------------------------------------------------------
# the cache


def _fingerprint(path: Path) -> Any:
    """What identifies a source's content cheaply: sizes and mtimes of its files."""
    if path.is_file():
        st = path.stat()
        return [st.st_size, st.st_mtime_ns]
    entries = []
    for dirpath, _, filenames in _walk(path):
        for f in filenames:
            full = os.path.join(dirpath, f)
            try:
                st = os.stat(full)
            except OSError:
                continue
            entries.append([os.path.relpath(full, path), st.st_size, st.st_mtime_ns])
    return entries


def _cache_key(*parts: Any) -> str:
    blob = json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "data"


def _read_bundle(path: Path) -> DataBundle:
    """A bundle from a cache file; raises on anything missing or inconsistent."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["vitlab"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != CACHE_VERSION:
        raise ValueError(f"cache format {meta.get('format')}, expected {CACHE_VERSION}")
    sets = []
    for split in ("train", "test"):
        x, y = t[f"{split}_images"], t[f"{split}_labels"]
        if x.dtype != torch.uint8 or x.ndim != 4 or y.dtype != torch.int64 or y.shape != (len(x),):
            raise ValueError(f"{split} tensors have the wrong dtype or shape")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= len(meta["classes"])):
            raise ValueError(f"{split} labels out of range")
        sets.append(ImageSet(x.contiguous(), y))
    return DataBundle(meta["name"], sets[0], sets[1], list(meta["classes"]), tuple(meta["mean"]),
                      tuple(meta["std"]), int(meta["skipped"]), meta["source"])


def _write_bundle(bundle: DataBundle, path: Path) -> None:
    """Save a bundle to one safetensors file, atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"train_images": bundle.train.images, "train_labels": bundle.train.labels,
               "test_images": bundle.test.images, "test_labels": bundle.test.labels}
    meta = {"format": CACHE_VERSION, "name": bundle.name, "classes": bundle.classes, "mean": list(bundle.mean),
            "std": list(bundle.std), "skipped": bundle.skipped, "source": bundle.source}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"vitlab": json.dumps(meta)})


def _find_cached(cache: Path, keys: list[str], log: Log) -> tuple[DataBundle, Path] | None:
    if not cache.is_dir():
        return None
    for key in keys:
        for path in sorted(cache.glob(f"*-{key}.safetensors")):
            try:
                return _read_bundle(path), path
            except Exception as e:  # noqa: BLE001 - a cache file that cannot be read is rebuilt
                log(f"cache file {path} is unreadable ({type(e).__name__}: {e}); rebuilding it")
                path.unlink(missing_ok=True)
    return None


# ----------------------------------------------------------------------------------------------
# load_data


def _check_args(img_size: Any, in_chans: Any, val_fraction: Any, seed: Any) -> tuple[int, int] | None:
    size = None
    if img_size is not None:
        if isinstance(img_size, int) and not isinstance(img_size, bool):
            size = (img_size, img_size)
        elif (isinstance(img_size, (tuple, list)) and len(img_size) == 2
              and all(isinstance(s, int) and not isinstance(s, bool) for s in img_size)):
            size = (int(img_size[0]), int(img_size[1]))
        if size is None or min(size) < 1:
            raise ValueError(f"img_size must be a positive int or a (height, width) pair of them, got {img_size!r}")
    if in_chans not in (None, 1, 3) or isinstance(in_chans, bool):
        raise ValueError(f"in_chans must be 1 (grayscale), 3 (RGB) or None (the source's own), got {in_chans!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return size


def _load_digits() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """scikit-learn's 8x8 digits as uint8 (N, 1, 8, 8) images (0..16 scaled to 0..255) and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.rint(d.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return torch.from_numpy(x).unsqueeze(1).contiguous(), torch.from_numpy(d.target.astype(np.int64)), \
        [str(i) for i in range(10)]


def load_data(source: str | os.PathLike = "digits", *, img_size: int | tuple[int, int] | None = None,
              in_chans: int | None = None, cache_dir: str | os.PathLike | None = None, download: bool = False,
              val_fraction: float = 0.2, seed: int = 0, log: Log = print) -> DataBundle:
    """A data set as uint8 tensors: a built-in name (see DATASETS), an image folder, or a tar archive of one."""
    size = _check_args(img_size, in_chans, val_fraction, seed)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    source = os.fspath(source)

    # what it is, and what identifies its content
    path: Path | None = None
    cifar: tuple[str, Path] | None = None
    if source == "digits":
        kind, name, origin, ident = "digits", "digits", "sklearn.datasets.load_digits", ["digits"]
    elif source in CIFAR_REMOTES:
        cifar = (source, _find_or_fetch_cifar(source, cache, download, log))
        kind, name, origin = "cifar", source, str(cifar[1])
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"data source {source!r} is neither a built-in data set ({', '.join(DATASETS)}) "
                             "nor an existing image folder or archive")
        path = path.resolve()
        origin = str(path)
        if path.is_dir():
            cifar = _cifar_variant(path)
            kind, name = ("cifar", cifar[0]) if cifar else ("folder", path.name)
        elif _is_archive(path):
            kind, name = "archive", _archive_stem(path)
        else:
            raise ValueError(f"{path} is a file but not a tar archive ({' '.join(ARCHIVE_SUFFIXES)}); give a "
                             f"folder of images, an archive of one, or a built-in name ({', '.join(DATASETS)})")
    if kind == "cifar":
        ident = [str(cifar[1]), _fingerprint(cifar[1])]
    elif kind != "digits":
        ident = [str(path), _fingerprint(path)]
    # a source with its own test split is cached under a key without val_fraction and seed
    base = [kind, ident, list(size) if size else None, in_chans]
    keys = [_cache_key(*base), _cache_key(*base, float(val_fraction), seed)]

    t0 = time.perf_counter()
    hit = _find_cached(cache, keys, log)
    if hit is not None:
        bundle, cache_file = hit
        how = f"from cache {cache_file} in {time.perf_counter() - t0:.2f} s"
    else:
        bundle, split = _build(kind, name, origin, path, cifar, size, in_chans, val_fraction, seed, log)
        cache_file = cache / f"{_safe_name(bundle.name)}-{keys[1] if split else keys[0]}.safetensors"
        how = f"decoded from {origin} in {time.perf_counter() - t0:.1f} s"
        try:
            _write_bundle(bundle, cache_file)
            how += f", cached to {cache_file}"
        except OSError as e:
            how += f", not cached ({e})"
    c, h, w = bundle.train.images.shape[1:]
    skipped = f", {bundle.skipped} unreadable files skipped" if bundle.skipped else ""
    log(f"{bundle.name}: {len(bundle.train.labels)} train / {len(bundle.test.labels)} test images, {c}x{h}x{w}, "
        f"{len(bundle.classes)} classes{skipped} ({how})")
    return bundle


def _build(kind: str, name: str, origin: str, path: Path | None, cifar: tuple[str, Path] | None,
           size: tuple[int, int] | None, in_chans: int | None, val_fraction: float, seed: int,
           log: Log) -> tuple[DataBundle, bool]:
    """Decode a source into a bundle; also says whether a held-out split was drawn (val_fraction, seed)."""
    skipped = 0
    test_x = test_y = None
    if kind == "digits":
        train_x, train_y, classes = _load_digits()
    elif kind == "cifar":
        variant, folder = cifar
        train_x, train_y, test_x, test_y, classes = _load_cifar(variant, lambda f: (folder / f).read_bytes(),
                                                                str(folder))
        name = variant
    else:
        chans = in_chans or 3
        decoded = None
        if kind == "folder":
            tree = _scan_folder(path)
        else:
            with _Decoder(size, chans, f"decoding {name}") as decoder:
                tree = _read_archive(path, decoder)
                decoded = decoder.results()
        found = _cifar_in_tree(tree) if kind == "archive" else None
        if found:
            variant, folder = found
            train_x, train_y, test_x, test_y, classes = _load_cifar(
                variant, lambda f: tree.files[(*folder, f)], tree.describe(folder))
            name = variant
        else:
            train_x, train_y, test_x, test_y, classes, skipped = _load_tree(tree, name, size, chans, log, decoded)
    # tensor sources: channels and size; image trees come out of the decoder right already
    chans = in_chans or (1 if kind == "digits" else 3)
    parts = [(train_x, train_y)] + ([(test_x, test_y)] if test_x is not None else [])
    parts = [(_resize_tensor(_match_channels(x, chans), size) if size else _match_channels(x, chans), y)
             for x, y in parts]
    (train_x, train_y), split = parts[0], test_x is None
    if split:
        tr, te = _stratified_split(train_y, val_fraction, seed)
        test_x, test_y = train_x[te].contiguous(), train_y[te]
        train_x, train_y = train_x[tr].contiguous(), train_y[tr]
    else:
        test_x, test_y = parts[1]
    mean, std = _mean_std(train_x)
    bundle = DataBundle(name, ImageSet(train_x.contiguous(), train_y.contiguous()),
                        ImageSet(test_x.contiguous(), test_y.contiguous()), classes, mean, std, skipped, origin)
    return bundle, split
