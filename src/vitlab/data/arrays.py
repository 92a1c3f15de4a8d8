"""NumPy arrays as a data source: images and labels in Keras's layout, written once into a store in the cache.

``((x_train, y_train), (x_test, y_test))``, or ``(x, y)`` alone (a held-out share is then split off as for a
folder without a test split, or the last share as Keras's ``validation_split``: ``hold_out_last``). Images
``(N, H, W, C)`` (C 1 or 3; ``(N, H, W)``, as Keras's MNIST, is one channel): uint8, or floats in [0, 1] or
[0, 255] (other integers in 0..255 too), converted to uint8 and said in the log. Labels: class indices ``(N,)`` or
``(N, 1)``, or one-hot rows ``(N, C)`` (Keras's ``to_categorical``), read as the index of each row's 1.
``store_arrays`` writes them into a store named by their content (``arrays-<key>`` in the cache folder) and returns
its folder: a source the trainer, ``vitlab eval`` and the command line read like any other. The same arrays find
the same store again.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import VitlabError
from .cache import CACHE_VERSION, cache_key, default_cache_dir
from .download import Log
from .labels import check_no_empty_classes
from .sources import _stratified_split
from .store import build_store

ACCEPTED = ("((x_train, y_train), (x_test, y_test)) or (x, y): images (N, H, W, C) with C 1 or 3, or (N, H, W), "
            "uint8 or floats in [0, 1] or [0, 255], and labels (N,) or (N, 1) of class indices, or one-hot (N, C)")
IMAGES = "uint8, or floats in [0, 1] or [0, 255]"
LABELS = "class indices (N,) or (N, 1), or one-hot rows (N, C)"
KIND = "arrays"  # the store header's kind: the store is the source itself (nothing to go stale)


def is_arrays(data: Any) -> bool:
    """Whether ``data`` is meant as arrays (a pair), not a source's name or path."""
    return isinstance(data, (tuple, list))


def split_arrays(data: Any, log: Log | None = None) -> tuple[tuple[np.ndarray, np.ndarray],
                                                            tuple[np.ndarray, np.ndarray] | None]:
    """((x_train, y_train), (x_test, y_test) or None) checked: images uint8 (N, C, H, W), labels int64 (N,); a
    VitlabError (one line) names what is wrong and what is accepted. ``log`` hears what was converted (float
    images, one-hot labels)."""
    if not is_arrays(data) or len(data) != 2:
        raise VitlabError(f"data of type {type(data).__name__} is not valid; accepted: {ACCEPTED}")
    if all(is_arrays(part) for part in data):
        train, test = data
        return pair(train, "train", log), pair(test, "test", log)
    return pair(data, "data", log), None


