"""Data sets as uint8 tensors mapped from an on-disk store: ``load_data`` and what it returns.

``load_data`` takes a built-in name (``digits``, embedded; ``cifar10``/``cifar100``, the official
python batches, downloaded on request), a folder of images (``root/<class>/*`` or
``root/train/<class>/*`` with ``root/test`` or ``root/val``), a tar archive of such a folder, a
CIFAR batches folder/archive, Hugging Face image-classification Parquet files (a file or a
folder), a CSV/TSV file of ``path,label`` lines, or a store folder itself. The source is decoded
once into a store in the cache folder (see ``store``); every later run, and every process of a
run, maps that store instead of decoding again.

Images are stored at ``img_size`` (resized whole, as for CIFAR-like sets), or with ``store_size``
at that size for their shorter side, centre-cropped to a square; training then crops ``img_size``
from them (``BatchAugment`` with crop='rrc') and evaluation uses ``eval_view``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..atomic import DiskFullError
from ..errors import VitlabError, not_a_file
from ..progress import progress_bar
from .cache import (
    CACHE_VERSION,
    cache_key,
    default_cache_dir,
    files_fingerprint,
    identity_digest,
    settle,
    source_identity,
)
from .cifar import CIFAR_REMOTES, cifar_variant, find_or_fetch_cifar, load_cifar
from .decode import Payload, decode_into, default_workers, image_size, read_image, too_large
from .disk import DISK_FULL, check_writable, disk_usage, format_size, free_bytes, space_message
from .download import ARCHIVE_SUFFIXES, Log, archive_stem, download_url, is_archive
from .scan import UNLABELLED, cifar_in_tree, read_archive, scan_folder, tree_items
from .shards import (
    Piece,
    ShardSet,
    decode_sample,
    first_images,
    folder_patterns,
    image_bytes,
    is_shard_source,
    label_of,
    open_shards,
    read_piece,
)
from .store import Store, build_store, is_store, mean_std, open_store, store_needs
from .tables import TABLE_SUFFIXES, Listing, list_parquet, list_table, parquet_files
from .views import eval_view, parse_fit

__all__ = ["DATASETS", "DataBundle", "ImageSet", "default_cache_dir", "download_url", "load_data", "read_image"]

DATASETS = ("digits", "cifar10", "cifar100")
MIN_STD = 1 / 255  # a channel's std below one grey level: the channel is constant, normalised by 1


@dataclass
class ImageSet:
    """Images and their labels: uint8 (N, C, H, W), contiguous (usually mapped from a store), and int64 (N,)."""

    images: torch.Tensor
    labels: torch.Tensor


@dataclass
class DataBundle:
    """A train split and a test split with class names and the train images' channel statistics.

    The images are stored at ``stored_size``; ``img_size`` is the size to train and evaluate at
    (the same unless ``store_size`` was given to load_data).
    """

    name: str
    train: ImageSet
    test: ImageSet
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    skipped: int = 0
    source: str = ""
    img_size: tuple[int, int] | None = None  # the training size; None: the stored size
    store: Path | None = None  # the store folder the images are mapped from
    identity: dict[str, Any] | None = None  # what the data is and how it is split (``data_identity``)
    unreadable: list[str] = field(default_factory=list)  # the source's files that could not be read (skipped)
    shards: ShardSet | None = None  # training shards streamed while training: ``train`` then holds their first images

    @property
    def num_train(self) -> int:
        """The training images an epoch goes through (all of them, also where they are streamed from shards)."""
        return self.shards.count if self.shards is not None else len(self.train.images)

    def __post_init__(self) -> None:
        if self.img_size is None:
            self.img_size = self.stored_size

    @property
    def unlabelled(self) -> bool:
        """A flat folder of images (no class folders): for self-supervised pre-training only."""
        return self.classes == [UNLABELLED]

    @property
    def stored_size(self) -> tuple[int, int]:
        """(H, W) of the stored images."""
        return tuple(self.train.images.shape[-2:])


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
    raise VitlabError(f"cannot turn {c}-channel images into {chans} channels")


def _resize_tensor(images: torch.Tensor, size: tuple[int, int], fit: str = "squash") -> torch.Tensor:
    """(N, C, H, W) uint8 brought to ``size`` by ``fit`` (squash: bicubic, antialiased when reducing; or a
    ``views.Preprocess.fit``)."""
    if len(images) == 0:
        return images.new_empty((0, images.shape[1], *size))
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    if fit not in ("squash", "crop"):
        mode, pct, interpolation, offset = parse_fit(fit)
        return torch.cat([eval_view(x, size, pct, interpolation, mode, offset) for x in images.split(1024)])
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


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "data"


def _check_args(img_size: Any, in_chans: Any, val_fraction: Any, seed: Any) -> tuple[int, int] | None:
    size = None
    if img_size is not None:
        if isinstance(img_size, int) and not isinstance(img_size, bool):
            size = (img_size, img_size)
        elif (isinstance(img_size, (tuple, list)) and len(img_size) == 2
              and all(isinstance(s, int) and not isinstance(s, bool) for s in img_size)):
            size = (int(img_size[0]), int(img_size[1]))
        if size is None or min(size) < 1:
            raise VitlabError(f"img_size must be a positive int or a (height, width) pair of them, got {img_size!r}")
    if in_chans not in (None, 1, 3) or isinstance(in_chans, bool):
        raise VitlabError(f"in_chans must be 1 (grayscale), 3 (RGB) or None (the source's own), got {in_chans!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise VitlabError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise VitlabError(f"seed must be an int, got {seed!r}")
    return size




def _check_more(store_size: Any, workers: Any, size: tuple[int, int] | None) -> None:
    if store_size is not None and (isinstance(store_size, bool) or not isinstance(store_size, int) or store_size < 1):
        raise VitlabError(f"store_size must be a positive int (the stored images' side) or None, got {store_size!r}")
    if store_size is not None and size is not None and store_size < max(size):
        raise VitlabError(f"store_size {store_size} is smaller than the training size {size[0]}x{size[1]}: training "
                          f"crops that size from the stored images; accepted: a store_size of {max(size)} or more")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise VitlabError(f"workers must be a positive int (decoding processes) or None (one per CPU), got {workers!r}")


def _load_digits() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The embedded 8x8 digits as uint8 (N, 1, 8, 8) images (0..16 scaled to 0..255) and labels."""
    with np.load(Path(__file__).with_name("digits.npz"), allow_pickle=False) as z:
        images, labels = z["images"], z["labels"]
    x = np.rint(images.astype(np.float64) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return torch.from_numpy(x).unsqueeze(1).contiguous(), torch.from_numpy(labels.astype(np.int64)), \
        [str(i) for i in range(10)]


@dataclass
class _Source:
    kind: str  # digits, cifar, folder, archive, parquet, table, store
    name: str
    origin: str
    path: Path | None = None
    cifar: tuple[str, Path] | None = None


def _resolve(source: str, cache: Path, download: bool, log: Log) -> _Source:
    """What a source string names."""
    if source == "digits":
        return _Source("digits", "digits", "the embedded UCI digits (digits.npz)")
    if source in CIFAR_REMOTES:
        folder = find_or_fetch_cifar(source, cache, download, log)
        return _Source("cifar", source, str(folder), cifar=(source, folder))
    path = Path(source).expanduser()
    if not path.exists():
        if path.is_symlink():
            raise not_a_file(path, "data source", "an image folder, archive, Parquet or CSV/TSV file, or a link to one")
        where = "" if path.is_absolute() else f" (read from the current folder, {os.getcwd()})"
        raise VitlabError(f"data source {source!r}{where} is neither a built-in data set ({', '.join(DATASETS)}) "
                          "nor an existing image folder, archive, Parquet or CSV/TSV file, or store folder")
    path = path.resolve()
    if path.is_dir():
        if is_store(path):
            return _Source("store", path.name, str(path), path)
        cifar = cifar_variant(path)
        if cifar:
            return _Source("cifar", cifar[0], str(path), path, cifar)
        if parquet_files(path):
            return _Source("parquet", path.name, str(path), path)
        return _Source("folder", path.name, str(path), path)
    lower = path.name.lower()
    if is_archive(path):
        return _Source("archive", archive_stem(path), str(path), path)
    if lower.endswith(".parquet"):
        return _Source("parquet", path.stem, str(path), path)
    if lower.endswith(TABLE_SUFFIXES):
        return _Source("table", path.stem, str(path), path)
    raise VitlabError(f"{path} is a file but not a tar archive ({' '.join(ARCHIVE_SUFFIXES)}), a .parquet file or "
                      f"a {'/'.join(TABLE_SUFFIXES)} list; give one of those, a folder of images, or a built-in name "
                      f"({', '.join(DATASETS)})")


def load_data(source: str | os.PathLike = "digits", *, img_size: int | tuple[int, int] | None = None,
              in_chans: int | None = None, cache_dir: str | os.PathLike | None = None, download: bool = False,
              val_fraction: float = 0.2, seed: int = 0, log: Log = print, store_size: int | None = None,
              workers: int | None = None, fit: str | None = None, test_data: str | None = None) -> DataBundle:
    """A data set as uint8 tensors mapped from its store (built on first use): a built-in name (see DATASETS),
    an image folder, a tar archive of one, Parquet files, a CSV/TSV list, or a store folder.

    ``img_size`` is the size to train at; the images are stored at that size, or with ``store_size``
    at that side (shorter side resized, centre square kept). ``workers`` processes decode images. ``fit`` (a
    ``views.Preprocess.fit``) brings images to ``img_size`` by a model's own rule instead of squashing them.
    WebDataset shards (``shards.is_shard_source``) are streamed while training: their test split (``test_data``, or
    a ``wds:`` folder's test shards) is decoded into a store, their training images are not.
    """
    size = _check_args(img_size, in_chans, val_fraction, seed)
    _check_more(store_size, workers, size)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if is_shard_source(os.fspath(source)):
        fit = "crop" if store_size else fit or "squash"
        stored = (store_size, store_size) if store_size else size
        return _load_shards(os.fspath(source), test_data, _Decoding(stored, in_chans or 3, fit, size, workers),
                            cache, log)
    if test_data is not None:
        raise VitlabError(f"--test-data {test_data} goes with a shard source (a pattern such as "
                          f"DIR/train-{{000000..000009}}.tar); {source} holds its own test split or is split by "
                          "val_fraction")
    src = _resolve(os.fspath(source), cache, download, log)
    t0 = time.perf_counter()
    if src.kind == "store":
        store = open_store(src.path)
        if in_chans is not None and store.images.shape[1] != in_chans:
            raise VitlabError(f"{src.path} holds {store.images.shape[1]}-channel images, in_chans={in_chans} was asked")
        return _bundle(store, size, f"from store {src.path} in {time.perf_counter() - t0:.2f} s", log)

    listing = list_table(src.path, log) if src.kind == "table" else None
    where = str(src.cifar[1] if src.kind == "cifar" else src.path or "")
    ident: Any = ["digits"] if src.kind == "digits" else source_identity(src.kind, where, listing)
    fit = "crop" if store_size else fit or "squash"
    stored = (store_size, store_size) if store_size else size
    # a source with its own test split is stored under a key without val_fraction and seed
    base = [src.kind, ident, list(stored) if stored else None, fit, in_chans]
    keys = [cache_key(*base), cache_key(*base, float(val_fraction), seed)]
    train_size = size if store_size else None

    for key in keys:
        for path in sorted(cache.glob(f"*-{key}")) if cache.is_dir() else []:
            if not is_store(path):
                continue
            try:
                store = open_store(path, key)
            except ValueError as e:
                log(f"{e}; rebuilding it")
                continue
            return _bundle(store, train_size, f"from cache {path} in {time.perf_counter() - t0:.2f} s", log,
                           val_fraction)

    header = {"name": src.name, "source": src.origin, "kind": src.kind, "fit": fit,
              "fingerprint": identity_digest(ident), "fingerprint_of": where, "cache_version": CACHE_VERSION}
    settle(ident)  # what is read from here on is what the fingerprint stands for
    store = _build(src, header, keys, cache, stored, fit, in_chans, val_fraction, seed, workers, log, listing)
    how = f"decoded from {src.origin} in {time.perf_counter() - t0:.1f} s, stored in {store.path}"
    return _bundle(store, train_size, how, log, val_fraction)


def _usable_std(std: list[float], log: Log) -> tuple[float, ...]:
    """The channels' std to normalise with: a channel that (almost) never varies is divided by 1, not by ~0."""
    flat = [k for k, v in enumerate(std) if not v >= MIN_STD]
    if flat:
        log(f"channel{'s' if len(flat) > 1 else ''} {', '.join(map(str, flat))} of the training images "
            f"{'are' if len(flat) > 1 else 'is'} constant (std below 1/255): normalised by 1 instead of "
            f"{', '.join(f'{std[k]:.3g}' for k in flat)}")
    return tuple(1.0 if k in flat else float(v) for k, v in enumerate(std))


def printable(name: str) -> str:
    """A file name as text that every writer takes: the bytes of a name that is not UTF-8 (Python keeps them as lone
    surrogates, which figures, YAML and UTF-8 files refuse) written as \\xNN escapes."""
    try:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return name.encode("utf-8", "backslashreplace").decode()


def _check_no_empty_class(store: Store) -> None:
    """Refuse a labelled source with a class none of whose images could be read: it would train as a class that
    no image teaches and no test image checks."""
    classes, listed = store.header["classes"], store.header.get("listed_per_class") or []
    counts = np.bincount(np.asarray(store.labels), minlength=len(classes))
    empty = [classes[k] for k, n in enumerate(listed[:len(classes)]) if n > 0 and counts[k] == 0]
    if empty:
        seen = store.header.get("unreadable", [])
        eg = f" (unreadable: {', '.join(map(str, seen[:3]))}{', ...' if len(seen) > 3 else ''})" if seen else ""
        raise VitlabError(f"{store.header['source']}: class{'es' if len(empty) > 1 else ''} "
                          f"{', '.join(map(repr, empty))} {'have' if len(empty) > 1 else 'has'} no readable image"
                          f"{eg}; fix the files or remove the class")


def _bundle(store: Store, img_size: tuple[int, int] | None, how: str, log: Log,
            val_fraction: float | None = None) -> DataBundle:
    """A bundle over an opened store, and the line that says what was loaded."""
    h = store.header
    bundle = DataBundle(h["name"], ImageSet(*store.split("train")), ImageSet(*store.split("test")),
                        [printable(c) for c in h["classes"]],
                        tuple(h["mean"]), _usable_std(h["std"], log), len(h.get("unreadable_rows", [])), h["source"],
                        img_size, store.path, data_identity(store),
                        [printable(str(n)) for n in h.get("unreadable", [])])
    _check_no_empty_class(store)
    c, sh, sw = store.images.shape[1:]
    train_at = f", training at {bundle.img_size[0]}x{bundle.img_size[1]}" if bundle.img_size != (sh, sw) else ""
    skipped = f", {bundle.skipped} unreadable files skipped" if bundle.skipped else ""
    if len(bundle.classes) == 1 and not bundle.unlabelled:
        log(f"warning: {bundle.name} has one class ({bundle.classes[0]!r}): every prediction is right, so its "
            "accuracy says nothing; a classifier needs two or more")
    if len(bundle.test.labels) == 0:
        why = ("val_fraction 0 holds out nothing" if val_fraction == 0 else
               f"val_fraction {val_fraction:g} holds out no image of a class of one image, which stays in training"
               if val_fraction is not None else "a class of one image stays in training")
        log(f"warning: the test split of {bundle.name} is empty ({why}): there is nothing to evaluate on")
    log(f"{bundle.name}: {len(bundle.train.labels)} train / {len(bundle.test.labels)} test images, {c}x{sh}x{sw}"
        f"{train_at}, {'unlabelled' if bundle.unlabelled else f'{len(bundle.classes)} classes'}{skipped} ({how})")
    return bundle


def data_identity(store: Store) -> dict[str, Any]:
    """What a store's images are and how they are split, as a run records it: the source and the fingerprint of its
    files, the classes, the split's sizes and a digest of the labels in split order (train rows first). Two stores
    with the same source fingerprint hold the same split; two with other fingerprints but the same classes, sizes
    and labels digest hold the same listing split the same way (the files moved, or were touched)."""
    h = store.header
    digest = hashlib.sha256(np.ascontiguousarray(store.labels, dtype=np.int64).tobytes())
    digest.update(str(store.n_train).encode())
    return {"source": h.get("source", ""), "fingerprint": h.get("fingerprint"), "classes": list(h["classes"]),
            "num_train": store.n_train, "num_test": len(store.labels) - store.n_train,
            "labels_sha256": digest.hexdigest()}


def _skipped_name(listing: Listing) -> Callable[[int], str]:
    """Row -> how a message names a file that could not be read: its name, and its size where that is the reason
    (an image beyond Pillow's decompression-bomb limit)."""
    def name(row: int) -> str:
        big = too_large(listing.payload_at(row)) if listing.payload_at is not None else None
        return f"{listing.names(row)} ({big})" if big else listing.names(row)
    return name


def _tree_listing(tree, log: Log) -> Listing:
    tree, classes, items, n_train, has_test = tree_items(tree, log)
    labels = np.array([y for _, y in items], dtype=np.int64)

    def names(row: int) -> str:
        return "/".join(items[row][0])

    def payloads(start: int) -> Iterator[Payload]:
        return (tree.files[p] for p, _ in items[start:])

    return Listing(tree.where, classes, labels, n_train, has_test, names, payloads,
                   lambda row: tree.files[items[row][0]])


def _read_source(src: _Source, log: Log, listing: Listing | None) -> tuple[tuple | None, Listing | None, str]:
    """(tensors, listing, name): a source held in memory whole (digits, CIFAR batches, also inside an archive) as
    (images, labels, classes, n_train, has_test); any other as the listing of its files (``listing`` when the
    caller has one already)."""
    tensors = None
    name = src.name
    if src.kind == "digits":
        x, y, classes = _load_digits()
        tensors = (x, y, classes, len(y), False)
    elif src.kind == "cifar":
        variant, folder = src.cifar
        trx, try_, tex, tey, classes = load_cifar(variant, lambda f: (folder / f).read_bytes(), str(folder))
        tensors = (torch.cat([trx, tex]), torch.cat([try_, tey]), classes, len(try_), True)
    elif src.kind == "archive":
        tree = read_archive(src.path)
        found = cifar_in_tree(tree)
        if found:
            variant, folder = found
            trx, try_, tex, tey, classes = load_cifar(variant, lambda f: tree.files[(*folder, f)],
                                                      tree.describe(folder))
            tensors, name = (torch.cat([trx, tex]), torch.cat([try_, tey]), classes, len(try_), True), variant
        else:
            listing = _tree_listing(tree, log)
    elif src.kind == "folder":
        listing = _tree_listing(scan_folder(src.path), log)
    elif src.kind == "parquet":
        listing = list_parquet(src.path, log)
    return tensors, listing, name


def _build(src: _Source, header: dict[str, Any], keys: list[str], cache: Path, stored: tuple[int, int] | None,
           fit: str, in_chans: int | None, val_fraction: float, seed: int, workers: int | None, log: Log,
           listing: Listing | None = None) -> Store:
    """List the source, then decode it into a new store (or finish one a killed run left)."""
    tensors, listing, name = _read_source(src, log, listing)

    if tensors is not None:
        x, y, classes, n_train, has_test = tensors
        chans = in_chans or (1 if src.kind == "digits" else 3)
        x = _match_channels(x, chans)
        x = _resize_tensor(x, stored, fit) if stored else x
        listing = Listing(src.origin, classes, y.numpy().astype(np.int64), n_train, has_test,
                          lambda r: f"row {r}", lambda start: iter(()))
        shape = tuple(x.shape)

        def fill(rows_file: Path, start: int, done) -> None:
            rows = np.memmap(rows_file, np.uint8, "r+", shape=shape)
            rows[start:] = x[start:].numpy()
            rows.flush()
            del rows
            done(shape[0], [])
    else:
        chans = in_chans or 3
        n = len(listing.labels)
        size = stored or _common_size(listing, log)
        shape = (n, chans, *size)
        n_workers = workers or default_workers()

        def fill(rows_file: Path, start: int, done) -> None:
            if fill_order is None:
                payloads = listing.payloads(start)
            else:
                payloads = (listing.payload_at(int(r)) for r in fill_order[start:])
            decode_into(rows_file, shape, payloads, start, fit, n_workers, f"decoding {name}", done)

    labels = listing.labels

    def arrange(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        train, test = _split_rows(labels, listing.n_train, listing.has_test, keep, val_fraction, seed)
        if len(train) == 0:
            raise VitlabError(f"none of the {listing.n_train} training images in {listing.where} could be read")
        return train, test

    fill_order = None
    if tensors is None and listing.payload_at is not None and not listing.has_test:
        fill_order = np.concatenate(arrange(np.ones(len(labels), dtype=bool)))  # decode in split order
    key = keys[0] if listing.has_test else keys[1]
    path = cache / f"{_safe_name(name)}-{key}"
    reorder = tensors is not None and not listing.has_test  # the rows are written in source order, then split
    what = f"the store for {src.origin}"
    check_writable(cache)
    need, free = store_needs(path, shape, reorder), free_bytes(cache)
    if free is not None and need > free:
        raise VitlabError(space_message("not enough disk space", what, cache, need, free))
    header = dict(header, key=key, name=name, classes=list(listing.classes),
                  listed_per_class=np.bincount(labels, minlength=len(listing.classes)).tolist() if len(labels) else [])
    with _faults_in_one_line(src.origin, cache, path, shape, reorder):
        store, bad = build_store(path, header, shape, labels, fill, arrange, log, _skipped_name(listing), fill_order)
    if bad:
        names = [_skipped_name(listing)(r) for r in bad]
        log(f"skipped {len(bad)} unreadable files, e.g.: {', '.join(names[:5])}")
    log(f"the data cache {cache} now takes {format_size(disk_usage(cache))} ('vitlab cache list' shows what it "
        "holds; 'vitlab cache clean' removes superseded stores)")
    return store


@contextlib.contextmanager
def _faults_in_one_line(origin: str, cache: Path, path: Path, shape: tuple[int, ...], reorder: bool) -> Iterator[None]:
    """A full disk or a dead decoding process during a store build as one line that says the build resumes."""
    resume = f"; the unfinished build in {path}.partial resumes when run again"
    try:
        yield
    except (OSError, DiskFullError) as e:
        if not isinstance(e, DiskFullError) and e.errno not in DISK_FULL:
            raise
        need = store_needs(path, shape, reorder)
        raise VitlabError(space_message("disk full", f"the store for {origin}", cache, need) + resume) from None
    except BrokenProcessPool:
        need = store_needs(path, shape, reorder)
        if (free_bytes(cache) or 0) < need:
            raise VitlabError(space_message("disk full", f"the store for {origin}", cache, need) + resume) from None
        raise VitlabError(f"a process decoding {origin} died (killed, perhaps for lack of memory: try fewer "
                          f"workers){resume}") from None


def _common_size(listing: Listing, log: Log) -> tuple[int, int]:
    """The most common (H, W) of a listing's images, read from their headers."""
    n = len(listing.labels)
    with progress_bar(listing.payloads(0), total=n, desc="reading image sizes", unit="img", disable=n < 2000) as bar:
        counts = Counter(s for s in map(image_size, bar) if s is not None)
    if not counts:
        raise VitlabError(f"none of the {len(listing.labels)} images in {listing.where} could be read")
    size = counts.most_common(1)[0][0]
    if len(counts) > 1:
        n_off = sum(n for s, n in counts.items() if s != size)
        log(f"images come in {len(counts)} sizes: resized {n_off} of them to the most common, "
            f"{size[0]}x{size[1]} (pass img_size to choose)")
    return size


# ----------------------------------------------------------------------------------------------
# WebDataset shards: the training images streamed, the test images stored

PEEK = 512  # the first training images decoded before training: the shapes, the first batch, the statistics


@dataclass
class _Decoding:
    stored: tuple[int, int] | None  # the size images are decoded at (None: the first image's)
    chans: int
    fit: str
    train_size: tuple[int, int] | None
    workers: int | None


def _load_shards(source: str, test_data: str | None, how: _Decoding, cache: Path, log: Log) -> DataBundle:
    """A bundle over shards: ``train`` the first PEEK training images, ``shards`` all of them, the test split a store
    built from the test shards."""
    t0 = time.perf_counter()
    train_pattern, test_pattern = folder_patterns(source) if source.startswith("wds:") else (source, None)
    test_pattern = test_data or test_pattern
    if test_pattern is None:
        raise VitlabError(f"the shard source {source} has no test split; accepted: --test-data PATTERN (shards of "
                          "test images) or wds:DIR with test-*.tar beside train-*.tar")
    shards = open_shards(train_pattern)
    peek = list(first_images(shards, min(PEEK, shards.count)))
    stored = how.stored or tuple(decode_sample(peek[0][2], *peek[0][:2], None, how.chans, how.fit).shape[-2:])
    shards.decoding = (stored, how.chans, how.fit)
    x = torch.stack([torch.from_numpy(decode_sample(sample, url, key, *shards.decoding)) for url, key, sample in peek])
    y = torch.tensor([label_of(sample, url, key, shards.classes) for url, key, sample in peek], dtype=torch.int64)
    test = open_shards(test_pattern, labels=True)
    if len(test.classes) != len(shards.classes) and len(test.labels) and test.labels.max() >= len(shards.classes):
        raise VitlabError(f"the test shards {test_pattern} hold label {int(test.labels.max())}, out of range for the "
                          f"{len(shards.classes)} classes of {train_pattern}; accepted: shards of the same classes")
    store = _test_store(test, shards.classes, (len(test.labels), how.chans, *stored), how, cache, log)
    mean, std = shards.info.get("mean"), shards.info.get("std")
    for key, values in (("mean", mean), ("std", std)):
        if values is not None and not (isinstance(values, list) and values and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)):
            raise VitlabError(f"{Path(shards.urls[0]).parent / INFO_NAME}: {key} is {str(values)[:80]}; accepted: "
                              "finite numbers, one per channel, or none (estimated from the images)")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == how.chans):
        mean, std = mean_std(x)
        log(f"channel mean and std estimated from the first {len(x)} training images ({INFO_NAME} records none)")
    ident = {"source": source, "fingerprint": identity_digest([shard_identity(shards.urls),
                                                                shard_identity(test.urls)]),
             "classes": list(shards.classes), "num_train": shards.count, "num_test": len(test.labels),
             "labels_sha256": hashlib.sha256(np.asarray(shards.counts, np.int64).tobytes()
                                             + store.labels.tobytes()).hexdigest(),
             "contents_sha256": shard_contents(shards.urls + test.urls)}
    bundle = DataBundle(Path(train_pattern.split("::")[0].removeprefix("wds:")).parent.name or "shards",
                        ImageSet(x, y), ImageSet(*store.split("test")), [printable(c) for c in shards.classes],
                        tuple(float(v) for v in mean), _usable_std(list(std), log), 0, source,
                        how.train_size if how.stored else None, store.path, ident, shards=shards)
    log(f"{bundle.name}: {shards.count} train images in {len(shards.urls)} shards (streamed) / {len(test.labels)} "
        f"test images (stored in {store.path}), {how.chans}x{stored[0]}x{stored[1]}, {len(bundle.classes)} classes "
        f"({time.perf_counter() - t0:.1f} s)")
    return bundle


