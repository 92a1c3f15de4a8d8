"""Training batches on the training device: the whole set there when it fits, else pinned host batches copied ahead;
and the epoch's order with repeated augmentation."""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..devices import to_device
from ..errors import VitlabError


def fits_on_device(nbytes: int, device: torch.device, share: float = 0.5) -> bool:
    """True when ``nbytes`` take at most ``share`` of the device's free memory (always on the CPU)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= share * free


@dataclass(frozen=True)
class EpochPlan:
    """An epoch of ``n`` training images in ``steps`` batches of near-equal size, in an order drawn from ``seed``
    (each image ``repeats`` times in a row: repeated augmentation), ``rank``'s share of every batch: its ``rank``-th
    contiguous part of ``world`` (as the ``world`` micro-batches of one process would be cut, so that how a batch's
    parts are spread over processes changes nothing)."""

    n: int
    steps: int
    seed: int
    rank: int = 0
    world: int = 1
    repeats: int = 1

    def order(self) -> list[torch.Tensor]:
        """This rank's share of every batch: the rows of the set, in an order that depends on the seed only."""
        g = torch.Generator().manual_seed(self.seed)
        if self.repeats > 1:
            order = repeated_aug_indices(self.n, self.repeats, g)
        else:
            order = torch.randperm(self.n, generator=g)
        return [batch.tensor_split(self.world)[self.rank] for batch in order.tensor_split(self.steps)]

    def rank_sizes(self, rank: int) -> list[int]:
        """The batch sizes of ``rank`` when it takes its own contiguous share ``n * rank // world`` ..
        ``n * (rank + 1) // world - 1`` of the images (a shard reader's)."""
        mine = self.n * (rank + 1) // self.world - self.n * rank // self.world
        return [len(b) for b in torch.arange(mine).tensor_split(self.steps)]


class BatchFeeder:
    """Gathers batches of (uint8 images, labels) by index and delivers them on ``device``.

    ``on_device``: the whole set is copied to the device once and a batch is a gather there (what
    the fastest CIFAR trainers do). Otherwise each batch is gathered on the host straight into pinned
    memory and copied with ``non_blocking``, one batch ahead, so the copy overlaps the step before.
    """

    workers = 0  # the batches are gathered in this process

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

    def sizes(self, plan: EpochPlan) -> list[int]:
        """The size of every whole batch of the epoch (all ranks together)."""
        return [len(b) for b in torch.arange(plan.n).tensor_split(plan.steps)]

    def epoch(self, plan: EpochPlan, done: int = 0,
              workers: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's batches of the epoch after its first ``done`` steps: (images, labels, their rows)."""
        order = plan.order()[done:]
        for (images, labels), index in zip(self.batches(order), order):
            yield images, labels, index

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
        raise VitlabError(f"need repeats >= 1, num_replicas >= 1 and 0 <= rank < num_replicas; got {got}")
    perm = torch.randperm(n, generator=generator)
    order = perm.repeat_interleave(repeats)  # (n * repeats,)
    per_rank = math.ceil(n * repeats / num_replicas)
    total = per_rank * num_replicas
    if total > order.numel():  # wrap around so every rank gets the same count
        order = torch.cat([order, order[: total - order.numel()]])
    return order[rank:total:num_replicas][: n // num_replicas]


class ShardFeeder:
    """Batches of (uint8 images, labels, listing indices) streamed from a rank's shards (``data.shards.ShardReader``),
    decoded by ``workers`` DataLoader processes (0: this one) and stacked here in the epoch's batch sizes."""

    def __init__(self, reader, device: torch.device, workers: int):
        self.reader, self.device, self.workers = reader, device, workers
        self.on_device = False

    def loader(self, workers: int):
        from torch.utils.data import DataLoader

        self.reader.workers = max(workers, 1)
        return DataLoader(self.reader, batch_size=None, num_workers=workers, pin_memory=self.device.type == "cuda",
                          prefetch_factor=64 if workers else None, in_order=True,
                          generator=torch.Generator())  # its own: the steps' draws stay the same on a resume

    def sizes(self, plan: EpochPlan) -> list[int]:
        """The size of every whole batch of the epoch: the sum of the ranks' batches of their own shares."""
        return [sum(s) for s in zip(*(plan.rank_sizes(r) for r in range(plan.world)))]

    def epoch(self, plan: EpochPlan, done: int = 0,
              workers: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's batches of the epoch after its first ``done`` steps (a resumed epoch's, read by ``workers``
        processes as its first steps were; else the feeder's own count)."""
        sizes = plan.rank_sizes(plan.rank)
        self.reader.start(plan.seed, sum(sizes[:done]))
        samples = iter(self.loader(self.workers if workers is None else workers))
        pin = self.device.type == "cuda"
        for size in sizes[done:]:
            taken = [next(samples, (None, "the shards held fewer training images than counted; accepted: shards "
                                    "as listed (_info.json up to date)", -1)) for _ in range(size)]
            failed = next((t[1] for t in taken if t[0] is None), None)
            if failed is not None:
                raise VitlabError(failed)
            x = torch.stack([t[0] for t in taken])
            y = torch.tensor([t[1] for t in taken], dtype=torch.int64)
            index = torch.tensor([t[2] for t in taken], dtype=torch.int64)
            yield x.to(self.device, non_blocking=pin), y.to(self.device, non_blocking=pin), index
        for _ in samples:  # the reader's end (nothing is left: the sizes add up to the rank's share)
            raise VitlabError("the shards held more training images than counted; accepted: shards as listed")
