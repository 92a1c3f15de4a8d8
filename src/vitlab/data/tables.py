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
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np

from ..errors import VitlabError
from ..text import quote
from .decode import IMAGE_EXTENSIONS, Payload
from .download import Log

TABLE_SUFFIXES = (".csv", ".tsv")
_TRAIN_NAMES = ("train",)
_TEST_NAMES = ("validation", "valid", "val", "test")  # the held-out split, in order of preference
_IMAGE_COLUMNS = ("image", "img")
_LABEL_COLUMNS = ("label", "labels", "fine_label")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


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

    def __post_init__(self) -> None:
        """Every label is one of the classes, whatever the source: one line naming the first row that is not."""
        bad = np.flatnonzero((self.labels < 0) | (self.labels >= len(self.classes)))
        if len(bad):
            row = int(bad[0])
            raise VitlabError(f"{self.where}: {self.names(row)} has label {int(self.labels[row])}, out of range for "
                              f"the {len(self.classes)} classes; accepted: 0..{len(self.classes) - 1}")


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise VitlabError("reading Parquet files needs pyarrow: pip install 'vitlab[parquet]' (or pyarrow)") from None
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
    raise VitlabError(f"{where} has no {what} column (looked for {', '.join(wanted)}; columns: {', '.join(names)})")


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


def _number(text: str) -> Decimal | None:
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _number_name(d: Decimal) -> str:
    return str(int(d)) if d == d.to_integral_value() else str(d.normalize())


def class_index(values: list[str], where: str) -> tuple[list[str], dict[str, int]]:
    """Class names and each label text's class: labels that are all numbers are read as numbers (``1``,
    ``01``, ``1.0`` and ``1e0`` are one class, named ``1``; sorted by value); other labels are names
    (sorted), and two texts of one number among them are refused as ambiguous."""
    texts = sorted(set(values))
    numbers = {t: _number(t) for t in texts}
    if all(d is not None for d in numbers.values()):
        by_name = {_number_name(d): d for d in numbers.values()}
        names = sorted(by_name, key=by_name.get)
        pos = {n: i for i, n in enumerate(names)}
        return names, {t: pos[_number_name(d)] for t, d in numbers.items()}
    seen: dict[Decimal, str] = {}
    for t, d in numbers.items():
        if d is not None and seen.setdefault(d, t) != t:
            raise VitlabError(f"{where}: labels {seen[d]!r} and {t!r} are one number written two ways, among labels "
                              "that are not all numbers; write each class one way (labels that are all numbers are "
                              "read as numbers)")
    return texts, {t: i for i, t in enumerate(texts)}


def _unreadable_parquet(f: Path, e: Exception) -> ValueError:
    first = str(e).splitlines()[0] if str(e) else ""
    return VitlabError(f"{f} is not a readable Parquet file (truncated or damaged? {type(e).__name__}: {first})")


def _parquet_call(fn: Callable, f: Path):
    """``fn(f)`` with any failure to read the Parquet file ``f`` said in one line that names it."""
    try:
        return fn(f)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise _unreadable_parquet(f, e) from None


def _parquet_batches(pq, f: Path, column: str) -> Iterator:
    """The record batches of one column of a Parquet file; a damaged file is a ValueError that names it."""
    try:
        yield from pq.ParquetFile(f).iter_batches(batch_size=256, columns=[column])
    except Exception as e:  # noqa: BLE001 - as in _parquet_call
        raise _unreadable_parquet(f, e) from None


def _parquet_labels(values: list, classes: list[str] | None, path: Path,
                    names: Callable[[int], str]) -> tuple[list[str], np.ndarray]:
    """(classes, labels) of a Parquet label column: integers are class indices (the schema's ClassLabel names, else
    0..the largest), anything else a class name. A null label, an unlabelled split's -1 and an integer far beyond the
    others (classes with no image between) are each one line naming the row."""
    nulls = [r for r, v in enumerate(values) if v is None]
    if nulls:
        raise VitlabError(f"{path}: {names(nulls[0])} has a null label ({len(nulls)} of {len(values)} rows have one); "
                          "accepted: a label for every image")
    negative = [r for r, v in enumerate(values) if isinstance(v, int) and v < 0]
    if negative:
        raise VitlabError(f"{path}: {names(negative[0])} has label {values[negative[0]]} (an unlabelled split has "
                          "labels -1): give the files of the labelled splits only")
    if classes is None and all(isinstance(v, int) for v in values):
        counts = np.bincount(np.asarray(values, dtype=np.int64), minlength=1)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            row = int(np.argmax(values))
            raise VitlabError(f"{path}: {names(row)} has label {values[row]}, which makes {len(counts)} classes "
                              f"(integer labels are class indices), {len(empty)} of them with no image (e.g. "
                              f"{', '.join(map(str, empty[:3]))}); accepted: labels 0..K-1 with images in each class, "
                              "or class names in the file's ClassLabel metadata")
        classes = [str(i) for i in range(len(counts))]
    if classes is None:
        classes, index = class_index([str(v) for v in values], str(path))
    else:
        index = {c: i for i, c in enumerate(classes)}
        unknown = [r for r, v in enumerate(values) if not isinstance(v, int) and str(v) not in index]
        if unknown:
            raise VitlabError(f"{path}: {names(unknown[0])} has label {quote(values[unknown[0]])}, which is not one of "
                              f"the {len(classes)} class names of its ClassLabel metadata; accepted: "
                              f"{', '.join(map(quote, classes[:10]))}{', ...' if len(classes) > 10 else ''}")
    labels = np.array([v if isinstance(v, int) else index[str(v)] for v in values], dtype=np.int64)
    return classes, labels


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
    schemas = [_parquet_call(pq.read_schema, f) for f in train_files + test_files]
    first = train_files[0]
    image_col = _column(schemas[0].names, _IMAGE_COLUMNS, "image", first)
    label_col = _column(schemas[0].names, _LABEL_COLUMNS, "label", first)
    raw_labels, counts = [], []
    for f in train_files + test_files:
        try:
            col = pq.read_table(f, columns=[label_col]).column(0)
        except (OSError, KeyError, ValueError) as e:
            raise VitlabError(f"{f} is not a readable Parquet file with a {label_col!r} column ({e})") from None
        raw_labels.append(col.to_pylist())
        counts.append(len(col))
    all_files = train_files + test_files
    starts = np.cumsum([0, *counts])
    n_train = int(starts[len(train_files)])

    def names(row: int) -> str:
        k = int(np.searchsorted(starts, row, side="right")) - 1
        return f"{all_files[k].relative_to(root)} row {row - starts[k]}"

    classes, labels = _parquet_labels([v for part in raw_labels for v in part], _class_names(schemas[0], label_col),
                                      path, names)

    def payloads(start: int) -> Iterator[Payload]:
        for k, f in enumerate(all_files):
            if starts[k + 1] <= start:
                continue
            skip = max(0, start - int(starts[k]))
            for batch in _parquet_batches(pq, f, image_col):
                for v in batch.column(0).to_pylist():
                    if skip:
                        skip -= 1
                        continue
                    data = v.get("bytes") if isinstance(v, dict) else v
                    yield data if isinstance(data, bytes) else b""

    return Listing(str(path), classes, labels, n_train, bool(test_files), names, payloads)


