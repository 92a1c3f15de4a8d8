"""Everything a run needs to continue after an interruption, in one object that is checkpointed whole."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_path
from ..runs.format import CHECKPOINT
from .schedule import Plateau


@dataclass
class TrainState:
    """The model, its optimiser and everything else that changes during a run.

    ``state_dict`` takes every field: a field added here is checkpointed and resumed with no other
    change. Objects with their own ``state_dict`` (model, optimiser, EMA, gradient scaler, plateau, task)
    are saved through it; plain values as they are. A checkpoint written before tasks kept a state gives the
    task an empty one, which the task refuses where it needs one.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    plateau: Plateau
    ema: torch.nn.Module | None = None
    scaler: torch.amp.GradScaler | None = None
    precision: str = "fp32"          # the autocast precision chosen at the start (fp32, bf16 or fp16)
    epoch: int = 0                   # epochs completed
    step: int = 0                    # optimiser steps taken
    seconds: float = 0.0             # training time on the budget clock (from the first step)
    reserve: float = 0.0             # seconds of the budget kept back for the final evaluation and save
    best: float = -math.inf          # best test top-1 so far
    since_best: int = 0              # evaluations since the best
    nonfinite: int = 0               # steps whose loss was not finite (fp16 skips them)
    history: list[dict] = field(default_factory=list)  # the metrics.jsonl rows
    task: Any = None                 # the task (tasks.Task): what it learns besides the model (an EMA teacher)

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.state_dict() if hasattr(value, "state_dict") else value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {"task": {}, **state}
        missing = [f.name for f in fields(self) if f.name not in state]
        if missing:
            raise ValueError(f"the checkpoint lacks {', '.join(missing)}: it was written by another vitlab version")
        for f in fields(self):
            current, saved = getattr(self, f.name), state[f.name]
            if hasattr(current, "load_state_dict"):
                if saved is None:
                    raise ValueError(f"the checkpoint has no {f.name} state but this run uses one")
                current.load_state_dict(saved)
            elif current is None and isinstance(saved, dict) and saved:  # an empty one is a task that keeps none
                raise ValueError(f"the checkpoint has {f.name} state but this run uses none")
            else:
                setattr(self, f.name, saved)


def save_checkpoint(folder: Path, state: TrainState, **extra: Any) -> None:
    """Write the state (and ``extra`` plain values, e.g. the model's name) to folder/checkpoint.pt through a
    temporary file and an atomic rename."""
    with atomic_path(folder / CHECKPOINT) as tmp:
        torch.save({**state.state_dict(), **extra}, tmp)
