"""The device a computation runs on: moving tensors to it, its precision and, on a CPU, how many threads."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Literal

import torch

from .errors import VitlabError

# The precision and device choices every command takes (the recipe's fields and the options of evaluate, predict,
# explain and probe): declared once, here.
Precision = Literal["auto", "bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda"]
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """Autocast to the precision's dtype on the device ('bf16', 'fp16'), or nothing ('fp32')."""
    dtype = AMP_DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


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
        raise VitlabError(f"device={name!r} is not valid; accepted: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise VitlabError("device='cuda' was asked for, but PyTorch sees no CUDA device "
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


# bf16 autocast on a CPU with AMX pays once a model's matrix products are large enough to fill the tiles; below
# that, the casts around every small product cost more than AMX saves. Training gained for sure only from the
# 224-pixel ViTs, inference from models an order of magnitude smaller: two lines, measured per model, precision and
# thread count in docs/precision.md (benchmarks/bench_precision.py).
BF16_CPU_MIN_MACS = 1e9  # multiply-adds an image (linear and convolution layers) from which bf16 training pays
BF16_CPU_MIN_MACS_INFERENCE = 0.1e9  # and from which bf16 inference pays, on a CPU with AMX
# Images a forward pass of `vitlab predict` takes: small batches keep a CPU's caches warm (ViT-B/16 at 224 in bf16
# on the AMX Xeon ran faster 16 at a time than 256 at once), and memory stays one batch's however many files.
PREDICT_BATCH = 16
# An evaluation's batch (no gradients): 64 images on a CPU, whose activations then stay in its caches (64 measured
# 1.2-1.35x faster than 256 on a 2-core EPYC), 256 on a GPU.
CPU_EVAL_BATCH, GPU_EVAL_BATCH = 64, 256


def eval_batch(device: torch.device | str) -> int:
    """The batch an evaluation on ``device`` takes when none is given."""
    return CPU_EVAL_BATCH if torch.device(device).type == "cpu" else GPU_EVAL_BATCH


def auto_precision(device: torch.device, macs: float, use: str = "training") -> tuple[str, str]:
    """What precision 'auto' means for ``use`` ('training' or 'inference') of a model of ``macs`` multiply-adds an
    image on ``device`` ('bf16' or 'fp32'), decided from the hardware and the model's size, never from a timing,
    and why, in words: the same answer on every run of one model on one machine. A GPU that supports bf16 takes it
    for any model; a CPU only with AMX, and only for a model of at least ``BF16_CPU_MIN_MACS`` (training) or
    ``BF16_CPU_MIN_MACS_INFERENCE`` (inference)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{name} supports bf16"
        return "fp32", f"{name} does not support bf16"
    native, why = cpu_bf16()
    if not native:
        return "fp32", why
    line = BF16_CPU_MIN_MACS if use == "training" else BF16_CPU_MIN_MACS_INFERENCE
    rule = f"from ~{line / 1e9:g} GMACs per image; this model has {macs / 1e9:.2g}"
    if macs < line:
        return "fp32", f"AMX present, but bf16 {use} pays only {rule}"
    return "bf16", f"AMX present, and bf16 {use} pays {rule}"


# A second CPU thread pays once a training step holds enough work to split. The 8x8 digits model's step (0.4 GFLOP
# of matrix products at batch 32: 0.14M parameters, hundreds of tiny ops) ran 1.2x faster on one thread than on
# two on a lightly loaded 2-core AVX-512 EPYC, and 2.3x faster beside two CPU-bound processes, where every thread
# waits at every op for the slowest; CIFAR-10 steps (hundreds of GFLOP) run faster on every core. One thread per
# 5 GFLOP lies between the two, on the side of fewer threads.
FLOPS_PER_THREAD = 5e9


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ('unknown CPU' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity, which taskset and containers narrow)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat's unit


def cpu_times(cores: list[int]) -> tuple[float, float] | None:
    """(busy, total) jiffies summed over ``cores`` from /proc/stat, or None where it cannot be read."""
    wanted, busy, total = {f"cpu{c}" for c in cores}, 0.0, 0.0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name in wanted:
                    ticks = [float(v) for v in values[:8]]
                    busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)  # 3 idle, 4 iowait
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def busy_cores(cores: list[int], interval: float = 0.1, read: Callable = cpu_times,
               own: Callable[[], float] = time.process_time, sleep: Callable[[float], None] = time.sleep) -> float:
    """How many of ``cores`` other work keeps busy now: their busy share over ``interval`` seconds, less what this
    process used meanwhile (its idle threads may still spin), times their number; 0 where /proc/stat cannot be
    read."""
    before, own_before = read(cores), own()
    sleep(interval)
    after, own_after = read(cores), own()
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    others = after[0] - before[0] - (own_after - own_before) * TICKS_PER_SECOND
    return max(0.0, len(cores) * others / (after[1] - before[1]))


def choose_threads(step_flops: float, cores: int, busy: float,
                   per_thread: float = FLOPS_PER_THREAD) -> tuple[int, str]:
    """CPU threads for a training step of ``step_flops`` on ``cores`` cores of which ``busy`` are taken by other
    work, and why, in words: no more threads than the step has work for (``per_thread`` FLOPs each), nor than cores
    are free (a thread on a taken core waits on the others at every op), nor fewer than one."""
    free = max(0, cores - round(busy))
    by_work = max(1, int(step_flops // per_thread))
    threads = max(1, min(free, by_work))
    why = (f"{step_flops / 2e9:.2g} GMACs a step is work for {by_work} (one per {per_thread / 2e9:g} GMACs); "
           f"{free} of {cores} cores free ({busy:.1f} busy)")
    return threads, why


def set_cpu_threads(step_flops: float) -> str:
    """Set PyTorch's CPU threads for training steps of ``step_flops`` each (``choose_threads`` on this process's
    cores and their load now; OMP_NUM_THREADS, where set, decides instead), and say how many and why."""
    if os.environ.get("OMP_NUM_THREADS"):
        return f"threads: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    cores = usable_cores()
    threads, why = choose_threads(step_flops, len(cores), busy_cores(cores))
    torch.set_num_threads(threads)
    return f"threads: {threads} ({why}; --threads N sets them)"
