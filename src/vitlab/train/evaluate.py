"""Evaluation: logits of every head over an in-memory split, and the metrics of a confusion matrix."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.augment import normalize


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on the device, or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def head_logits(model: nn.Module, x: torch.Tensor, tta: bool = False) -> dict[str, torch.Tensor]:
    """Eval logits by head: {'logits'} and, for a distilled model, also {'cls', 'dist'} (logits is their mean).

    With ``tta`` each head's logits are the mean over the image and its mirror image (test-time
    augmentation by horizontal flip: right for photographs, wrong for digits or text).
    """
    if tta:
        both = head_logits(model, torch.cat([x, x.flip(-1)]))
        return {name: (v[:len(x)] + v[len(x):]) / 2 for name, v in both.items()}
    if getattr(model, "dist_token", None) is None:
        return {"logits": model(x)}
    feats = model.forward_features(x)
    cls, dist = model.head(feats[:, 0]), model.head_dist(feats[:, 1])
    return {"logits": (cls + dist) / 2, "cls": cls, "dist": dist}


@torch.no_grad()
def confusion_counts(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float],
                     std: Sequence[float], num_classes: int, batch_size: int = 256, bf16: bool = False,
                     progress=None, tta: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Per head: confusion matrix (true, predicted), top-5 hits and summed loss over uint8 images."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: dict[str, dict[str, torch.Tensor]] = {}
    k = min(5, num_classes)
    for i in range(0, len(images), batch_size):
        x = normalize(images[i:i + batch_size].to(device, non_blocking=True), mean, std)
        y = labels[i:i + batch_size].to(device)
        with autocast(device, bf16):
            heads = head_logits(model, x, tta)
        for name, logits in heads.items():
            logits = logits.float()
            acc = out.setdefault(name, {"confusion": torch.zeros(num_classes, num_classes, dtype=torch.long),
                                        "top5": torch.zeros((), dtype=torch.long),
                                        "loss": torch.zeros((), dtype=torch.float64)})
            pred = logits.argmax(1)
            acc["confusion"] += torch.bincount((y * num_classes + pred).cpu(),
                                               minlength=num_classes ** 2).view(num_classes, num_classes)
            acc["top5"] += (logits.topk(k, dim=1).indices == y[:, None]).any(1).sum().cpu()
            acc["loss"] += F.cross_entropy(logits, y, reduction="sum").double().cpu()
        if progress is not None:
            progress.update(len(x))
    model.train(was_training)
    return out


def metrics_from_counts(counts: dict[str, torch.Tensor], classes: Sequence[str]) -> dict:
    """top1, top5, loss, per-class accuracy and the row-normalised confusion matrix."""
    conf = counts["confusion"].double()
    n = conf.sum().clamp(min=1)
    per_class = (conf.diag() / conf.sum(1).clamp(min=1)).tolist()
    return {
        "top1": float(conf.diag().sum() / n),
        "top5": float(counts["top5"].double() / n),
        "loss": float(counts["loss"] / n),
        "per_class": dict(zip(classes, per_class)),
        "confusion": counts["confusion"].tolist(),
        "count": int(n),
    }


def evaluate_model(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, classes: Sequence[str],
                   mean: Sequence[float], std: Sequence[float], batch_size: int = 256, bf16: bool = False,
                   progress=None, tta: bool = False) -> dict[str, dict]:
    """Metrics per head ('logits', and 'cls'/'dist' for distilled models) on one process."""
    counts = confusion_counts(model, images, labels, mean, std, len(classes), batch_size, bf16, progress, tta)
    return {name: metrics_from_counts(c, classes) for name, c in counts.items()}
