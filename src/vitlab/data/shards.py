"""WebDataset shards: tar files of ``KEY.jpg|png|webp`` (the image) beside ``KEY.cls`` (the class index as text) or
``KEY.json`` (``{"label": ...}``), listed, counted and streamed in order, read through the webdataset library.

A shard source is a brace pattern (``DIR/train-{000000..000099}.tar``), one shard, a ``pipe:`` command or an
http(s) URL that webdataset opens, or ``wds:DIR``: the folder's ``train-*.tar`` and ``test-*.tar``. Class names
come from the folder's ``_info.json`` (``classes``, as ``vitlab data pack`` writes it) or ``classes.txt`` (one
name a line), else they are the label numbers. ``_info.json`` also gives each shard's sample count (timm's
``splits.<name>.filenames`` / ``shard_lengths``); without it the shards are read once to count them (their
headers only, for local files).

An epoch's plan (``epoch_pieces``): the shards in an order drawn from the epoch's seed, laid end to end as one
sequence of samples; rank ``r`` of ``R`` takes the contiguous part ``[N*r/R, N*(r+1)/R)`` of it, and worker ``w``
of ``W`` the same part of its rank's. Every sample is read once an epoch by exactly one worker of one rank, ranks
take counts that differ by one at most, whatever the shard count (a shard on a boundary is split by sample index:
two readers each take their share of it, the second skipping the first's samples without decoding them).
Each worker then shuffles its samples through a buffer (``SHUFFLE_BUFFER`` undecoded samples) and decodes with
Pillow by the store's own rule (``decode.decode_image``).
"""
from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import VitlabError
from .decode import decode_image
from .labels import check_no_empty_classes

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
LABEL_SUFFIXES = ("cls", "json")
INFO, CLASSES = "_info.json", "classes.txt"
SHUFFLE_BUFFER = 1000  # undecoded samples a worker shuffles among
_REMOTE = ("pipe:", "http://", "https://")
_BRACES = re.compile(r"\{\d+\.\.\d+\}")


def is_shard_source(source: str) -> bool:
    """Whether a data source names WebDataset shards (``wds:``, a brace pattern of .tar files, a URL or pipe)."""
    source = str(source)
    return source.startswith("wds:") or (".tar" in source and (bool(_BRACES.search(source))
                                                                or source.startswith(_REMOTE)))


def _webdataset():
    try:
        import webdataset
    except ImportError:
        raise VitlabError("reading WebDataset shards needs webdataset: pip install 'vitlab[shards]' "
                          "(or webdataset)") from None
    return webdataset


def _is_local(url: str) -> bool:
    return not url.startswith(_REMOTE)


def expand(pattern: str) -> list[str]:
    """The shards a pattern names, in order; a local one that does not exist is one line naming it."""
    from braceexpand import braceexpand

    _webdataset()
    urls = []
    for part in pattern.split("::"):
        urls.extend(braceexpand(part))  # pipe: commands too, as webdataset expands them
    if not urls:
        raise VitlabError(f"the shard pattern {pattern!r} names no shard; accepted: e.g. DIR/train-{{000000..000009}}"
                          ".tar, pipe:COMMAND, an http(s) URL or wds:DIR")
    local = [u for u in urls if _is_local(u)]
    missing = [u for u in local if not Path(u).is_file()]
    if missing:
        raise VitlabError(f"{len(missing)} of the {len(urls)} shards of {pattern!r} do not exist, e.g. {missing[0]}; "
                          "accepted: a pattern whose every shard exists (braces as in train-{000000..000099}.tar)")
    return urls


def folder_patterns(source: str) -> tuple[str, str | None]:
    """``wds:DIR`` as (its train shards, its test shards or None), each a '::'-joined list."""
    folder = Path(source.removeprefix("wds:")).expanduser()
    if not folder.is_dir():
        raise VitlabError(f"{source}: {folder} is not a folder; accepted: wds:DIR with DIR holding train-*.tar "
                          "(and test-*.tar)")
    train, test = sorted(folder.glob("train-*.tar")), sorted(folder.glob("test-*.tar"))
    if not train:
        raise VitlabError(f"{source}: {folder} holds no train-*.tar shard; accepted: wds:DIR with DIR holding "
                          "train-*.tar (and test-*.tar)")
    return "::".join(map(str, train)), "::".join(map(str, test)) if test else None


