"""Resumable training state, written atomically: a kill at any moment leaves the previous checkpoint intact."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..fileio import atomic_path

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(folder: Path, state: dict[str, Any]) -> None:
    """Write state to folder/checkpoint.pt through a temporary file and an atomic rename."""
    with atomic_path(folder / CHECKPOINT) as tmp:
        torch.save(state, tmp)


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The checkpoint in folder (tensors and plain values only; nothing unpickled runs), or None."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the file is unusable
        raise ValueError(f"{path} is truncated or corrupt ({e}); delete it to restart the run") from None
