"""Everything a run needs to continue after an interruption, in one object that is checkpointed whole."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_path
from ..errors import VitlabError
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
    # an unfinished epoch's place (a checkpoint within an epoch): {"images": its images trained, all ranks together
    # (the sample offset), "workers": the shard readers of each rank, "rng": rank 0's random state}; None between
    resume_at: dict | None = None

    def state_dict(self, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            if f.name in skip:
                continue
            value = getattr(self, f.name)
            out[f.name] = value.state_dict() if hasattr(value, "state_dict") else value
        return out

    def load_state_dict(self, state: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        """Restore every field but those of ``skip`` (restored by their own means: a sharded model's)."""
        state = {"task": {}, "resume_at": None, **state}
        missing = [f.name for f in fields(self) if f.name not in state and f.name not in skip]
        if missing:
            raise VitlabError(f"the checkpoint lacks {', '.join(missing)}: it was written by another vitlab version")
        for f in fields(self):
            if f.name in skip:
                continue
            current, saved = getattr(self, f.name), state[f.name]
            if hasattr(current, "load_state_dict"):
                if saved is None:
                    raise VitlabError(f"the checkpoint has no {f.name} state but this run uses one")
                current.load_state_dict(saved)
            elif current is None and isinstance(saved, dict) and saved and f.name != "resume_at":  # an empty
                # one is a task that keeps none; resume_at is a plain value
                raise VitlabError(f"the checkpoint has {f.name} state but this run uses none")
            else:
                setattr(self, f.name, saved)


def save_checkpoint(folder: Path, state: TrainState, skip: tuple[str, ...] = (), **extra: Any) -> None:
    """Write the state but its fields ``skip`` (and ``extra`` plain values, e.g. the model's name) to
    folder/checkpoint.pt through a temporary file and an atomic rename."""
    with atomic_path(folder / CHECKPOINT) as tmp:
        torch.save({**state.state_dict(skip), **extra}, tmp)


def place_in_epoch(images: int, workers: int, device: torch.device) -> dict[str, Any]:
    """``TrainState.resume_at`` for a checkpoint within an epoch: ``images`` of it trained (all ranks), ``workers``
    shard readers a rank, and this process's random state (CUDA's too on a GPU)."""
    return {"images": images, "workers": workers, "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def take_place(state: TrainState, per_epoch: int, sizes: list[int], by_epochs: bool, dist) -> tuple[int, int | None]:
    """(steps of the current epoch already taken, the shard readers that took them): (0, None) at an epoch's start.
    A run resumed within an epoch (``by_epochs``: not under a time budget) gets rank 0's random state back from
    the checkpoint; its sample offset must be the images ``sizes`` put before that step."""
    at, state.resume_at = state.resume_at, None
    done = max(0, state.step - state.epoch * per_epoch) if by_epochs else 0
    if not done:
        return 0, None
    images = sum(sizes[:done])
    if at is None or at.get("images") != images:
        raise VitlabError(f"the checkpoint stands at step {done} of epoch {state.epoch + 1}, but its sample offset "
                          f"is {None if at is None else at.get('images')} where {images} images precede that step; "
                          "accepted: a checkpoint of this run, resumed with its batch size")
    if dist.is_main:
        torch.set_rng_state(at["rng"])
        if at.get("cuda_rng") is not None and dist.device.type == "cuda":
            torch.cuda.set_rng_state(at["cuda_rng"], dist.device)
    return done, at.get("workers")
