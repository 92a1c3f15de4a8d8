"""Sources listed in tables: Hugging Face image-classification Parquet files and CSV/TSV files of ``path,label``.

Parquet: the layout the Hugging Face hub stores (``data/train-00000-of-00002.parquet``,
``<config>/validation/0000.parquet``, or one ``.parquet`` file), an ``image`` column holding
encoded bytes (a struct with ``bytes`` and ``path``, or plain binary) and a ``label`` column. Class
names come from the ``huggingface`` entry of the schema metadata (a ClassLabel feature) when
present, else from the label values. Read with pyarrow, batch by batch, no network.

CSV/TSV: one ``path,label`` line per image (tab-separated for ``.tsv``), an optional header line
``path,label``; paths are relative to the file's folder; labels are class names (sorted; numerically
when they are all integers).
"""
from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .decode import Payload
from .download import Log

TABLE_SUFFIXES = (".csv", ".tsv")
_TRAIN_NAMES = ("train",)
_TEST_NAMES = ("validation", "valid", "val", "test")  # the held-out split, in order of preference
_IMAGE_COLUMNS = ("image", "img")
_LABEL_COLUMNS = ("label", "labels", "fine_label")


@dataclass
class Listing:
    """The images of a source in row order (train rows, then test rows), known before any is decoded."""

    where: str  # the source, for messages
    classes: list[str]
    labels: np.ndarray  # (N,) int64
    n_train: int
    has_test: bool  # whether rows n_train.. are the source's own test split
    names: Callable[[int], str]  # row -> what to call it in a message
    payloads: Callable[[int], Iterator[Payload]]  # row -> the payloads of that row and the ones after it
    payload_at: Callable[[int], Payload] | None = None  # row -> its payload, where reading out of order is cheap


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading Parquet files needs pyarrow: pip install 'vitlab[parquet]' (or pyarrow)") from None
    return pq


def parquet_files(path: Path) -> list[Path]:
    """The .parquet files of a file or folder (recursively, hidden folders skipped), sorted."""
    if path.is_file():
        return [path] if path.suffix.lower() == ".parquet" else []
    return sorted(p for p in path.rglob("*.parquet")
                  if not any(part.startswith(".") for part in p.relative_to(path).parts))


def _split_of(rel: Path) -> str | None:
    """'train', a held-out split name, or None, from a file's folders or its name's first word."""
    words = [p.lower() for p in rel.parts[:-1]] + [rel.name.lower().replace("_", "-").split("-")[0].split(".")[0]]
    for w in reversed(words):
        if w in _TRAIN_NAMES or w in _TEST_NAMES:
            return w
    return None


def _column(names: list[str], wanted: tuple[str, ...], what: str, where: Path) -> str:
    for w in wanted:
        if w in names:
            return w
    raise ValueError(f"{where} has no {what} column (looked for {', '.join(wanted)}; columns: {', '.join(names)})")


