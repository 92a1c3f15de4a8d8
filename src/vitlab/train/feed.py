"""Training batches on the training device: the whole set there when it fits, else pinned host batches copied ahead;
and the epoch's order with repeated augmentation."""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..devices import to_device


def fits_on_device(nbytes: int, device: torch.device, share: float = 0.5) -> bool:
    """True when ``nbytes`` take at most ``share`` of the device's free memory (always on the CPU)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= share * free


class BatchFeeder:
    """Gathers batches of (uint8 images, labels) by index and delivers them on ``device``.

    ``on_device``: the whole set is copied to the device once and a batch is a gather there (what
    the fastest CIFAR trainers do). Otherwise each batch is gathered on the host straight into pinned
    memory and copied with ``non_blocking``, one batch ahead, so the copy overlaps the step before.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device, on_device: bool = True):
        self.device = device
        self.on_device = on_device or device.type == "cpu"
        if self.on_device:
            self.images, self.labels = to_device(images, device), to_device(labels, device)
        else:
            self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels at ``idx`` (an index tensor on the CPU or on the set's device), on the device."""
        if self.on_device:
            idx = to_device(idx, self.images.device)
            return self.images.index_select(0, idx), self.labels.index_select(0, idx)
        idx = idx.cpu()
        pin = self.device.type == "cuda"
        x = torch.empty((len(idx), *self.images.shape[1:]), dtype=self.images.dtype, pin_memory=pin)
        y = torch.empty((len(idx),), dtype=self.labels.dtype, pin_memory=pin)
        torch.index_select(self.images, 0, idx, out=x)
        torch.index_select(self.labels, 0, idx, out=y)
        return x.to(self.device, non_blocking=pin), y.to(self.device, non_blocking=pin)

    def batches(self, batch_indices: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the batches in order, the next one already on its way while the caller works on this one."""
        ahead = self.gather(batch_indices[0]) if batch_indices else None
        for i in range(len(batch_indices)):
            current = ahead
            ahead = self.gather(batch_indices[i + 1]) if i + 1 < len(batch_indices) else None
            yield current


def repeated_aug_indices(
    n: int, repeats: int, generator: torch.Generator, num_replicas: int = 1, rank: int = 0
) -> torch.Tensor:
    """This rank's epoch order (n // num_replicas,) for DeiT repeated augmentation (RASampler).

    A random permutation of range(n) with every index repeated `repeats` times in a row is wrapped to a multiple of
    num_replicas and dealt round-robin, so consecutive copies go to different ranks (or, with one replica, sit next
    to each other in a batch); each shard is truncated so an epoch still totals ~n samples across replicas.
    """
    if repeats < 1 or num_replicas < 1 or not 0 <= rank < num_replicas:
        got = f"repeats={repeats}, num_replicas={num_replicas}, rank={rank}"
        raise ValueError(f"need repeats >= 1, num_replicas >= 1 and 0 <= rank < num_replicas; got {got}")
    perm = torch.randperm(n, generator=generator)
    order = perm.repeat_interleave(repeats)  # (n * repeats,)
    per_rank = math.ceil(n * repeats / num_replicas)
    total = per_rank * num_replicas
    if total > order.numel():  # wrap around so every rank gets the same count
        order = torch.cat([order, order[: total - order.numel()]])
    return order[rank:total:num_replicas][: n // num_replicas]
