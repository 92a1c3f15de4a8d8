"""One optimisation step, and the running totals of an epoch, on whatever device the model lives on."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn as nn

from ..data.augment import BatchAugment
from ..devices import autocast
from .distributed import Dist, all_reduce_sum
from .progressive import resize


def unwrap(net: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel and torch.compile wrappers."""
    while True:
        inner = getattr(net, "module", None) or getattr(net, "_orig_mod", None)
        if inner is None:
            return net
        net = inner


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema = decay * ema + (1 - decay) * model, for every floating-point tensor (others are copied); decay 0 copies
    the model exactly."""
    e_float = [e for e in ema.state_dict().values() if e.dtype.is_floating_point]
    m_float = [m for m in model.state_dict().values() if m.dtype.is_floating_point]
    if decay == 0:
        torch._foreach_copy_(e_float, m_float)
    else:
        torch._foreach_lerp_(e_float, m_float, 1.0 - decay)
    for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
        if not e.dtype.is_floating_point:
            e.copy_(m)


def ema_decay_at(progress: float, decay: float, start: float) -> float:
    """The EMA's decay at ``progress`` (the share of the schedule done): 0 before ``start``, so that the copy follows
    the model and its average begins there (e.g. where progressive resizing ends, so that it holds no weights
    trained at a smaller size), and ``decay`` from then on."""
    return decay if progress >= start else 0.0


def correct(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """How many predictions match the targets' argmax (a distilled model's: its class head's)."""
    logits = outputs[0] if isinstance(outputs, tuple) else outputs
    return (logits.detach().argmax(1) == targets.argmax(1)).sum()


@dataclass
class Stepper:
    """What every step of a run uses: the network as it runs, the augmentation, the task's loss (called as
    ``loss(x, outputs, targets, index)``) and its count of correct predictions, the optimiser and its settings."""

    net: nn.Module
    augment: BatchAugment
    loss: nn.Module
    optimizer: torch.optim.Optimizer
    precision: str = "fp32"
    clip_grad: float | None = None
    ema: nn.Module | None = None
    ema_decay: float = 0.0
    accum_steps: int = 1
    scaler: torch.amp.GradScaler | None = None
    channels_last: bool = False
    correct: Callable[[Any, torch.Tensor], torch.Tensor] = correct


@dataclass
class Batch:
    """A step's inputs: a uint8 batch and its labels, the input size (progressive resizing; None: as augmented),
    ``share``, this rank's part of the whole batch times the number of ranks (1 where the ranks hold equal parts),
    and ``index``, the images' places in the training set (for a loss that looks up what it made of them before:
    a teacher's predictions made once; None where unknown), and ``seeds``, the random seed of each micro-batch where
    the batch is cut into parts (``part_seed``; None: the generator goes on as it is)."""

    images: torch.Tensor
    labels: torch.Tensor
    size: tuple[int, int] | None = None
    share: float = 1.0
    index: torch.Tensor | None = None
    seeds: list[int] | None = None


