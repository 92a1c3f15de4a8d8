"""NumPy arrays as a data source: images and labels in Keras's layout, written once into a store in the cache.

``((x_train, y_train), (x_test, y_test))``, or ``(x, y)`` alone (a held-out share is then split off as for a
folder without a test split), with uint8 images ``(N, H, W, C)`` (C 1 or 3; ``(N, H, W)`` is one channel) and
integer labels ``(N,)`` or ``(N, 1)``. ``store_arrays`` writes them into a store named by their content
(``arrays-<key>`` in the cache folder) and returns its folder: a source the trainer, ``vitlab eval`` and the
command line read like any other. The same arrays find the same store again.
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

ACCEPTED = ("((x_train, y_train), (x_test, y_test)) or (x, y): uint8 images (N, H, W, C) with C 1 or 3, or "
            "(N, H, W), and integer labels (N,) or (N, 1)")
KIND = "arrays"  # the store header's kind: the store is the source itself (nothing to go stale)


def is_arrays(data: Any) -> bool:
    """Whether ``data`` is meant as arrays (a pair), not a source's name or path."""
    return isinstance(data, (tuple, list))


def split_arrays(data: Any) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """((x_train, y_train), (x_test, y_test) or None) checked: images uint8 (N, C, H, W), labels int64 (N,); a
    ValueError (one line) names what is wrong and what is accepted."""
    if not is_arrays(data) or len(data) != 2:
        raise VitlabError(f"data of type {type(data).__name__} is not valid; accepted: {ACCEPTED}")
    if all(is_arrays(part) for part in data):
        train, test = data
        return pair(train, "train"), pair(test, "test")
    return pair(data, "data"), None


def pair(data: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One (images, labels) pair, checked; images as (N, C, H, W)."""
    if not is_arrays(data) or len(data) != 2:
        raise VitlabError(f"the {name} part is not an (images, labels) pair; accepted: {ACCEPTED}")
    return images_nchw(data[0], f"{name} images"), labels_of(data[1], len(data[0]), f"{name} labels")


def images_nchw(x: Any, name: str = "images") -> np.ndarray:
    """uint8 (N, H, W, C) or (N, H, W) as (N, C, H, W); one line naming the shape or dtype otherwise."""
    x = as_array(x, name)
    if x.dtype != np.uint8:
        hint = f" ({float_advice(x)})" if x.dtype.kind == "f" else ""
        raise VitlabError(f"{name} of dtype {x.dtype} are not valid; accepted: uint8{hint}")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3) or min(x.shape[1:3]) < 1:
        raise VitlabError(f"{name} of shape {x.shape} are not valid; accepted: (N, H, W, C) with C 1 or 3, or "
                          "(N, H, W)")
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def as_array(x: Any, name: str) -> np.ndarray:
    """``np.asarray(x)``; a list of arrays of different shapes is one line naming the shapes (numpy's own words are
    "inhomogeneous shape")."""
    try:
        return np.asarray(x)
    except ValueError:
        shapes = sorted({np.shape(i) for i in x}, key=str) if isinstance(x, (list, tuple)) else []
        if len(shapes) < 2:
            raise
        raise VitlabError(f"{name} come in {len(shapes)} shapes ({', '.join(map(str, shapes[:4]))}"
                          f"{', ...' if len(shapes) > 4 else ''}); accepted: one shape for all (resize them to one "
                          "size first)") from None


def float_advice(x: np.ndarray) -> str:
    """How to bring float images to uint8, fitting the values given: 0..1 scaled by 255, 0..255 rounded as they are,
    anything else stretched from its own range."""
    lo, hi = (float(np.nanmin(x)), float(np.nanmax(x))) if x.size else (0.0, 1.0)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "they hold NaN or Inf: replace those first"
    if lo >= 0 and hi <= 1:
        return "values in 0..1: convert with (x * 255).round().astype('uint8')"
    if lo >= 0 and hi <= 255:
        return f"values in 0..{hi:g}, already on the 0..255 scale: convert with x.round().astype('uint8')"
    return (f"values in {lo:g}..{hi:g}: bring them to 0..255 first, e.g. ((x - x.min()) / (x.max() - x.min()) * 255)"
            ".round().astype('uint8')")


def labels_of(y: Any, n: int, name: str = "labels") -> np.ndarray:
    """Integer labels (N,) or (N, 1) as int64 (N,), each >= 0."""
    y = as_array(y, name)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.dtype.kind not in "iu" or y.ndim != 1:
        raise VitlabError(f"{name} of dtype {y.dtype} and shape {y.shape} are not valid; accepted: integers of shape "
                          f"(N,) or (N, 1)")
    if len(y) != n:
        raise VitlabError(f"{name} number {len(y)}, the images {n}; accepted: one label an image")
    if len(y) and y.min() < 0:
        raise VitlabError(f"{name} hold {int(y.min())}; accepted: class indices 0, 1, ...")
    return y.astype(np.int64)


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
    (x, y), test = split_arrays(data)
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
