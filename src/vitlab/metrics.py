"""Evaluation: logits of every head over an in-memory split, and the metrics of a confusion matrix."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .data.augment import normalize
from .devices import autocast, to_device
from .finite import check_finite, nonfinite_rows


def head_logits(model: nn.Module, x: torch.Tensor, tta: bool = False, translate: int = 0) -> dict[str, torch.Tensor]:
    """Eval logits by head: {'logits'} and, for a distilled model, also {'cls', 'dist'} (logits is their mean).

    With ``tta`` each head's logits are the mean over the image and its mirror image (test-time
    augmentation by horizontal flip: right for photographs, wrong for digits or text). With ``translate``
    N > 0 as well, airbench's mirror + translate: half that mean, plus a quarter each of the same mean for
    the image shifted by N pixels up-left and down-right (borders reflected).
    """
    if tta and translate:
        h, w = x.shape[-2:]
        padded = F.pad(x, (translate,) * 4, mode="reflect")
        shifted = torch.cat([padded[..., :h, :w], padded[..., 2 * translate:, 2 * translate:]])
        centre, moved = head_logits(model, x, True), head_logits(model, shifted, True)
        return {name: v / 2 + sum(moved[name].chunk(2)) / 4 for name, v in centre.items()}
    if tta:
        both = head_logits(model, torch.cat([x, x.flip(-1)]))
        return {name: sum(v.chunk(2)) / 2 for name, v in both.items()}
    if len(getattr(model, "classifier_names", ())) < 2:
        return {"logits": model(x)}
    cls, dist = model.forward_heads(model.forward_features(x))
    return {"logits": (cls + dist) / 2, "cls": cls, "dist": dist}


@torch.no_grad()
def confusion_counts(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float],
                     std: Sequence[float], num_classes: int, batch_size: int = 256, precision: str = "fp32",
                     progress=None, tta: bool = False, view: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     tta_translate: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Per head: confusion matrix (true, predicted), top-5 hits and summed loss over uint8 images.

    The images may live anywhere (host memory, a memory-mapped store, the device) and are read a
    batch at a time; ``view`` turns a uint8 batch into what the model sees (e.g. a resize and centre
    crop of stored photos). The model runs on its own device, and the counts stay there (nothing is
    read back per batch).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: dict[str, dict[str, torch.Tensor]] = {}
    k = top_k(num_classes)
    for i in range(0, len(images), batch_size):
        n = min(batch_size, len(images) - i)
        batch = to_device(images.narrow(0, i, n), device)
        x = normalize(view(batch) if view is not None else batch, mean, std)
        y = to_device(labels.narrow(0, i, n), device)
        with autocast(device, precision):
            heads = head_logits(model, x, tta, tta_translate)
        for name, logits in heads.items():
            logits = logits.float()
            acc = out.setdefault(name, {
                "confusion": torch.zeros(num_classes * num_classes, dtype=torch.long, device=device),
                "top5": torch.zeros((), dtype=torch.long, device=device),
                "loss": torch.zeros((), dtype=torch.float64, device=device),
                "nonfinite": torch.zeros((), dtype=torch.long, device=device)})
            acc["nonfinite"] += nonfinite_rows(logits)
            cells = y * num_classes + logits.argmax(1)
            acc["confusion"].index_add_(0, cells, torch.ones_like(cells))
            acc["top5"] += (logits.topk(k, dim=1).indices == y.unsqueeze(1)).any(1).sum()
            acc["loss"] += F.cross_entropy(logits, y, reduction="sum").double()
        if progress is not None:
            progress.update(len(x))
    model.train(was_training)
    for acc in out.values():
        acc["confusion"] = acc["confusion"].view(num_classes, num_classes)
    return out


def top_k(num_classes: int) -> int:
    """The k of the "top-5" accuracy: 5, or every class when there are fewer (its value is then 100%)."""
    return min(5, num_classes)


def top_k_text(per_class: dict[str, float] | None) -> str:
    """'top-5', or 'top-3' for 3 classes: the name of the top-k accuracy that was measured."""
    return f"top-{top_k(len(per_class)) if per_class else 5}"


def metrics_from_counts(counts: dict[str, torch.Tensor], classes: Sequence[str]) -> dict:
    """top1, top5, loss, per-class accuracy and the row-normalised confusion matrix."""
    counts = {name: t.cpu() for name, t in counts.items()}
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
                   mean: Sequence[float], std: Sequence[float], batch_size: int = 256, precision: str = "fp32",
                   progress=None, tta: bool = False, tta_translate: int = 0, source: object = "the model"
                   ) -> dict[str, dict]:
    """Metrics per head ('logits', and 'cls'/'dist' for distilled models) on one process; a model whose logits hold
    a NaN or an Inf is refused (ValueError) rather than scored."""
    counts = confusion_counts(model, images, labels, mean, std, len(classes), batch_size, precision, progress, tta,
                              tta_translate=tta_translate)
    for name, c in counts.items():
        check_finite(c["nonfinite"], len(images), "logits" if name == "logits" else f"{name} logits", source)
    return {name: metrics_from_counts(c, classes) for name, c in counts.items()}
