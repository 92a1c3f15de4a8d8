"""Moving tensors to the device a computation runs on, without stalling a GPU's stream."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A CPU tensor bound for a GPU goes through pinned memory with ``non_blocking``:
    a copy from ordinary (pageable) memory makes the host wait for the GPU's queue, a pinned one does not."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' (CUDA when PyTorch sees a GPU, else the CPU), 'cpu' or 'cuda'; a clear error when CUDA is missing."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={name!r} is not valid; accepted: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but PyTorch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                         "use --device cpu or auto")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)
