"""Supervised classification: soft-target cross-entropy on the (mixed, smoothed) targets, the metrics of a confusion
matrix per head, curves and a confusion matrix drawn."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...metrics import confusion_counts, metrics_from_counts
from ...runs.figures import LOSS_NAMES, plot_confusion, plot_curves
from ...runs.format import CONFUSION_PNG, CURVES_PNG, EpochRow
from ..finetune import fit_head
from ..step import correct
from .base import EvalSplit, Task

if TYPE_CHECKING:
    from ..recipe import Recipe


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of -sum(targets * log_softmax(logits)): cross-entropy against soft targets (rows summing
    to 1), timm's SoftTargetCrossEntropy."""
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


def heads_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of the class head; for a model with a distillation head as well, the mean of both."""
    if not isinstance(outputs, tuple):
        return soft_target_cross_entropy(outputs, targets)
    cls, dist = outputs
    return (soft_target_cross_entropy(cls, targets) + soft_target_cross_entropy(dist, targets)) / 2


class HeadsLoss(nn.Module):
    """``heads_loss`` as the loss module a task hands the trainer (``loss(x, outputs, targets, index)``)."""

    def forward(self, images: torch.Tensor, outputs: Any, targets: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
        return heads_loss(outputs, targets)


class Supervised(Task):
    name = "supervised"

    @classmethod
    def wanted(cls, recipe: Recipe) -> bool:
        return True

    def fit_init_head(self, model: nn.Module, classes: Sequence[str]) -> None:
        fit_head(model, classes, self.recipe.head_init, self.log)

    def make_loss(self, device: torch.device, classes: Sequence[str], mean: tuple, std: tuple) -> nn.Module:
        self.loss = HeadsLoss()
        return self.loss

    def correct(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return correct(outputs, targets)

    def epoch_accuracy(self, totals: dict[str, float]) -> float | None:
        return totals["acc"]

    def running(self, totals: dict[str, float]) -> str:
        return f"loss {totals['loss']:.3f} acc {totals['acc']:.3f}"

    def evaluate(self, model: nn.Module, split: EvalSplit) -> dict[str, dict]:
        """Metrics per head ('logits', and 'cls'/'dist' for a distilled model) from confusion counts summed over
        the ranks; test-time augmentation as the recipe says."""
        counts = confusion_counts(model, split.images, split.labels, split.mean, split.std, len(split.classes),
                                  batch_size=split.batch_size, precision=split.precision, tta=self.recipe.tta,
                                  view=split.view, tta_translate=self.recipe.tta_translate)
        for c in counts.values():
            for k in c:
                c[k] = split.reduce(c[k])
        return {name: metrics_from_counts(c, split.classes) for name, c in counts.items()}

    def describe(self, classes: Sequence[str]) -> str:
        return f"{len(classes)} classes"

    def draw(self, out: Path, history: list[EpochRow], m: dict, title: str, classes: Sequence[str]) -> list[str]:
        """curves.png and confusion.png."""
        plot_curves(history, out / CURVES_PNG, title=title, loss_name=LOSS_NAMES["none"])
        plot_confusion(m["confusion"], list(classes), out / CONFUSION_PNG,
                       title=f"Confusion matrix, test top-1 {100 * m['top1']:.2f}%")
        return [CURVES_PNG, CONFUSION_PNG]