def _looks_like_file(cell: str, folder: Path) -> bool:
    cell = cell.strip()
    return cell.lower().endswith(IMAGE_EXTENSIONS) or (folder / cell).expanduser().is_file()


def _path_column(rows: list[tuple[int, list[str]]], folder: Path) -> int:
    """0 or 1: the column that names image files (the one more of whose cells do; 0 on a tie)."""
    sample = [r for _, r in rows[:1000] if len(r) == 2]
    hits = [sum(_looks_like_file(r[k], folder) for r in sample) for k in (0, 1)]
    return 1 if hits[1] > hits[0] else 0


def _once_each(rows: list[tuple[int, list[str]]], col: int, path: Path, log: Log) -> list[tuple[int, list[str]]]:
    """The rows with each image file once: a line that repeats an earlier one's file (the same path, or a link to
    it) is removed, and said, so that no image lands in both splits; one that gives it another label is refused."""
    first: dict[str, tuple[int, str]] = {}
    kept, repeats = [], []
    for line, r in rows:
        file, label = os.path.realpath((path.parent / r[col].strip()).expanduser()), r[1 - col].strip()
        if file not in first:
            first[file] = (line, label)
            kept.append((line, r))
            continue
        seen, seen_label = first[file]
        if seen_label != label:
            raise VitlabError(f"{path} line {line} lists {r[col].strip()} as {label!r}, line {seen} as {seen_label!r}; "
                              "accepted: each image once, with one label")
        repeats.append(f"line {line} repeats line {seen}")
    if repeats:
        log(f"{path}: {len(repeats)} line{'s' if len(repeats) > 1 else ''} listing an image already listed removed "
            f"(an image is used once), e.g. {', '.join(repeats[:3])}")
    return kept


def list_table(path: Path, log: Log) -> Listing:
    """The rows of a CSV/TSV file of ``path,label`` lines (or ``label,path``), in file order."""
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [(i + 1, r) for i, r in enumerate(csv.reader(f, delimiter=delimiter)) if r and any(r)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise VitlabError(f"{path} is not a readable {'TSV' if delimiter == chr(9) else 'CSV'} file ({e})") from None
    col = _path_column(rows[1:] or rows, path.parent)
    if rows and len(rows[0][1]) == 2 and not _looks_like_file(rows[0][1][col], path.parent):
        log(f"{path}: reading line 1 ({delimiter.join(rows[0][1])!r}) as the header: it names no image file")
        rows = rows[1:]
    bad = [(line, r) for line, r in rows if len(r) != 2 or not r[0].strip() or not r[1].strip()]
    if bad:
        line, r = bad[0]
        raise VitlabError(f"{path} line {line}: expected 'path{delimiter}label', got {delimiter.join(r)!r}")
    if not rows:
        raise VitlabError(f"{path} lists no images; expected one 'path{delimiter}label' line per image")
    rows = _once_each(rows, col, path, log)
    classes, index = class_index([r[1 - col].strip() for _, r in rows], str(path))
    labels = np.array([index[r[1 - col].strip()] for _, r in rows], dtype=np.int64)
    files = [str((path.parent / r[col].strip()).expanduser()) for _, r in rows]
    log(f"{path}: {len(rows)} images in {len(classes)} classes")

    def names(row: int) -> str:
        return f"{path.name} line {rows[row][0]}: {rows[row][1][col].strip()}"

    def payloads(start: int) -> Iterator[Payload]:
        yield from files[start:]

    return Listing(str(path), classes, labels, len(rows), False, names, payloads, files.__getitem__)