def pair(data: Any, name: str, log: Log | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One (images, labels) pair, checked; images as (N, C, H, W)."""
    if not is_arrays(data) or len(data) != 2:
        raise VitlabError(f"the {name} part is not an (images, labels) pair; accepted: {ACCEPTED}")
    x = images_nchw(data[0], f"{name} images", log)
    return x, labels_of(data[1], len(x), f"{name} labels", log)


def hold_out_last(data: Any, fraction: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """Keras's ``validation_split``: the last ``fraction`` of ``(x, y)``, taken before any shuffling, as the test
    split, ``((x[:k], y[:k]), (x[k:], y[k:]))`` with ``k = floor(N * (1 - fraction))``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise VitlabError(f"validation_split={fraction!r} is not valid; accepted: a number in (0, 1), e.g. 0.1")
    if not is_arrays(data) or len(data) != 2 or all(is_arrays(part) for part in data):
        raise VitlabError("validation_split holds out the last share of arrays (x, y); accepted with it: data (x, y), "
                          "not ((x_train, y_train), (x_test, y_test)), whose test part is held out already, nor a "
                          "source (its share: val_fraction)")
    x, y = (as_array(part, name) for part, name in zip(data, ("images", "labels")))
    if len(x) != len(y):
        raise VitlabError(f"labels number {len(y)}, the images {len(x)}; accepted: one label an image")
    k = int(np.floor(len(x) * (1 - fraction)))
    if k < 1 or k == len(x):
        raise VitlabError(f"validation_split={fraction!r} of {len(x)} images leaves {'no' if k < 1 else 'all'} "
                          "images to train on; accepted: a share that holds out at least one and keeps one")
    return (x[:k], y[:k]), (x[k:], y[k:])


def as_array(x: Any, name: str) -> np.ndarray:
    """``x`` as one array; a list of arrays of differing shapes is refused in one line (numpy's "inhomogeneous
    shape" in words)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)) and x:
        shapes = sorted({np.shape(item) for item in x}, key=str)
        if len(shapes) > 1:
            shown = ", ".join(map(str, shapes[:3])) + (", ..." if len(shapes) > 3 else "")
            raise VitlabError(f"the {name} given as a list have differing sizes ({shown}): the sizes differ; "
                              "accepted: one size for all (resize them first, or give a folder of image files, "
                              "which vitlab resizes)")
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nesting numpy cannot stack
        raise VitlabError(f"the {name} are not one array ({type(e).__name__}: {str(e).splitlines()[0][:80]}); "
                          "accepted: a NumPy array, or a list of arrays of one size") from None


def to_uint8(x: np.ndarray, name: str = "images", log: Log | None = None) -> np.ndarray:
    """Images as uint8: uint8 as they are; floats in [0, 1] scaled by 255 and floats in [0, 255] rounded; other
    integers in 0..255 cast; anything else refused in one line whose advice suits the values given."""
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind not in "iuf":
        raise VitlabError(f"{name} of dtype {x.dtype} are not valid; accepted: {IMAGES}")
    if x.size == 0:
        return x.astype(np.uint8)
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise VitlabError(f"{name} hold {int((~np.isfinite(x)).sum())} NaN or infinite values; accepted: {IMAGES}")
    low, high = float(x.min()), float(x.max())
    if x.dtype.kind in "iu":
        if low < 0 or high > 255:
            raise VitlabError(f"{name} of dtype {x.dtype} hold values {low:g}..{high:g}; accepted: {IMAGES}, or "
                              "integers in 0..255")
        if log is not None:
            log(f"{name}: {x.dtype} values in 0..255, read as uint8")
        return x.astype(np.uint8)
    if low >= 0 and high <= 1:
        if log is not None:
            log(f"{name}: {x.dtype} values in [0, 1] ({low:g}..{high:g}), read as x * 255 rounded to uint8")
        return np.rint(x * 255).astype(np.uint8)
    if low >= 0 and high <= 255:
        if log is not None:
            log(f"{name}: {x.dtype} values in [0, 255] ({low:g}..{high:g}), rounded to uint8")
        return np.rint(x).astype(np.uint8)
    if low < 0 and high <= 1 and low >= -1:
        advice = "they look scaled to [-1, 1]: give (x + 1) / 2, or the images before that scaling"
    elif low < 0:
        advice = "they look normalised (mean and std): give the images before normalisation, vitlab normalises"
    else:
        advice = f"they exceed 255: give them in [0, 255], e.g. x * (255 / {high:g})"
    raise VitlabError(f"{name} of dtype {x.dtype} hold values {low:g}..{high:g}, outside [0, 1] and [0, 255] "
                      f"({advice}); accepted: {IMAGES}")


def images_nchw(x: Any, name: str = "images", log: Log | None = None) -> np.ndarray:
    """Images (N, H, W, C) or (N, H, W) (``to_uint8``'s dtypes) as uint8 (N, C, H, W); one line naming the shape or
    dtype otherwise."""
    x = as_array(x, name)
    if x.ndim == 3:
        if log is not None:
            log(f"{name} of shape {x.shape}: read as one channel, (N, H, W, 1)")
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3) or min(x.shape[1:3]) < 1:
        raise VitlabError(f"{name} of shape {x.shape} are not valid; accepted: (N, H, W, C) with C 1 or 3, or "
                          "(N, H, W) (one channel)")
    x = to_uint8(x, name, log)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def labels_of(y: Any, n: int, name: str = "labels", log: Log | None = None) -> np.ndarray:
    """Labels as int64 class indices (N,), each >= 0: indices (N,) or (N, 1) (integers, or floats that are whole),
    or one-hot rows (N, C) (the index of each row's 1); soft rows and anything else refused in one line."""
    y = as_array(y, name)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    elif y.ndim == 2 and y.shape[1] > 1 and y.dtype.kind in "iufb":
        y = one_hot_classes(y, name, log)
    whole = y.dtype.kind == "f" and y.ndim == 1 and np.isfinite(y).all() and (y == np.round(y)).all()
    if (y.dtype.kind not in "iu" and not whole) or y.ndim != 1:
        raise VitlabError(f"{name} of dtype {y.dtype} and shape {y.shape} are not valid; accepted: integers of shape "
                          f"(N,) or (N, 1) (class indices), or one-hot rows (N, C)")
    if len(y) != n:
        raise VitlabError(f"{name} number {len(y)}, the images {n}; accepted: one label an image")
    if len(y) and y.min() < 0:
        raise VitlabError(f"{name} hold {int(y.min())}; accepted: class indices 0, 1, ...")
    return y.astype(np.int64)


def one_hot_classes(y: np.ndarray, name: str, log: Log | None = None) -> np.ndarray:
    """The class index of each one-hot row of ``y`` (N, C); rows that are not one 1 among 0s refused in one line,
    soft rows (probabilities) among them with what vitlab offers instead."""
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        raise VitlabError(f"{name} of shape {y.shape} hold NaN or infinite values; accepted: {LABELS}")
    ones, zeros = (y == 1), (y == 0)
    bad = ~((ones | zeros).all(1) & (ones.sum(1) == 1))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        shown = ", ".join(f"{v:g}" for v in y[row, :6].astype(float)) + (", ..." if y.shape[1] > 6 else "")
        soft = y.dtype.kind == "f" and (y >= 0).all() and np.allclose(y.sum(1), 1, atol=1e-3)
        why = ("are soft targets (probabilities), which vitlab does not train on: it softens one-hot targets itself "
               "(label_smoothing, mixup, cutmix)") if soft else "are neither class indices nor one-hot"
        raise VitlabError(f"{name} of shape {y.shape} {why} (row {row}: {shown}); accepted: {LABELS}"
                          f"{', e.g. y.argmax(1)' if soft else ''}")
    if log is not None:
        log(f"{name}: one-hot rows {y.shape}, read as the class index of each row's 1")
    return ones.argmax(1)


def class_list(labels: Sequence[np.ndarray], class_names: Sequence[str] | None) -> list[str]:
    """The class names: ``class_names``, or "0".."K-1" for K the largest label + 1."""
    k = max((int(y.max()) + 1 for y in labels if len(y)), default=0)
    if class_names is None:
        check_no_empty_classes(np.concatenate(labels), "the arrays", "class_names naming each class")
        return [str(i) for i in range(k)]
    names = [str(c) for c in class_names]
    if len(names) < k or len(set(names)) != len(names):
        twice = " (some twice)" if len(set(names)) < len(names) else ""
        raise VitlabError(f"class_names holds {len(names)} names{twice}; accepted: {k} distinct names or more, one for "
                          f"each label 0..{k - 1}")
    return names


def store_arrays(data: Any, *, class_names: Sequence[str] | None = None, cache_dir: str | os.PathLike | None = None,
                 val_fraction: float = 0.2, seed: int = 0, log: Log = print) -> Path:
    """The store folder of ``data`` (Keras's layout, see the module), built on first use; ``val_fraction`` and
    ``seed`` split ``(x, y)`` alone as ``load_data`` splits a source without a test split."""
    (x, y), test = split_arrays(data, log)
    if test is not None and test[0].shape[1:] != x.shape[1:]:
        raise VitlabError(f"the test images are {test[0].shape[1]}x{test[0].shape[2]}x{test[0].shape[3]} (C x H x W), "
                          f"the training images {x.shape[1]}x{x.shape[2]}x{x.shape[3]}; accepted: the same shape")
    classes = class_list([y] if test is None else [y, test[1]], class_names)
    images = x if test is None else np.concatenate([x, test[0]])
    labels = y if test is None else np.concatenate([y, test[1]])
    digest = hashlib.sha256()
    for part in (images, labels, np.asarray(images.shape), np.asarray([len(x)])):
        digest.update(np.ascontiguousarray(part).tobytes())
    split = [] if test is not None else [float(val_fraction), int(seed)]
    key = cache_key(KIND, digest.hexdigest(), classes, *split)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    header = {"key": key, "name": KIND, "source": f"{KIND} {images.shape[0]}x{'x'.join(map(str, images.shape[1:]))}",
              "kind": KIND, "fit": "squash", "fingerprint": digest.hexdigest(), "fingerprint_of": "",
              "cache_version": CACHE_VERSION, "classes": classes,
              "listed_per_class": np.bincount(labels, minlength=len(classes)).tolist()}

    def fill(rows_file: Path, start: int, done) -> None:
        rows = np.memmap(rows_file, np.uint8, "r+", shape=images.shape)
        rows[start:] = images[start:]
        rows.flush()
        del rows
        done(len(images), [])

    def arrange(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if test is not None:
            return np.arange(len(x)), np.arange(len(x), len(images))
        train_rows, test_rows = _stratified_split(torch.from_numpy(labels), val_fraction, seed)
        return train_rows.numpy(), test_rows.numpy()

    store, _ = build_store(cache / f"{KIND}-{key}", header, tuple(images.shape), labels, fill, arrange, log)
    return store.path