@dataclass
class ShardSet:
    """Shards and what is known of them before training: each one's sample count, the class names, the images'
    channel statistics when ``_info.json`` records them, and the labels of every sample where they were read."""

    pattern: str
    urls: list[str]
    counts: list[int]
    classes: list[str]
    info: dict[str, Any] = field(default_factory=dict)
    labels: np.ndarray | None = None  # (N,) in listing order, when the shards were read to count them
    decoding: tuple[tuple[int, int], int, str] | None = None  # (stored size, channels, fit) a reader decodes by

    @property
    def count(self) -> int:
        return int(sum(self.counts))

    @property
    def offsets(self) -> np.ndarray:
        """The listing index of each shard's first sample (the index a task sees is offset + place in the shard)."""
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)


def read_info(urls: list[str]) -> tuple[dict[str, Any], list[str] | None]:
    """The folder's ``_info.json`` (or {}) and ``classes.txt`` names (or None), beside the first local shard."""
    if not urls or not _is_local(urls[0]):
        return {}, None
    folder = Path(urls[0]).parent
    info: dict[str, Any] = {}
    if (folder / INFO).is_file():
        try:
            info = json.loads((folder / INFO).read_text())
        except (OSError, ValueError) as e:
            raise VitlabError(f"{folder / INFO} is unreadable ({e}); accepted: the JSON vitlab data pack writes, "
                              "or no such file") from None
        info = info if isinstance(info, dict) else {}
    names = info.get("classes")
    if names is not None and (not isinstance(names, list) or not names or len(set(map(str, names))) != len(names)
                              or not all(isinstance(n, (str, int)) and not isinstance(n, bool) for n in names)):
        twice = sorted({str(n) for n in names if list(names).count(n) > 1}) if isinstance(names, list) else []
        raise VitlabError(f"{folder / INFO}: 'classes' is {str(names)[:80]}"
                          f"{f' ({chr(44).join(twice[:3])} twice)' if twice else ''}; accepted: a list of distinct "
                          "class names, one for each label 0, 1, ...")
    if names is None and (folder / CLASSES).is_file():
        names = [n.strip() for n in (folder / CLASSES).read_text().splitlines() if n.strip()]
    return info, [str(n) for n in names] if names is not None else None


def _known_counts(info: dict[str, Any], urls: list[str]) -> list[int] | None:
    """Each shard's sample count from ``_info.json``'s splits, when it lists every one of ``urls``."""
    lengths = {}
    for split in (info.get("splits") or {}).values():
        if isinstance(split, dict):
            lengths.update(zip(split.get("filenames", []), split.get("shard_lengths", [])))
    names = [os.path.basename(u) for u in urls]
    if not all(n in lengths for n in names):
        return None
    bad = next((n for n in names if isinstance(lengths[n], bool) or not isinstance(lengths[n], int)
                or lengths[n] < 0), None)
    if bad is not None:
        raise VitlabError(f"{Path(urls[0]).parent / INFO}: shard_lengths gives {lengths[bad]!r} for {bad}; accepted: "
                          "a whole number >= 0 for each shard, as vitlab data pack writes it (or no _info.json: the "
                          "shards are then counted)")
    return [int(lengths[n]) for n in names]


