"""Integer labels taken as class indices without class names (arrays, shards without classes.txt, Parquet
without ClassLabel metadata): a label far beyond the others would make classes with no image between, a head
trained on classes that never occur, so every source refuses it as Parquet does, naming the label."""
from __future__ import annotations

import numpy as np

from ..errors import VitlabError


def check_no_empty_classes(labels: np.ndarray, where: str, names: str) -> None:
    """One line when integer ``labels`` 0..max leave a class with no image; ``names`` says how to name the classes
    instead (the option or file that would)."""
    if not len(labels):
        return
    counts = np.bincount(np.asarray(labels, np.int64), minlength=1)
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        raise VitlabError(f"{where} hold label {int(labels.max())}, which makes {len(counts)} classes (integer labels "
                          f"are class indices), {len(empty)} of them with no image (e.g. "
                          f"{', '.join(map(str, empty[:3]))}); accepted: labels 0..K-1 with images in each class, or "
                          f"{names}")