INFO_NAME = "_info.json"


def shard_identity(urls: list[str]) -> list:
    """What identifies shards: their names and, for local ones, each file's size, times and inode."""
    return [[u, *(files_fingerprint([u])[0] or [])] if not u.startswith(("pipe:", "http")) else [u] for u in urls]


def shard_contents(urls: list[str]) -> str:
    """What a run holds its shards to beyond their names and counts: each local shard's file name, size and
    modification time (a shard rewritten with other labels or images has another), not its folder (a moved folder
    is the same data)."""
    stats = [[os.path.basename(u), *(files_fingerprint([u])[0] or [None, None])[:2]] for u in urls
             if not u.startswith(("pipe:", "http"))]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _test_store(test: ShardSet, classes: list[str], shape: tuple[int, ...], how: _Decoding, cache: Path,
                log: Log) -> Store:
    """The test shards decoded into a store (found again in the cache while they are unchanged)."""
    ident = shard_identity(test.urls)
    key = cache_key("shards", ident, list(shape[2:]), how.fit, how.chans)
    path = cache / f"{_safe_name(Path(test.urls[0]).parent.name or 'shards')}-test-{key}"
    if is_store(path):
        with contextlib.suppress(ValueError):
            return open_store(path, key)
    labels, offsets = test.labels, test.offsets
    names = [f"{u} sample {k}" for u, n in zip(test.urls, test.counts) for k in range(n)]

    def payloads(start: int) -> Iterator[bytes]:
        for s, (url, n) in enumerate(zip(test.urls, test.counts)):
            if offsets[s] + n > start:
                lo = max(0, start - int(offsets[s]))
                yield from (image_bytes(sample) for _, sample in read_piece(url, Piece(s, lo, n)))

    def fill(rows_file: Path, start: int, done) -> None:
        decode_into(rows_file, shape, payloads(start), start, how.fit, how.workers or default_workers(),
                    "decoding the test shards", done)

    header = {"name": path.name, "source": test.pattern, "kind": "shards", "fit": how.fit, "key": key,
              "fingerprint": identity_digest(ident), "fingerprint_of": test.pattern, "cache_version": CACHE_VERSION,
              "classes": list(classes)}
    check_writable(cache)
    store, bad = build_store(path, header, shape, labels, fill,
                             lambda keep: (np.empty(0, np.int64), np.flatnonzero(keep)), log, names.__getitem__)
    if bad:
        log(f"skipped {len(bad)} unreadable test images, e.g.: {', '.join(names[r] for r in bad[:5])}")
    return store


