"""Judge a frozen model on a data set in minutes: the features of both splits once (cached on disk), then DINO's
weighted k-NN and a full-batch linear probe on them, each scored on the test split."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .. import checkpoint
from ..data.cache import FEATURES_DIR, default_cache_dir
from ..data.sources import load_data
from ..data.views import Preprocess, stratified_subset
from ..devices import resolve_device
from ..errors import NotFoundError, VitlabError
from ..infer.precision import inference_precision
from ..models.registry import create_model, get_spec
from ..progress import log_line
from ..runs.folder import check_model_written
from ..runs.identity import check_data
from .classifiers import accuracy, knn_classify, linear_probe
from .features import PRECISIONS, extract_features

PROBE_JSON = "probe.json"  # what `vitlab probe --out` writes in its folder


def open_model(spec: str | os.PathLike, img_size: int | None = None) -> tuple[nn.Module, str]:
    """(model, its weights in words) from anything ``vitlab.load`` reads, or a registered name (random weights);
    ``img_size`` runs it at another input size (its position table resampled)."""
    text = os.fspath(spec)
    size = {"img_size": img_size} if img_size else {}
    if Path(text).exists() or text.startswith("hf-hub:"):
        check_model_written(text)
        return checkpoint.load(text, **size), "trained weights"
    try:
        get_spec(text)
    except ValueError as e:
        raise NotFoundError(f"{text} is neither a model folder, a hub id (hf-hub:ORG/NAME) nor a registered model "
                            f"name ({e}); accepted: a run, timm or Hugging Face folder, a hub id, or a registered "
                            "name (random weights)") from None
    return create_model(text, num_classes=0, **size), "random weights"


def feature_precision(model: nn.Module, asked: str, device: torch.device, spec: str | os.PathLike,
                      log: Callable[[str], None]) -> str:
    """fp32 or bf16 for the features: ``asked``, or for 'auto' what inference takes (a run's own, or the rule);
    a run's fp16 (a GPU's) becomes the rule's choice, and fp16 asked for is refused in one line."""
    if asked not in ("auto", *PRECISIONS):
        raise VitlabError(f"precision {asked!r} is not valid for features; accepted: auto, {', '.join(PRECISIONS)}")
    folder = spec if asked == "auto" and Path(spec).is_dir() else None
    precision = inference_precision(model, asked, device, folder, log)
    return precision if precision in PRECISIONS else inference_precision(model, asked, device, None, log)


def split_images(model: nn.Module, data: str, *, seed: int, val_fraction: float, train_fraction: float,
                 cache_dir: str | None, download: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """The data set's two splits decoded by the model's own preprocessing, split as a training run splits them
    (``seed``, ``val_fraction``; ``train_fraction`` of every class of the training split, the test split whole)."""
    prep = Preprocess.from_cfg(model.pretrained_cfg)
    bundle = load_data(data, img_size=prep.size, in_chans=model.pretrained_cfg["input_size"][0], cache_dir=cache_dir,
                       download=download, val_fraction=val_fraction, seed=seed, log=log, fit=prep.fit)
    if bundle.shards is not None:
        raise VitlabError(f"{data} is streamed from WebDataset shards: a probe needs every training image at hand; "
                          "accepted: a folder or a store (vitlab data unpack writes shards back as a folder)")
    if bundle.unlabelled:
        raise VitlabError(f"{data} is a folder of unlabelled images (no class folders): a probe needs "
                          "<root>/<class>/<image>")
    train, test = bundle.train, bundle.test
    keep = stratified_subset(train.labels, train_fraction)
    if len(test.images) == 0 or len(keep) < 2:
        raise VitlabError(f"{data} leaves {len(keep)} training and {len(test.images)} test images "
                          f"(val_fraction {val_fraction:g}, train_fraction {train_fraction:g}); accepted: classes of "
                          "at least 2 images each, or larger fractions")
    splits = {"train": (train.images[keep] if train_fraction < 1 else train.images, train.labels[keep]),
              "test": (test.images, test.labels)}
    for name, (images, labels) in splits.items():
        if tuple(images.shape[-2:]) != prep.size:  # a store folder of another size
            splits[name] = (torch.cat([prep.apply(x) for x in images.split(1024)]), labels)
    return {"name": bundle.name, "classes": list(bundle.classes), "size": prep.size, "identity": bundle.identity,
            **splits}


def probe(model_spec: str | os.PathLike, data: str, *, seed: int = 0, val_fraction: float = 0.2,
          train_fraction: float = 1.0, k: int = 20, temperature: float = 0.07, weight_decay: float = 1e-4,
          batch_size: int = 64, device: str = "auto", precision: str = "auto", cache_dir: str | None = None,
          download: bool = False, progress: bool = True, log: Callable[[str], None] = log_line,
          now: Callable[[], float] = time.perf_counter, img_size: int | None = None) -> dict[str, Any]:
    """k-NN and linear-probe top-1 of a frozen model's pre-logits features on ``data``'s test split.

    The features are computed once per (weights, images, preprocessing) and cached under
    ``<cache_dir>/features`` (the data cache's folder by default), on ``device`` (auto: a GPU when there is
    one). ``now`` is the clock the result's seconds are read from; ``img_size`` runs the model at another input
    size than its own (a DINOv2 at 224 instead of 518: its position table resampled, its preprocessing rule kept).
    ``precision``: fp32, bf16 or auto (a run folder's own where it is one of those, else bf16 where it pays for the
    model: ``infer.precision.inference_precision``).
    """
    dev = resolve_device(device)
    model, weights = open_model(model_spec, img_size)
    sets = split_images(model, data, seed=seed, val_fraction=val_fraction, train_fraction=train_fraction,
                        cache_dir=cache_dir, download=download, log=log)
    check_data(model_spec, sets["identity"], "probe", own=False)  # a run's data set: the split it trained on
    precision = feature_precision(model, precision, dev, model_spec, log)
    cfg = model.pretrained_cfg
    features_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    seconds, feats = {}, {}
    t0 = now()
    for name in ("train", "test"):
        feats[name] = extract_features(model, sets[name][0], batch_size, dev, progress, mean=cfg["mean"],
                                       std=cfg["std"], size=sets["size"], precision=precision,
                                       cache_dir=features_dir / FEATURES_DIR, log=log, source=model_spec)
    seconds["features"] = now() - t0
    (x_train, y_train), (x_test, y_test) = (feats["train"], sets["train"][1]), (feats["test"], sets["test"][1])
    classes = len(sets["classes"])
    t0 = now()
    knn = accuracy(knn_classify(x_train.to(dev), y_train, x_test.to(dev), k=k, temperature=temperature,
                                num_classes=classes), y_test)
    seconds["knn"] = now() - t0
    t0 = now()
    linear = linear_probe(x_train.to(dev), y_train, x_test.to(dev), y_test, num_classes=classes,
                          weight_decay=weight_decay)
    seconds["linear"] = now() - t0
    return {"model": os.fspath(model_spec), "weights": weights, "data": sets["name"], "classes": sets["classes"],
            "num_train": len(y_train), "num_test": len(y_test), "features": int(x_train.shape[1]),
            "input_size": list(sets["size"]), "device": str(dev), "precision": precision,
            "split": {"seed": seed, "val_fraction": val_fraction, "train_fraction": train_fraction},
            "knn": {"k": min(k, len(y_train)), "temperature": temperature, "top1": knn},
            "linear": {"weight_decay": weight_decay, "top1": linear.test_accuracy,
                       "train_top1": linear.train_accuracy},
            "seconds": seconds}