def part_seed(seed: int, epoch: int, step: int, part: int) -> int:
    """The random seed of one part of a batch cut into parts (the micro-batches of all ranks together, numbered
    across the ranks): its augmentation and drop-path draws depend on (seed, epoch, step, part) alone, so two ranks
    draw what two micro-batches of one process draw."""
    return (seed * 1_000_003 + epoch * 7919 + step * 104_729 + part * 15_485_863) % (2 ** 31)


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> None:
    """Scale the gradients so that their joint L2 norm is at most ``max_norm`` (torch's clip_grad_norm_, with the
    norm summed in float64 over the local parts of sharded gradients and then over the ranks): however the
    gradients are split, by FSDP over ranks or not at all, the scale comes out the same float32 number, where
    float32 norms of the halves would differ in the last bit and part the runs."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    wide = torch.float32 if local[0].device.type == "mps" else torch.float64  # MPS has no float64
    # vector_norm accumulates in the wide type without the squares' copy a .to(wide).square() makes (3x faster)
    total = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=wide) for g in local]).square().sum()
    if hasattr(grads[0], "to_local"):  # sharded (DTensor): every rank's parts
        torch_dist.all_reduce(total)
    scale = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0).to(local[0].dtype)
    torch._foreach_mul_(local, scale)


def train_step(s: Stepper, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimisation step from a uint8 batch: augment, forward, loss, backward, clip, optimiser, EMA.

    The batch is split into ``accum_steps`` micro-batches whose gradients add up before the step
    (under DistributedDataParallel only the last one synchronises). ``b.size`` resizes the augmented
    batch the model sees (progressive resizing); the loss is given the augmented batch at its full size, so that a
    teacher trained at that size sees the student's very crop as it was trained to (at 24x24 a CNN trained at 32x32
    is a weaker teacher). DistributedDataParallel averages the ranks' gradients, so a rank with
    one image more or less weighs its loss by ``b.share`` and the step follows the whole batch's mean. With a
    ``scaler`` (fp16) the loss is scaled and a step whose gradients are not finite is skipped. Returns the batch's
    summed loss and its count of correct predictions, as tensors on the device: reading them is left to the
    caller, so a GPU never waits for the host.
    """
    net, images, optimizer, scaler = s.net, b.images, s.optimizer, s.scaler
    device = images.device
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    hits = torch.zeros((), dtype=torch.long, device=device)
    index = b.index.tensor_split(s.accum_steps) if b.index is not None else [None] * s.accum_steps
    chunks = list(zip(images.tensor_split(s.accum_steps), b.labels.tensor_split(s.accum_steps), index))
    for i, (xb, yb, ib) in enumerate(chunks):
        if b.seeds is not None:
            torch.manual_seed(b.seeds[i])
        full, targets = s.augment(xb, yb)
        x = resize(full, b.size)
        if s.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if x.shape[-2:] == full.shape[-2:]:
            full = x  # not resized: the loss takes the very tensor the model took
        sync = i == len(chunks) - 1 or not isinstance(net, nn.parallel.DistributedDataParallel)
        with contextlib.nullcontext() if sync else net.no_sync():
            with autocast(device, s.precision):
                outputs = net(x)
                loss = s.loss(full, outputs, targets, ib)  # a teacher sees the augmented batch at its full size
            scaled = loss * (len(xb) / len(images) * b.share)  # the mean over the whole batch, all ranks
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach().float() * len(xb)
        hits += s.correct(outputs, targets)
    if scaler is not None:
        scaler.unscale_(optimizer)
    if s.clip_grad:
        clip_grad_norm([p for g in optimizer.param_groups for p in g["params"]], s.clip_grad)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if s.ema is not None:
        ema_update(s.ema, unwrap(net), s.ema_decay)
    return loss_sum, hits


class EpochMeter:
    """Running totals of an epoch (loss, correct, images, non-finite losses) kept on the training device.

    ``add`` never reads a value back; ``totals`` does, once, after summing over every rank.
    """

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, correct, seen, non-finite

    def add(self, loss_sum: torch.Tensor, hits: torch.Tensor, count: int) -> None:
        finite = torch.isfinite(loss_sum)
        count_t = loss_sum.new_full((), count, dtype=torch.float64)
        self.sums += torch.stack([torch.where(finite, loss_sum, 0.0).double(), hits.double(), count_t,
                                  torch.logical_not(finite).double()])

    def totals(self, dist: Dist | None = None) -> dict[str, float]:
        """Loss and accuracy over the images seen, summed over ranks, and the count of non-finite losses."""
        sums = all_reduce_sum(self.sums.clone(), dist) if dist is not None else self.sums
        loss, correct, seen, nonfinite = sums.tolist()
        seen_finite = max(seen, 1.0)
        return {"loss": loss / seen_finite, "acc": correct / seen_finite, "seen": seen, "nonfinite": nonfinite}


def has_conv_stages(model: nn.Module) -> bool:
    """Whether the model has convolutional stages (hybrids, CNNs), not a patch embedding alone."""
    return sum(isinstance(m, nn.Conv2d) for m in model.modules()) > 1


def channels_last_helps(model: nn.Module, device: torch.device) -> bool:
    """Channels-last pays on a GPU for models with convolutional stages (hybrids, CNNs), not a patch embedding alone.
    On a CPU the student trains contiguous; a distillation teacher's forward pass alone runs channels-last wherever
    it has such stages (``has_conv_stages``; benchmarks/bench_teacher_pass.py: 1.26-1.50x on a 2-core Zen 4)."""
    return device.type == "cuda" and has_conv_stages(model)


def figures_every(device: torch.device) -> int:
    """Steps between reading the running totals back (progress-bar figures, the finite-loss check): on a GPU
    each read waits for the queued work, so it is rarer there."""
    return 50 if device.type == "cuda" else 5


def check_loss_finite(nonfinite: float, precision: str, bound: int, step: int) -> None:
    """Stop a run whose loss is no longer finite: at once in float32/bf16 (it diverged), after ``bound``
    skipped steps in fp16 (whose gradient scaler skips such steps while it finds its scale)."""
    if nonfinite == 0 or math.isnan(nonfinite):
        return
    if precision != "fp16":
        raise FloatingPointError(f"the training loss is not finite (by step {step}, {precision}): the run diverged; "
                                 "train it again with a lower --lr, --clip-grad, or --precision fp32 (in a new --out "
                                 "once it has a checkpoint: --resume keeps the recipe)")
    if nonfinite > bound:
        raise FloatingPointError(f"{int(nonfinite)} fp16 steps had a non-finite loss and were skipped (bound "
                                 f"--max-nonfinite {bound}); try --precision bf16 or fp32, or a lower --lr")