def _class_names(schema, label_col: str) -> list[str] | None:
    """ClassLabel names from the Hugging Face schema metadata, when present."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label_col]
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    return [str(n) for n in names] if isinstance(names, list) and names else None


def _sorted_names(values: set[str]) -> list[str]:
    try:
        return sorted(values, key=int)
    except ValueError:
        return sorted(values)


def list_parquet(path: Path, log: Log) -> Listing:
    """The rows of a Parquet source: train files, then the held-out split's files when there is one."""
    pq = _pyarrow()
    files = parquet_files(path)
    root = path if path.is_dir() else path.parent
    by_split: dict[str | None, list[Path]] = {}
    for f in files:
        by_split.setdefault(_split_of(f.relative_to(root)), []).append(f)
    test_name = next((s for s in _TEST_NAMES if s in by_split), None)
    if "train" in by_split:
        train_files, test_files = by_split["train"], by_split.get(test_name, [])
        ignored = sorted({str(f.relative_to(root)) for s, fs in by_split.items() if s not in ("train", test_name)
                          for f in fs})
        if ignored:
            log(f"{path}: using the train and {test_name} splits; ignoring {', '.join(ignored)}")
        elif test_name:
            log(f"{path}: using {test_name} as the test split")
    else:
        train_files, test_files = files, []
    schemas = [pq.read_schema(f) for f in train_files + test_files]
    first = train_files[0]
    image_col = _column(schemas[0].names, _IMAGE_COLUMNS, "image", first)
    label_col = _column(schemas[0].names, _LABEL_COLUMNS, "label", first)
    raw_labels, counts = [], []
    for f in train_files + test_files:
        try:
            col = pq.read_table(f, columns=[label_col]).column(0)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{f} is not a readable Parquet file with a {label_col!r} column ({e})") from None
        raw_labels.append(col.to_pylist())
        counts.append(len(col))
    classes = _class_names(schemas[0], label_col)
    values = [v for part in raw_labels for v in part]
    if classes is None:
        if all(isinstance(v, int) for v in values if v is not None):
            classes = [str(i) for i in range(max((v for v in values if v is not None), default=-1) + 1)]
        else:
            classes = _sorted_names({str(v) for v in values if v is not None})
    index = {c: i for i, c in enumerate(classes)}
    labels = np.array([v if isinstance(v, int) else index.get(str(v), -1) if v is not None else -1
                       for v in values], dtype=np.int64)
    if len(labels) and (labels.max() >= len(classes) or labels.min() < 0):
        bad = int(labels.max()) if labels.max() >= len(classes) else int(labels.min())
        raise ValueError(f"{path}: label {bad} is out of range for the {len(classes)} classes (an unlabelled "
                         "split has labels -1: give the files of the labelled splits only)")
    all_files = train_files + test_files
    starts = np.cumsum([0, *counts])
    n_train = int(starts[len(train_files)])

    def names(row: int) -> str:
        k = int(np.searchsorted(starts, row, side="right")) - 1
        return f"{all_files[k].relative_to(root)} row {row - starts[k]}"

    def payloads(start: int) -> Iterator[Payload]:
        for k, f in enumerate(all_files):
            if starts[k + 1] <= start:
                continue
            skip = max(0, start - int(starts[k]))
            for batch in pq.ParquetFile(f).iter_batches(batch_size=256, columns=[image_col]):
                for v in batch.column(0).to_pylist():
                    if skip:
                        skip -= 1
                        continue
                    data = v.get("bytes") if isinstance(v, dict) else v
                    yield data if isinstance(data, bytes) else b""

    return Listing(str(path), classes, labels, n_train, bool(test_files), names, payloads)


def list_table(path: Path, log: Log) -> Listing:
    """The rows of a CSV/TSV file of ``path,label`` lines, in file order."""
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [(i + 1, r) for i, r in enumerate(csv.reader(f, delimiter=delimiter)) if r and any(r)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path} is not a readable {'TSV' if delimiter == chr(9) else 'CSV'} file ({e})") from None
    if rows and [c.strip().lower() for c in rows[0][1]] in (["path", "label"], ["file", "label"], ["image", "label"]):
        rows = rows[1:]
    bad = [(line, r) for line, r in rows if len(r) != 2 or not r[0].strip() or not r[1].strip()]
    if bad:
        line, r = bad[0]
        raise ValueError(f"{path} line {line}: expected 'path{delimiter}label', got {delimiter.join(r)!r}")
    if not rows:
        raise ValueError(f"{path} lists no images; expected one 'path{delimiter}label' line per image")
    classes = _sorted_names({r[1].strip() for _, r in rows})
    index = {c: i for i, c in enumerate(classes)}
    labels = np.array([index[r[1].strip()] for _, r in rows], dtype=np.int64)
    files = [str((path.parent / r[0].strip()).expanduser()) for _, r in rows]
    log(f"{path}: {len(rows)} images in {len(classes)} classes")

    def names(row: int) -> str:
        return f"{path.name} line {rows[row][0]}: {rows[row][1][0].strip()}"

    def payloads(start: int) -> Iterator[Payload]:
        yield from files[start:]

    return Listing(str(path), classes, labels, len(rows), False, names, payloads, files.__getitem__)
