"""Whether a pre-training run paid: the weighted k-NN top-1 of its encoder beside that of an untrained encoder of the
same architecture and seed, on a bounded subset of the data's labelled splits, said in one line and kept in the run's
summary.json. It costs seconds on the digits and about a minute on CIFAR-10 (the features of at most
``KNN_TRAIN`` + ``KNN_TEST`` images, twice; the untrained encoder's are cached, so runs of one seed share them)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .. import checkpoint
from ..checkpoint import current_args
from ..data.cache import FEATURES_DIR, default_cache_dir
from ..data.views import stratified_subset
from ..devices import resolve_device
from ..models.registry import create_model
from ..progress import log_line
from ..runs.format import read_config, read_summary, write_summary
from .classifiers import accuracy, knn_classify
from .features import extract_features
from .run import feature_precision, split_images

KNN_TRAIN = 10_000  # labelled training images, at most (the same share of every class), the k-NN's neighbours
KNN_TEST = 2_000    # test images, at most, it is scored on
LEVEL = 0.01        # a difference under a point is within the test subset's own spread: level


def untrained_like(model: nn.Module, seed: int) -> nn.Module:
    """A model of the same architecture, arguments and preprocessing, as initialised after ``torch.manual_seed(seed)``
    (the global generator left as it was found)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = create_model(model.arch, **current_args(model))
    fresh.pretrained_cfg = dict(model.pretrained_cfg)
    return fresh


def bounded(images: torch.Tensor, labels: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At most ``most`` of the images, the same share of every class."""
    if len(labels) <= most:
        return images, labels
    keep = stratified_subset(labels, most / len(labels))
    return images[keep], labels[keep]


def verdict(trained: float, untrained: float) -> str:
    """What the two top-1s say, in words."""
    if trained > untrained + LEVEL:
        return "pre-training has paid: the encoder's features beat an untrained encoder's"
    if trained >= untrained - LEVEL:
        return ("pre-training has not paid yet: the encoder's features are level with an untrained encoder's (within a "
                "point); train longer (the guidance line at the start says about how long)")
    return ("pre-training has not paid yet: the encoder's features are below an untrained encoder's; train longer "
            "(the guidance line at the start says about how long) or fine-tune from scratch")


def encoder_knn(out: str | os.PathLike, k: int = 20, temperature: float = 0.07, cache_dir: str | None = None,
                progress: bool = True, log: Callable[[str], None] = log_line) -> dict[str, Any] | None:
    """The k-NN top-1 of a finished pre-training run's encoder and of an untrained one (``knn_top1``,
    ``knn_untrained_top1``, ``knn_train``, ``knn_test``), said on ``log``; None, said, where the data has no labelled
    test split."""
    out = Path(out)
    recipe = read_config(out)
    trained = checkpoint.load(out)
    cache = cache_dir or recipe.get("cache_dir")
    try:
        sets = split_images(trained, recipe["data"], seed=recipe["seed"], val_fraction=recipe["val_fraction"],
                            train_fraction=1.0, cache_dir=cache, download=False, log=lambda s: None)
    except ValueError as e:  # unlabelled images, or no test split (val_fraction 0)
        log(f"no k-NN of the encoder, which needs a labelled test split: {e}")
        return None
    (x_train, y_train), (x_test, y_test) = bounded(*sets["train"], KNN_TRAIN), bounded(*sets["test"], KNN_TEST)
    dev = resolve_device(recipe.get("device", "auto"))
    precision = feature_precision(trained, "auto", dev, out, log)
    features_dir = (Path(cache).expanduser() if cache else default_cache_dir()) / FEATURES_DIR
    top1 = {}
    for name, model in (("trained", trained), ("untrained", untrained_like(trained, recipe["seed"]))):
        feats = [extract_features(model, x, 256, dev, progress, size=sets["size"], precision=precision,
                                  cache_dir=features_dir, log=lambda s: None, source=f"the {name} encoder")
                 for x in (x_train, x_test)]
        top1[name] = accuracy(knn_classify(feats[0].to(dev), y_train, feats[1].to(dev), k=k, temperature=temperature,
                                           num_classes=len(sets["classes"])), y_test)
    log(f"k-NN top-1 {top1['trained']:.1%} (untrained encoder: {top1['untrained']:.1%}; weighted {min(k, len(y_train))}"
        f"-NN of {len(y_test):,} test images among {len(y_train):,} labelled training images): "
        f"{verdict(top1['trained'], top1['untrained'])}")
    return {"knn_top1": top1["trained"], "knn_untrained_top1": top1["untrained"], "knn_train": len(y_train),
            "knn_test": len(y_test)}


def judge_pretraining(out: str | os.PathLike, log: Callable[[str], None] = log_line, progress: bool = True) -> None:
    """At the end of a finished pre-training run: its encoder's k-NN beside an untrained one's, added to its
    summary.json (once: a run that has them keeps them)."""
    summary = read_summary(Path(out))
    if summary.pretrain == "none" or summary.knn_top1 is not None:
        return
    threads, wanted = torch.get_num_threads(), read_config(Path(out)).get("threads")
    try:
        if wanted:  # the run's own thread count (train() gave the one it found back)
            torch.set_num_threads(wanted)
        found = encoder_knn(out, log=log, progress=progress)
    finally:
        torch.set_num_threads(threads)
    if found is not None:
        for key, value in found.items():
            setattr(summary, key, value)
        write_summary(Path(out), summary)
