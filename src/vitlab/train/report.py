"""Run-folder figures: learning curves and the confusion matrix."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_curves(history: Sequence[dict], path: Path, title: str = "") -> None:
    """Loss and accuracy against epoch, train and test."""
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], label="train")
    tested = [h for h in history if "test_loss" in h]
    ax_loss.plot([h["epoch"] for h in tested], [h["test_loss"] for h in tested], label="test", marker=".")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    ax_acc.plot(epochs, [100 * h["train_acc"] for h in history], label="train (augmented)")
    ax_acc.plot([h["epoch"] for h in tested], [100 * h["test_top1"] for h in tested], label="test top-1", marker=".")
    if any("ema_test_top1" in h for h in tested):
        ax_acc.plot([h["epoch"] for h in tested], [100 * h.get("ema_test_top1", np.nan) for h in tested],
                    label="test top-1 (EMA)", linestyle="--")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="Accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_confusion(confusion: Sequence[Sequence[int]], classes: Sequence[str], path: Path, title: str = "") -> None:
    """Row-normalised confusion matrix (each true class sums to 1) with class names."""
    conf = np.asarray(confusion, dtype=np.float64)
    norm = conf / np.maximum(conf.sum(1, keepdims=True), 1)
    k = len(classes)
    size = max(5.0, min(0.45 * k + 2, 24))
    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    ax.set(xlabel="predicted class", ylabel="true class", title=title or "Confusion matrix (normalised)")
    if k <= 40:
        ax.set_xticks(range(k), classes, rotation=45 if k > 10 or max(map(len, classes)) > 4 else 0, ha="right")
        ax.set_yticks(range(k), classes)
    if k <= 20:
        for i in range(k):
            for j in range(k):
                if norm[i, j] >= 0.005:
                    ax.text(j, i, f"{norm[i, j]:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if norm[i, j] > 0.5 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
