"""Learning rate as a function of progress through the run: linear warmup, then cosine decay, times the plateau
factor. ``LrSchedule`` is built once in set-up and is the one place that writes the learning rate into the
optimiser (``set_lr``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def warmup_cosine(progress: float, lr: float, min_lr: float, warmup: float, step_share: float = 0.0) -> float:
    """The learning rate of the step at progress in [0, 1] (a share of steps, or of the time budget).

    The warmup rises linearly to ``lr`` at ``warmup``; ``step_share`` (one step's share of the schedule) moves
    each warmup step on by one step, ``lr * (progress + step_share) / (warmup + step_share)``, so that the first
    step learns (as timm's warmup starts above 0) and the first step after the warmup is the first at ``lr``.
    """
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return lr * (progress + step_share) / (warmup + step_share)
    t = (progress - warmup) / max(1.0 - warmup, 1e-12)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def step_share(progress: float, step: int, total_steps: int) -> float:
    """One step's share of the schedule at ``step``: the progress per step so far (steps or time), before the first
    step the share of one of ``total_steps``."""
    return progress / step if step > 0 else 1.0 / max(total_steps, 1)


def describe_warmup(warmup: float, total_steps: int | None, lr: float, min_lr: float) -> str | None:
    """The line that says how the warmup falls on the run's steps (``total_steps`` None: a time budget)."""
    if warmup <= 0:
        return None
    if total_steps is None:
        return f"warmup over the first {100 * warmup:g}% of the time budget, from lr > 0 to {lr:g}"
    first = warmup_cosine(0.0, lr, min_lr, warmup, 1.0 / total_steps)
    steps = math.ceil(warmup * total_steps - 1e-9)
    return (f"warmup over the first {steps} of {total_steps} steps, lr {first:.3g} to {lr:g}" if steps > 1 else
            f"warmup {warmup:g} of {total_steps} steps spans one step, at lr {first:.3g}")


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


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step of a run, decided once in set-up: a linear warmup over the first ``warmup``
    of the schedule to ``lr``, a cosine decay to ``min_lr`` at its end, times the plateau factor (``plateau``, the
    run's own, which its evaluations step and its checkpoints keep). Progress is a share of ``total_steps`` or of
    the time budget (``by_time``); the loop asks ``apply`` for each step's rate."""

    lr: float
    min_lr: float
    warmup: float
    total_steps: int
    plateau: Plateau
    by_time: bool = False

    def lr_at(self, progress: float, step: int) -> float:
        """The learning rate of step ``step`` (counted from 0), taken at ``progress`` in [0, 1] of the schedule."""
        share = step_share(progress, step, self.total_steps)
        return warmup_cosine(progress, self.lr, self.min_lr, self.warmup, share) * self.plateau.scale

    def apply(self, optimizer: torch.optim.Optimizer, progress: float, step: int) -> float:
        """Set the optimiser's learning rate for step ``step`` (times each group's ``lr_scale``: layer decay,
        BatchNorm biases, SGD's decoupling) and return it."""
        lr = self.lr_at(progress, step)
        set_lr(optimizer, lr)
        return lr

    def describe(self) -> str | None:
        """The line that says how the warmup falls on the run's steps (or its time budget); None without one."""
        return describe_warmup(self.warmup, None if self.by_time else self.total_steps, self.lr, self.min_lr)
