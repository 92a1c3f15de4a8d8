"""torchrun support: one process per rank, each on its shard (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed(device: str = "auto") -> Dist:
    """Join the process group torchrun describes in the environment, or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was asked for, but PyTorch sees no CUDA device; use --device cpu or auto")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, local_rank, dev)


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_flag(flag: bool, d: Dist) -> bool:
    """Rank 0's decision, on every rank."""
    if not d.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], device=d.device if d.device.type == "cuda" else "cpu")
    dist.broadcast(t, src=0)
    return bool(t.item())


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def cleanup(d: Dist) -> None:
    """Leave the process group once every rank has finished its last collective.

    A rank that closes its connections right after a collective can cut off a message its
    peer is still receiving (gloo sends asynchronously), so ranks first check in through the
    rendezvous store, which lives outside the ranks' connections.
    """
    if not (d.enabled and dist.is_initialized()):
        return
    store = dist.distributed_c10d._get_default_store()
    store.add("vitlab/finished", 1)
    deadline = time.monotonic() + 600
    while store.add("vitlab/finished", 0) < d.world and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()