def open_shards(pattern: str, labels: bool = False) -> ShardSet:
    """List and count the shards of ``pattern`` (from ``_info.json`` where it has them, else by reading them; with
    ``labels``, always read, for every sample's label)."""
    urls = expand(pattern)
    info, classes = read_info(urls)
    counts = None if labels else _known_counts(info, urls)
    labels = None
    if counts is None:
        per_shard = [_shard_labels(u, classes) for u in urls]
        counts, labels = [len(p) for p in per_shard], np.concatenate([np.asarray(p, np.int64) for p in per_shard])
    empty = [u for u, n in zip(urls, counts) if n == 0]
    if empty:
        raise VitlabError(f"shard {empty[0]} holds no sample (an image {'|'.join(IMAGE_SUFFIXES)} with a "
                          f"{' or '.join(LABEL_SUFFIXES)} label); accepted: shards of KEY.jpg + KEY.cls samples")
    if classes is None:
        if labels is None:
            raise VitlabError(f"{pattern}: _info.json gives the shards' lengths but no classes; accepted: its "
                              "'classes' list or a classes.txt beside the shards")
        check_no_empty_classes(labels, f"the shards of {pattern}", "the class names in a classes.txt beside the "
                               "shards (one a line)")
        classes = [str(k) for k in range(int(labels.max()) + 1)]
    if labels is not None and len(labels) and labels.max() >= len(classes):
        raise VitlabError(f"{pattern}: label {int(labels.max())} is out of range for the {len(classes)} classes "
                          f"named beside the shards; accepted: 0..{len(classes) - 1}")
    return ShardSet(pattern, urls, counts, classes, info, labels)


def _members(url: str) -> Iterator[tuple[str, bytes | None]]:
    """(name, bytes) of a shard's files in order, the bytes of label files only (local shards: headers read,
    images skipped)."""
    def wanted(name: str) -> bool:
        return name.rsplit(".", 1)[-1].lower() in LABEL_SUFFIXES

    try:
        if _is_local(url):
            with tarfile.open(url, "r:") as tar:
                for m in tar:
                    if m.isreg():
                        yield m.name, tar.extractfile(m).read() if wanted(m.name) else None
            return
        with _webdataset().gopen(url, "rb") as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                if m.isreg():
                    yield m.name, tar.extractfile(m).read() if wanted(m.name) else None
    except (tarfile.TarError, OSError) as e:
        raise VitlabError(f"shard {url} cannot be read as a tar file ({e}); accepted: WebDataset .tar shards") from None