# ----------------------------------------------------------------------------------------------
# a source's files as they are, split as load_data splits it (what vitlab data pack writes)


@dataclass
class SourceFiles:
    """A source's images before any decoding: its classes, every row's label, the train and test rows (the split
    load_data makes), and ``read(rows)``: (row, encoded image bytes or a uint8 (C, H, W) array) for those rows, in
    that order where the source reads out of order cheaply (``random_access``), else in row order."""

    name: str
    classes: list[str]
    labels: np.ndarray
    train: np.ndarray
    test: np.ndarray
    read: Callable[[np.ndarray], Iterator[tuple[int, bytes | np.ndarray]]]
    random_access: bool
    names: Callable[[int], str]


def _payload_bytes(payload: Payload) -> bytes:
    if isinstance(payload, bytes):
        return payload
    with open(payload, "rb") as f:
        return f.read()


def source_files(source: str | os.PathLike, *, val_fraction: float = 0.2, seed: int = 0,
                 cache_dir: str | os.PathLike | None = None, download: bool = False, log: Log = print) -> SourceFiles:
    """What a source holds, file by file (see SourceFiles): a built-in set, folder, archive, Parquet files, CSV/TSV
    list or store; shards are read by ``shards`` itself."""
    _check_args(None, None, val_fraction, seed)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    src = _resolve(os.fspath(source), cache, download, log)
    if src.kind == "store":
        store = open_store(src.path)
        x, y = store.images, store.labels
        tensors = (x, y, list(store.header["classes"]), store.n_train, True)
        listing = None
    else:
        tensors, listing, _ = _read_source(src, log, list_table(src.path, log) if src.kind == "table" else None)
    if tensors is not None:
        x, y, classes, n_train, has_test = tensors
        y = np.asarray(y, dtype=np.int64)
        arrays = np.asarray(x)

        def read(rows: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
            return ((int(r), arrays[r]) for r in rows)
        train, test = _split_rows(y, n_train, has_test, np.ones(len(y), bool), val_fraction, seed)
        return SourceFiles(src.name, [str(c) for c in classes], y, train, test, read, True, lambda r: f"row {r}")
    readable = np.array([image_size(p) is not None for p in listing.payloads(0)], dtype=bool)
    train, test = _split_rows(listing.labels, listing.n_train, listing.has_test, readable, val_fraction, seed)
    if not readable.all():
        bad = np.flatnonzero(~readable)
        log(f"skipped {len(bad)} unreadable files, e.g.: {', '.join(listing.names(int(r)) for r in bad[:5])}")

    def read_files(rows: np.ndarray) -> Iterator[tuple[int, bytes]]:
        if listing.payload_at is not None:
            return ((int(r), _payload_bytes(listing.payload_at(int(r)))) for r in rows)
        wanted = set(rows.tolist())
        return ((r, _payload_bytes(p)) for r, p in enumerate(listing.payloads(0)) if r in wanted)
    return SourceFiles(src.name, list(listing.classes), listing.labels, train, test, read_files,
                       listing.payload_at is not None, listing.names)


def _split_rows(labels: np.ndarray, n_train: int, has_test: bool, keep: np.ndarray, val_fraction: float,
                seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows) of the readable rows ``keep``: the source's own split, else load_data's stratified
    one."""
    if has_test:
        return np.flatnonzero(keep[:n_train]), n_train + np.flatnonzero(keep[n_train:])
    kept = np.flatnonzero(keep)
    tr, te = _stratified_split(torch.from_numpy(np.asarray(labels)[kept]), val_fraction, seed)
    return kept[tr.numpy()], kept[te.numpy()]
