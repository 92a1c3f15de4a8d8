"""CIFAR-10 as NumPy arrays in Keras's layout, read from the archive of JPEG files (``train/<class>/*.jpg`` and
``test/<class>/*.jpg``): what ``keras.datasets.cifar10.load_data()`` returns, for the notebooks beside this file."""
from __future__ import annotations

import io
import os
import tarfile

import numpy as np
from PIL import Image

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
HERE = os.path.dirname(os.path.abspath(__file__))
ARCHIVE = os.environ.get("VITLAB_CIFAR10", os.path.join(HERE, "..", "..", "..", "shared", "data",
                                                        "cifar10-jpg.tar.gz"))


def load_cifar10(path: str = ARCHIVE, per_class: int | None = None, test_per_class: int | None = None):
    """((x_train, y_train), (x_test, y_test)): uint8 images (N, 32, 32, 3) and uint8 labels (N, 1), as Keras gives
    them; ``per_class`` / ``test_per_class`` keep the first so many images of each class (by file name)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no CIFAR-10 archive at {path}; accepted: the path of cifar10-jpg.tar.gz, given as "
                                "path= or in the environment variable VITLAB_CIFAR10")
    keep = {"train": per_class, "test": test_per_class}
    found: dict[str, dict[int, list[tuple[str, bytes]]]] = {"train": {}, "test": {}}
    with tarfile.open(path) as tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) != 3 or parts[0] not in found or parts[1] not in CLASSES:
                continue
            found[parts[0]].setdefault(CLASSES.index(parts[1]), []).append((parts[2], tar.extractfile(member).read()))
    return tuple(_arrays(found[split], keep[split]) for split in ("train", "test"))


def _arrays(by_class: dict[int, list[tuple[str, bytes]]], limit: int | None):
    images, labels = [], []
    for label in sorted(by_class):
        for _, data in sorted(by_class[label])[:limit]:
            images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            labels.append(label)
    return np.stack(images), np.asarray(labels, np.uint8).reshape(-1, 1)