def _key_and_suffix(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name: the key up to the first dot of the file name, then the suffix."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), suffix.lower()


def _shard_labels(url: str, classes: list[str] | None) -> list[int]:
    """The label of every sample of a shard, in order; a sample without an image or a label is one line."""
    samples: dict[str, dict[str, bytes | None]] = {}
    for name, data in _members(url):
        key, suffix = _key_and_suffix(name)
        if key.startswith("__") or not suffix:
            continue
        samples.setdefault(key, {})[suffix] = data
    labels = []
    for key, sample in samples.items():
        if _image_suffix(sample) is None:
            raise VitlabError(f"shard {url}: sample {key} has no image ({', '.join(sorted(sample))}); accepted: "
                              f"KEY.{'|'.join(IMAGE_SUFFIXES)} beside its label")
        labels.append(label_of(sample, url, key, classes))
    return labels


def _image_suffix(sample: dict[str, Any]) -> str | None:
    return next((s for s in IMAGE_SUFFIXES if s in sample), None)


def label_of(sample: dict[str, Any], url: str, key: str, classes: list[str] | None = None) -> int:
    """A sample's class index from its ``.cls`` (an integer) or ``.json`` (``label``/``cls``: an integer, or a
    class name when ``classes`` are known); one line naming the shard and key when it has none, or one outside
    the ``classes`` (or below 0)."""
    try:
        if sample.get("cls") is not None:
            value = int(sample["cls"].decode().strip())
        elif sample.get("json") is not None:
            meta = json.loads(sample["json"])
            value = next(meta[k] for k in ("label", "cls", "class") if k in meta) if isinstance(meta, dict) else meta
            if isinstance(value, str) and classes and value in classes:
                return classes.index(value)
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError(value)
            value = int(value)
        else:
            value = None
    except (ValueError, StopIteration, TypeError, UnicodeDecodeError):
        raise VitlabError(f"shard {url}: sample {key} has an unreadable label; accepted: KEY.cls holding an integer "
                          "or KEY.json holding {\"label\": integer}") from None
    if value is None:
        raise VitlabError(f"shard {url}: sample {key} has no label; accepted: KEY.cls (the class index) or KEY.json "
                          "({\"label\": index}) beside each image")
    if value < 0 or (classes and value >= len(classes)):
        accepted = (f"0..{len(classes) - 1} (the {len(classes)} classes named beside the shards)" if classes else
                    "class indices 0, 1, ...")
        raise VitlabError(f"shard {url}: sample {key} has label {value}, out of range; accepted: {accepted}")
    return value


# ----------------------------------------------------------------------------------------------
# an epoch's plan and the samples of one reader


@dataclass(frozen=True)
class Piece:
    """Samples ``start``..``stop``-1 of shard ``shard`` (indices into a ShardSet's urls)."""

    shard: int
    start: int
    stop: int


def shard_order(n_shards: int, seed: int) -> np.ndarray:
    """The order the shards are laid end to end in for an epoch's seed."""
    return np.random.default_rng(seed).permutation(n_shards)


def reader_range(total: int, rank: int, world: int, worker: int, workers: int) -> tuple[int, int]:
    """[start, stop) of the epoch's sequence of ``total`` samples that worker ``worker`` of rank ``rank`` reads."""
    lo, hi = total * rank // world, total * (rank + 1) // world
    n = hi - lo
    return lo + n * worker // workers, lo + n * (worker + 1) // workers


def epoch_pieces(counts: list[int], seed: int, rank: int, world: int, worker: int = 0,
                 workers: int = 1) -> list[Piece]:
    """The parts of shards one reader reads in an epoch (see the module's docstring), in reading order."""
    order = shard_order(len(counts), seed)
    start, stop = reader_range(int(sum(counts)), rank, world, worker, workers)
    pieces, at = [], 0
    for s in order:
        n = counts[s]
        lo, hi = max(start, at), min(stop, at + n)
        if lo < hi:
            pieces.append(Piece(int(s), lo - at, hi - at))
        at += n
    return pieces


def read_piece(url: str, piece: Piece, count: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, {suffix: bytes}) of the piece's samples, in order; those before it are passed over undecoded. With the
    shard's ``count`` (what was counted of it), a piece that ends the shard checks that no sample follows: a shard
    holding more than counted (an ``_info.json`` that undercounts it) is one line, never samples left unread."""
    wds = _webdataset()
    k, more = 0, False
    try:
        files = wds.tariterators.tar_file_expander(wds.tariterators.url_opener([{"url": url}]))
        for sample in wds.tariterators.group_by_keys(files):
            if _image_suffix(sample) is None:
                continue
            if k >= piece.stop:
                more = True
                break
            if k >= piece.start:
                yield sample["__key__"], sample
            k += 1
    except (tarfile.TarError, OSError) as e:
        raise VitlabError(f"shard {url} cannot be read as a tar file ({type(e).__name__}: {e.args[0] if e.args else e})"
                          "; accepted: WebDataset .tar shards") from None
    if k < piece.stop:
        raise VitlabError(f"shard {url} holds {k} samples, {piece.stop} were counted (it changed since, or "
                          f"_info.json is out of date); accepted: shards as listed")
    if more and count is not None and piece.stop >= count:
        raise VitlabError(f"shard {url} holds more than the {count} samples counted of it (_info.json's shard_lengths "
                          "undercount it, or it changed since); accepted: shard_lengths as the shards hold, or no "
                          "_info.json (the shards are then counted)")


def shuffled(samples: Iterator[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """The samples in an order drawn through a buffer of ``size``: each one out is a random one of the buffer."""
    buffer: list[Any] = []
    for s in samples:
        if len(buffer) < size:
            buffer.append(s)
            continue
        j = int(rng.integers(size))
        buffer[j], s = s, buffer[j]
        yield s
    for j in rng.permutation(len(buffer)):
        yield buffer[j]


def decode_sample(sample: dict[str, Any], url: str, key: str, size: tuple[int, int] | None, chans: int,
                  fit: str) -> np.ndarray:
    """A sample's image as uint8 (C, H, W) at ``size`` (None: its own) by the store's rule; an unreadable one is one
    line."""
    data = sample[_image_suffix(sample)]
    a = decode_image(data, size, chans, fit)
    if a is None or (size is not None and a.shape[:2] != tuple(size)):
        raise VitlabError(f"shard {url}: the image of sample {key} cannot be read by Pillow; accepted: "
                          f"{'|'.join(IMAGE_SUFFIXES)} images (vitlab data pack writes readable ones only)")
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def image_bytes(sample: dict[str, Any]) -> bytes:
    """The encoded image of a sample."""
    return sample[_image_suffix(sample)]


def first_images(shards: ShardSet, n: int) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """The first ``n`` samples of the listing as (shard, key, sample): a look at the data before training."""
    left = n
    for url, count in zip(shards.urls, shards.counts):
        for key, sample in read_piece(url, Piece(0, 0, min(count, left))):
            yield url, key, sample
        left -= min(count, left)
        if not left:
            return


def encode_png(image: np.ndarray) -> bytes:
    """A uint8 (C, H, W) image as PNG bytes (lossless: the image reads back as it was)."""
    from PIL import Image

    a = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(a)).save(buf, format="PNG")
    return buf.getvalue()


def worker_skips(done: int, counts: list[int]) -> list[int]:
    """How many samples each worker had handed over when ``done`` samples of a rank were taken, the workers'
    samples taken in turn (worker 0, 1, ..., a worker that has run out left out of the turn), as a DataLoader's
    in-order workers hand them over; ``counts``: each worker's samples this epoch (they differ by one at most)."""
    w, q = len(counts), min(counts)
    if done < q * w:
        return [done // w + (k < done % w) for k in range(w)]
    extra = done - q * w
    skips = []
    for k in range(w):
        more = counts[k] > q and extra > 0
        extra -= more
        skips.append(q + more)
    return skips


class ShardReader(IterableDataset):
    """One rank's training samples of an epoch as (uint8 (C, H, W) tensor, label, index in the listing), read by
    each DataLoader worker from its own part (``epoch_pieces``), shuffled through a buffer and decoded there; a
    shard or image that cannot be read ends the worker's samples with (None, the one-line reason, -1).

    ``start(seed, done)`` before each epoch: the epoch's seed and the samples of this rank already trained in it
    (a resumed run), which are passed over undecoded."""

    def __init__(self, shards: ShardSet, rank: int = 0, world: int = 1, workers: int = 0,
                 buffer: int = SHUFFLE_BUFFER):
        self.shards = shards
        self.size, self.chans, self.fit = shards.decoding
        self.rank, self.world, self.workers, self.buffer = rank, world, max(workers, 1), buffer
        self.seed, self.done = 0, 0

    def start(self, seed: int, done: int = 0) -> None:
        self.seed, self.done = seed, done

    def rank_count(self) -> int:
        """The samples this rank reads an epoch."""
        lo, _ = reader_range(self.shards.count, self.rank, self.world, 0, 1)
        _, hi = reader_range(self.shards.count, self.rank, self.world, self.workers - 1, self.workers)
        return hi - lo

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        s = self.shards
        counts = [np.subtract(*reader_range(s.count, self.rank, self.world, k, self.workers)[::-1])
                  for k in range(self.workers)]
        skip = worker_skips(self.done, counts)[worker]
        pieces = epoch_pieces(s.counts, self.seed, self.rank, self.world, worker, self.workers)
        rng = np.random.default_rng([self.seed, self.rank, worker])
        offsets = s.offsets

        def samples():
            for p in pieces:
                url = s.urls[p.shard]
                for k, (key, sample) in enumerate(read_piece(url, p, s.counts[p.shard])):
                    yield int(offsets[p.shard]) + p.start + k, url, key, sample

        try:
            for i, (index, url, key, sample) in enumerate(shuffled(samples(), self.buffer, rng)):
                if i < skip:
                    continue
                image = decode_sample(sample, url, key, self.size, self.chans, self.fit)
                yield torch.from_numpy(image), label_of(sample, url, key, s.classes), index
        except ValueError as e:  # handed over as a sample: a worker's own exception would come with its traceback
            yield None, str(e), -1
