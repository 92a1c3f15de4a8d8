"""torchrun support: one process per rank, each on its shard (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from ..devices import resolve_device
from ..errors import VitlabError

T = TypeVar("T")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    control: object = None  # a gloo group for small decisions, so that they never wait on a GPU stream

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """Under torchrun (even with one process: the collectives and DDP then run as with many)."""
        return self.control is not None


def started_by_torchrun() -> bool:
    """Whether torchrun started this process (it sets the world's size and the rendezvous address)."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_distributed(device: str = "auto") -> Dist:
    """Join the process group torchrun describes in the environment, or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    control = None
    if started_by_torchrun():
        if not torch_dist.is_initialized():
            join_group("nccl" if dev.type == "cuda" else "gloo")
        control = torch_dist.new_group(backend="gloo") if dev.type == "cuda" else torch_dist.group.WORLD
    return Dist(rank, world, local_rank, dev, control)


def join_group(backend: str) -> None:
    """Join the process group torchrun describes, under keys of this attempt's own: torchrun's store outlives a
    worker group it restarts (--max-restarts), and a rank that read the address of a peer of the killed group would
    fail to connect, or wait."""
    store, rank, world = next(torch_dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch_dist.init_process_group(backend, store=torch_dist.PrefixStore(f"vitlab/attempt_{attempt}/", store), rank=rank,
                            world_size=world)


def all_reduce_sum(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.enabled:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t


def broadcast_flag(flag: bool, dist: Dist) -> bool:
    """Rank 0's decision, on every rank."""
    return bool(broadcast_value(float(flag), dist))


def broadcast_value(value: float, dist: Dist) -> float:
    """Rank 0's number, on every rank (through the CPU control group: no GPU synchronisation)."""
    if not dist.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch_dist.broadcast(t, src=0, group=dist.control)
    return float(t[0])


def broadcast_bytes(data: bytes | None, dist: Dist) -> bytes | None:
    """Rank 0's bytes (or None), on every rank (through the CPU control group)."""
    if not dist.enabled:
        return data
    n = int(broadcast_value(-1 if data is None else len(data), dist))
    if n <= 0:
        return None if n < 0 else b""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.is_main else torch.empty(n, dtype=torch.uint8)
    torch_dist.broadcast(t, src=0, group=dist.control)
    return data if dist.is_main else t.numpy().tobytes()


def broadcast_state(state: dict[str, Any] | None, dist: Dist) -> dict[str, Any] | None:
    """Rank 0's dict of tensors and plain values (a checkpoint, say), on every rank: saved by torch and loaded back
    with ``weights_only`` (nothing unpickled runs)."""
    if not dist.enabled:
        return state
    data = None
    if dist.is_main and state is not None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    data = broadcast_bytes(data, dist)
    if dist.is_main or data is None:
        return state
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def on_rank0(fn: Callable[[], T], dist: Dist, what: str) -> T | None:
    """``fn()`` on rank 0 alone (None on the others). When it raises there, every rank raises (the others a one-line
    ValueError naming ``what``), so that no rank is left waiting for a peer that has gone."""
    result = None
    if dist.is_main:
        try:
            result = fn()
        except BaseException:
            broadcast_flag(False, dist)
            raise
    if not broadcast_flag(True, dist):
        raise VitlabError(f"rank 0 could not {what} (its error says why)")
    return result


def all_reduce_value(value: float, dist: Dist) -> float:
    """The sum of a number over every rank (through the CPU control group)."""
    if not dist.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM, group=dist.control)
    return float(t[0])


def average_running_stats(model: torch.nn.Module, dist: Dist) -> None:
    """Average BatchNorm's running statistics over the ranks. Each rank's forward passes update them from its own
    share of the batch, so they drift apart where the parameters do not."""
    if not dist.enabled:
        return
    stats = [getattr(m, name) for m in model.modules() for name in ("running_mean", "running_var")
             if isinstance(getattr(m, name, None), torch.Tensor)]
    for b in stats:
        torch_dist.all_reduce(b, op=torch_dist.ReduceOp.SUM)
        b.div_(dist.world)


def replicas_agree(model: torch.nn.Module, dist: Dist) -> bool:
    """True when every rank holds bit-identical parameters and buffers (a digest of their bytes, compared)."""
    if not dist.enabled:
        return True
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digest = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(torch.int64)
    low, high = digest.clone(), digest.clone()
    torch_dist.all_reduce(low, op=torch_dist.ReduceOp.MIN, group=dist.control)
    torch_dist.all_reduce(high, op=torch_dist.ReduceOp.MAX, group=dist.control)
    return bool(torch.equal(low, high))


def barrier(dist: Dist) -> None:
    if dist.enabled:
        torch_dist.barrier()


def cleanup(dist: Dist) -> None:
    """Leave the process group once every rank has finished its last collective.

    A rank that closes its connections right after a collective can cut off a message its
    peer is still receiving (gloo sends asynchronously), so ranks first check in through the
    rendezvous store, which lives outside the ranks' connections.
    """
    if not (dist.enabled and torch_dist.is_initialized()):
        return
    store = torch_dist.distributed_c10d._get_default_store()
    store.add("vitlab/finished", 1)
    deadline = time.monotonic() + 600
    while store.add("vitlab/finished", 0) < dist.world and time.monotonic() < deadline:
        time.sleep(0.01)
    torch_dist.destroy_process_group()
