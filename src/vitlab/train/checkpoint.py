"""Resumable training state, written atomically: a kill at any moment leaves the previous checkpoint intact."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(folder: Path, state: dict[str, Any]) -> None:
    """Write state to folder/checkpoint.pt through a temporary file and an atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{CHECKPOINT}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, folder / CHECKPOINT)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The checkpoint in folder (tensors and plain values only; nothing unpickled runs), or None."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the file is unusable
        raise ValueError(f"{path} is truncated or corrupt ({e}); delete it to restart the run") from None
