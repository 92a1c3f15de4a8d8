"""Run-folder figures: learning curves, the confusion matrix, and several runs' curves overlaid.

Drawn on matplotlib Figures with the Agg canvas: no display and no pyplot state.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..atomic import atomic_path
from .format import EpochRow

# what a run's train_loss is, by its --pretrain
LOSS_NAMES = {"none": "cross-entropy loss", "mae": "MAE loss (squared error, hidden patches)",
              "mpp": "MPP loss (cross-entropy, corrupted patches)",
              "dino": "DINO loss (cross-entropy, teacher to student views)",
              "ibot": "iBOT loss (DINO's + masked patch tokens)",
              "distill": "distillation loss (pooled + patch features)"}


class ShownFigure(Figure):
    """A Figure that a notebook shows: without pyplot's inline backend IPython has no printer for a Figure, and
    printed its text instead."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def new_figure(width: float, height: float) -> Figure:
    """A Figure on the Agg canvas (shown as a PNG in a notebook)."""
    fig = ShownFigure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path, dpi: int = 110, metadata: dict[str, str] | None = None) -> Path:
    """Lay the figure out and write it in the format its suffix names (PNG without one) through an atomic rename: a
    crash or a full disk leaves the previous file or none, never a truncated one (the folder is made if needed)."""
    path = Path(path)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, metadata=metadata, format=path.suffix.lstrip(".").lower() or "png")
    return path


def plot_curves(history: Sequence[EpochRow], path: Path, title: str = "",
                loss_name: str = "cross-entropy loss") -> Path:
    """curves.png: ``curves_figure`` written to ``path``."""
    return save(curves_figure(history, title, loss_name), path)


def curves_figure(history: Sequence[EpochRow], title: str = "", loss_name: str = "cross-entropy loss") -> Figure:
    """Loss and accuracy against epoch, train and test; the loss alone for a run without labels (pre-training)."""
    epochs = [h.epoch for h in history]
    labelled = any(h.train_acc is not None or h.test_top1 is not None for h in history)
    fig = new_figure(11 if labelled else 6, 4)
    axes = fig.subplots(1, 2) if labelled else [fig.subplots()]
    ax_loss = axes[0]
    ax_loss.plot(epochs, [h.train_loss for h in history], label="train")
    tested = [h for h in history if h.evaluated]
    ax_loss.plot([h.epoch for h in tested], [h.test_loss for h in tested], label="test", marker=".")
    ax_loss.set(xlabel="epoch", ylabel=loss_name, title="Loss")
    if labelled:
        plot_accuracy(axes[1], history)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_accuracy(ax, history: Sequence[EpochRow]) -> None:
    """Train and test top-1 (and the EMA copy's) against epoch."""
    trained = [h for h in history if h.train_acc is not None]
    tested = [h for h in history if h.test_top1 is not None]
    ax.plot([h.epoch for h in trained], [100 * h.train_acc for h in trained], label="train (augmented)")
    ax.plot([h.epoch for h in tested], [100 * h.test_top1 for h in tested], label="test top-1", marker=".")
    if any(h.ema_test_top1 is not None for h in tested):
        ax.plot([h.epoch for h in tested], [100 * h.ema_test_top1 if h.ema_test_top1 is not None else np.nan
                                            for h in tested], label="test top-1 (EMA)", linestyle="--")
    ax.set(xlabel="epoch", ylabel="accuracy (%)", title="Accuracy")


def plot_confusion(confusion: Sequence[Sequence[int]], classes: Sequence[str], path: Path, title: str = "") -> Path:
    """confusion.png: ``confusion_figure`` written to ``path``."""
    return save(confusion_figure(confusion, classes, title), path)


def confusion_figure(confusion: Sequence[Sequence[int]], classes: Sequence[str], title: str = "") -> Figure:
    """Row-normalised confusion matrix (each true class sums to 1) with class names."""
    conf = np.asarray(confusion, dtype=np.float64)
    norm = conf / np.maximum(conf.sum(1, keepdims=True), 1)
    k = len(classes)
    size = max(5.0, min(0.45 * k + 2, 24))
    fig = new_figure(size + 1, size)
    ax = fig.subplots()
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
    return fig


def plot_runs(runs: Sequence[tuple[str, Sequence[EpochRow], str]], path: Path,
              metadata: dict[str, str] | None = None) -> Path:
    """Several runs' curves in one figure, one colour per (name, history, loss name): see ``runs_figure``."""
    return save(runs_figure(runs), path, metadata=metadata)


def runs_figure(runs: Sequence[tuple[str, Sequence[EpochRow], str]]) -> Figure:
    """The training loss against epoch on one axes per loss (a pre-training objective's loss is no cross-entropy),
    then test top-1 for the runs that measure one; a legend names only the lines drawn on its axes, and epochs are
    ticked at whole numbers."""
    kinds = list(dict.fromkeys(loss for _, h, loss in runs if h))
    tested = [[x for x in h if x.test_top1 is not None] for _, h, _ in runs]  # a pre-training run has a loss only
    fig = new_figure(max(6.0, 5.5 * (len(kinds) + any(tested))), 4.5)
    axes = list(np.atleast_1d(fig.subplots(1, len(kinds) + any(tested))))
    for ax, kind in zip(axes, kinds):
        for i, (name, h, loss) in enumerate(runs):
            if h and loss == kind:
                ax.plot([x.epoch for x in h], [x.train_loss for x in h], color=f"C{i % 10}", label=name)
        ax.set(xlabel="epoch", ylabel=f"train {kind}", title="Training loss")
    if any(tested):
        for i, (name, _, _) in enumerate(runs):
            if tested[i]:
                axes[-1].plot([x.epoch for x in tested[i]], [100 * x.test_top1 for x in tested[i]], marker=".",
                              color=f"C{i % 10}", label=name)
        axes[-1].set(xlabel="epoch", ylabel="test top-1 (%)", title="Test accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig
