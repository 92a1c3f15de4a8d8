"""Learning rate as a function of progress through the run: linear warmup, then cosine decay."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def warmup_cosine(progress: float, lr: float, min_lr: float, warmup: float) -> float:
    """The learning rate at progress in [0, 1] (a share of steps, or of the time budget)."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return lr * progress / warmup
    t = (progress - warmup) / max(1.0 - warmup, 1e-12)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def progressive_size(progress: float, full: tuple[int, int], start_scale: float, until: float,
                     step: int) -> tuple[int, int]:
    """Training input size at ``progress`` under progressive resizing.

    The size grows linearly from ``start_scale`` x ``full`` at the start to ``full`` at ``until``
    (a share of the schedule), rounded down to multiples of ``step`` (the model's patch size);
    from ``until`` on, and always when ``start_scale`` is 1, it is ``full``.
    """
    if start_scale >= 1 or progress >= until:
        return tuple(full)
    scale = start_scale + (1.0 - start_scale) * max(progress, 0.0) / until
    return tuple(min(f, max(step, int(f * scale) // step * step)) for f in full)


class Plateau:
    """Multiplies the learning rate by `factor` after `patience` evaluations without improvement."""

    def __init__(self, patience: int, factor: float):
        self.patience, self.factor = patience, factor
        self.best = -math.inf
        self.bad = 0
        self.scale = 1.0

    def step(self, metric: float) -> bool:
        """Record an evaluation; True when the lr was just reduced."""
        if metric > self.best:
            self.best, self.bad = metric, 0
            return False
        self.bad += 1
        if self.patience and self.bad >= self.patience:
            self.scale *= self.factor
            self.bad = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad, self.scale = state["best"], state["bad"], state["scale"]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr`` times its ``lr_scale`` (1 where it has none)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
