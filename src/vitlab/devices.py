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


BF16_CPU_FLAG = "amx_bf16"  # the /proc/cpuinfo flag of CPUs whose bf16 matrix units make bf16 training pay


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_bf16() -> tuple[bool, str]:
    """Whether bf16 autocast is the better default on this CPU (it has AMX), and the evidence in words.

    Without AMX, PyTorch runs bf16 through AVX512-BF16 dot products or float32 conversions; for ViTs that
    has measured slower than float32 on every CPU tried (AVX2 or AVX-512 with BF16), up to 12x.
    """
    flags = cpu_flags()
    capability = str(torch.backends.cpu.get_cpu_capability())
    if BF16_CPU_FLAG in flags or "AMX" in capability.upper():
        return True, "the CPU has AMX (amx_bf16)"
    if "avx512_bf16" in flags:
        return False, "the CPU has AVX512-BF16 but no AMX: bf16 has measured slower than float32 for ViTs there"
    return False, f"the CPU has neither AMX nor AVX512-BF16 (PyTorch's CPU kernels: {capability})"


def auto_precision(device: torch.device) -> tuple[str, str]:
    """What precision 'auto' means on ``device`` ('bf16' or 'fp32'), decided from what the hardware supports,
    and why, in words: the same answer on every run on one machine."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{name} supports bf16"
        return "fp32", f"{name} does not support bf16"
    native, why = cpu_bf16()
    return ("bf16", why) if native else ("fp32", why)
