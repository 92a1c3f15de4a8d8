"""What a task is: everything the trainer does differently for supervised training, distillation or masked
pre-training, behind one interface. The trainer builds the model, the data and the optimiser, runs the steps and
writes the run folder; the task says what the model is for.

A task is chosen from the recipe (``tasks.task_for``). It is built once per run, before the data is read, and
is then asked, in the order the run needs them:

- ``check_model(model)``, ``num_classes(classes)``, ``fit_init_head(model, classes)``: what the model must be
  (an encoder without a head for pre-training, a classifier of the data's classes otherwise);
- ``wrap(model, mean, std)``: what trains (the model, or an objective around it);
- ``make_loss(device, classes, mean, std)``: an ``nn.Module`` called as ``loss(x, outputs, targets, index)`` on
  the augmented batch, the network's outputs, the soft targets and the images' places in the training set (its
  ``train()`` is called every epoch);
- ``prepare(images, view, batch_size, now)``: work done once over the training images before the first step (a
  teacher's predictions made once), which returns its seconds: a fresh run counts them as training time;
- ``correct(outputs, targets)``: the step's count of correct predictions (0 without labels);
- ``after_step(model)``: anything a step leaves to the task (an EMA teacher's update);
- ``state_dict()``, ``load_state_dict(state)``: what the task learns besides the model (an EMA teacher), saved in
  every checkpoint and restored on a resume, so that a resumed run ends as a run never stopped;
- ``evaluate(model, split)``: metrics per head on the held-out split (``EvalSplit``);
- ``save(model, out, mean, std)``, ``draw(out, history, metrics, title, classes)``: the run folder's model, figures.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ... import checkpoint
from ...runs.format import EpochRow
from ..distributed import Dist, all_reduce_sum

if TYPE_CHECKING:
    from ...data.sources import ImageSet
    from ..recipe import Recipe


@dataclass
class EvalSplit:
    """This rank's contiguous shard of the held-out split and how to evaluate it (``reduce`` sums over ranks)."""

    images: torch.Tensor         # uint8, this rank's shard (a view, read batch by batch)
    labels: torch.Tensor
    first: int                   # the index of images[0] in the whole split
    classes: list[str]
    mean: tuple
    std: tuple
    batch_size: int
    precision: str
    view: Callable | None        # how stored test images larger than the training size are evaluated
    dist: Dist

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.dist)


class Task:
    """The interface, with what most tasks share; a task overrides what it does differently."""

    name = ""                                   # the registry's name
    labels = True                               # whether it learns from labels (a folder without them is refused)
    betas: tuple[float, float] = (0.9, 0.999)   # AdamW's

    def __init__(self, recipe: Recipe, log: Callable[[str], None]):
        self.recipe, self.log = recipe, log
        self.loss: nn.Module | None = None

    @classmethod
    def wanted(cls, recipe: Recipe) -> bool:
        """Whether the recipe asks for this task (the registry asks each task in turn)."""
        raise NotImplementedError

    # -- the model
    def check_model(self, model: nn.Module | type) -> None:
        """Refuse, before any data is read, a model (or model class) the task cannot train."""

    def num_classes(self, classes: Sequence[str]) -> int:
        return len(classes)

    def label_names(self, classes: Sequence[str]) -> list[str] | None:
        return list(classes)

    def fit_init_head(self, model: nn.Module, classes: Sequence[str]) -> None:
        """The head of a model from --init, made to suit the task."""
        raise NotImplementedError

    def wrap(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> nn.Module:
        """What the loop trains, checkpoints and resumes: the model itself unless the task wraps it."""
        return model

    # -- a step
    def make_loss(self, device: torch.device, classes: Sequence[str], mean: tuple, std: tuple) -> nn.Module:
        raise NotImplementedError

    def prepare(self, train: ImageSet, view: Callable | None, batch_size: int,
                now: Callable[[], float]) -> float:
        """Work done once over the training split (its images uint8; ``view``: how stored images larger than the
        training size are seen whole) before the first step; returns the seconds it took by ``now`` (0: none)."""
        return 0.0

    def correct(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """How many predictions match the targets' argmax (0 for a task without predictions of the labels)."""
        return torch.zeros((), dtype=torch.long, device=targets.device)

    def after_step(self, model: nn.Module) -> None:
        """Called after every optimiser step with the model that trains."""

    def state_dict(self) -> dict[str, Any]:
        """What the task learns besides the model, for the checkpoint (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s values from a checkpoint, after ``wrap`` and ``make_loss``."""

    def epoch_accuracy(self, totals: dict[str, float]) -> float | None:
        """The epoch's training accuracy, as its metrics row keeps it (None: the task has none)."""
        return None

    def running(self, totals: dict[str, float]) -> str:
        """The progress bar's running figures."""
        return f"loss {totals['loss']:.3f}"

    # -- evaluation and the run folder
    def evaluate(self, model: nn.Module, split: EvalSplit) -> dict[str, dict]:
        """Metrics per head (at least 'logits': loss, top1, top5, per_class, confusion) over every rank."""
        raise NotImplementedError

    def describe(self, classes: Sequence[str]) -> str:
        """What the run learns, for the line that describes it."""
        raise NotImplementedError

    def save(self, model: nn.Module, out: Path, mean: tuple, std: tuple) -> None:
        """Write the trained model (``model``: what ``wrap`` returned) to the run folder."""
        checkpoint.save(model, out)

    def draw(self, out: Path, history: list[EpochRow], m: dict, title: str, classes: Sequence[str]) -> list[str]:
        """The run's figures from its history and final metrics; returns their file names."""
        raise NotImplementedError
