"""A study's linear probes: each pre-trained encoder (and an untrained one) judged by a logistic regression on its
frozen features of the labelled share of the training split, scored on the test split; and the pre-training runs'
own figures for the report."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint
from ..data import load_data
from ..data.views import stratified_subset
from ..models.registry import create_model
from ..probe import extract_features, knn_classify, linear_probe
from ..runs.format import read_summary
from .claims import RANDOM_ENCODER, VIT, encoder_name, probe_label

KNN_K = 20


def pretraining_rows(runs: dict[str, Path]) -> list[dict[str, Any]]:
    """One row per pre-training run (label -> folder): its method, epochs, img/s and held-out objective loss."""
    rows = []
    for label, folder in runs.items():
        s = read_summary(folder)
        rows.append({"label": label, "method": s.pretrain, "epochs": s.epochs, "images_per_second":
                     s.images_per_second, "test_loss": s.test_loss, "train_seconds": s.train_seconds,
                     "run": str(folder)})
    return rows


def _encoders(runs: dict[str, Path], size: tuple[int, int], in_chans: int) -> dict[str, torch.nn.Module]:
    """name -> frozen encoder: each pre-training run's, and the same architecture untrained (seed 0)."""
    encoders = {encoder_name(label): checkpoint.load(folder) for label, folder in runs.items()}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        encoders[RANDOM_ENCODER] = create_model(VIT, num_classes=0, img_size=size, in_chans=in_chans)
    return encoders


def probe_rows(runs: dict[str, Path], fractions: Sequence[float], data: str, img_size: int | None,
               share: float, cache_dir: str | None, features_dir: Path, threads: int,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per (encoder, share of the labels): the linear probe's test top-1 (and, on every label, the
    weighted k-NN's), in the study's row format. ``share`` scales the shares (the quick mode's fifth)."""
    cfg = checkpoint.load(next(iter(runs.values()))).pretrained_cfg
    in_chans, H, W = (int(v) for v in cfg["input_size"])
    size = (img_size, img_size) if img_size else (H, W)
    bundle = load_data(data, img_size=size, in_chans=in_chans, cache_dir=cache_dir, log=lambda s: None)
    train, test = bundle.train, bundle.test
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows, folders = [], {encoder_name(label): folder for label, folder in runs.items()}
    widest = stratified_subset(train.labels, max(fractions) * share)  # the shares nest: features of these only
    labels = train.labels[widest]
    try:
        for name, encoder in _encoders(runs, size, in_chans).items():
            log(f"linear probe: {name}")
            kw = dict(mean=bundle.mean, std=bundle.std, cache_dir=features_dir, progress=False, batch_size=256)
            train_f = extract_features(encoder, train.images[widest], **kw)
            test_f = extract_features(encoder, test.images, **kw)
            for f in fractions:
                keep = torch.isin(widest, stratified_subset(train.labels, f * share))
                probe = linear_probe(train_f[keep], labels[keep], test_f, test.labels, num_classes=len(bundle.classes))
                knn = None
                if f == 1.0:
                    pred = knn_classify(train_f[keep], labels[keep], test_f, k=KNN_K, num_classes=len(bundle.classes))
                    knn = float((pred == test.labels).double().mean())
                rows.append(_row(probe_label(name, f), name, int(keep.sum()), probe.test_accuracy, knn,
                                 folders.get(name)))
    finally:
        torch.set_num_threads(threads_before)
    return rows


def _row(label: str, group: str, n: int, top1: float, knn: float | None, run: Path | None) -> dict[str, Any]:
    """A probe in the study's row format (report.aggregate's keys)."""
    return {"label": label, "group": "linear probe", "encoder": group, "teacher": False, "model": VIT,
            "parameters": None, "train_images": n, "top1": {0: top1}, "top1_mean": top1, "top1_std": None,
            "cls_mean": None, "dist_mean": None, "epochs": None, "images_per_second": None, "knn": knn,
            "runs": [str(run)] if run else []}
