"""FSDP2 (``--shard fsdp``): the model, its gradients and its optimizer state split over the ranks.

``torch.distributed.fsdp.fully_shard`` is applied to every transformer block, then to the whole model (which keeps
what lies outside the blocks: embeddings, norms, the head), as DINOv3's training code does. Each rank holds 1/N of
every parameter (a DTensor); a block's whole weights are gathered just before its forward and its backward and
freed after, and the gradients are reduce-scattered (averaged, as DDP averages them). In bf16 the gathered weights
are bf16 and the gradients reduce in float32 (a ``MixedPrecisionPolicy``). Gradient checkpointing (each block
recomputed in the backward pass) and LoRA (only the adapters train) run inside the sharded blocks unchanged.

Checkpoints go through ``torch.distributed.checkpoint``: every rank writes its own part of the model and the
optimizer into a locked temporary folder beside checkpoint.pt, which rank 0 renames to ``checkpoint-shards-*``
once every part is written, before it writes checkpoint.pt (everything else of the run's state, naming that
folder and the world size) through its own atomic rename: a run killed at any moment leaves a checkpoint.pt whose
shards are whole. The run's other files are written as in any run: at the end the whole model is gathered to rank
0 (on the CPU) and saved as model.safetensors, so every command reads an FSDP run as any other.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn as nn

from ..atomic import locked_temp_folder, remove_stale_temps
from ..errors import VitlabError
from ..runs.format import CHECKPOINT, CHECKPOINT_SHARDS
from .distributed import Dist, barrier, broadcast_bytes
from .state import TrainState, save_checkpoint

SHARDS_PREFIX = CHECKPOINT_SHARDS
SHARDED_FIELDS = ("model", "optimizer")  # what the shards hold; checkpoint.pt holds the rest of the state


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` (or of the model inside it): each list its ``block_lists`` names."""
    for m in model.modules():
        names = getattr(m, "block_lists", None)
        if names:
            blocks = [b for name in names for b in getattr(m, name, None) or ()]
            if blocks:
                return blocks
    return []


def check_can_shard(model: nn.Module | None, dist: Dist) -> None:
    """Refuse, in one line, a set-up FSDP cannot shard: no process group (torchrun starts one; one process is allowed,
    to measure the sharding's own cost), or a model without transformer blocks to shard one by one."""
    if not dist.enabled:
        raise VitlabError("shard='fsdp' needs torchrun (a process group to shard over): torchrun --nproc-per-node N -m "
                          "vitlab train --shard fsdp ...; accepted without torchrun: shard='none'")
    if model is not None and not transformer_blocks(model):
        name = getattr(model, "arch", None) or type(model).__name__
        raise VitlabError(f"shard='fsdp' shards a model block by block, and {name} has no transformer blocks; "
                          "accepted: a model with blocks (the ViT family, hybrids), or shard='none' (DDP)")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory), its buffers and attributes real: the
    skeleton the gathered weights are loaded into at the end."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def shard_model(model: nn.Module, dist: Dist, precision: str) -> nn.Module | None:
    """Shard ``model`` in place over the ranks (every block, then the root), from rank 0's weights; returns, on rank
    0, the skeleton that the whole model is gathered into at the end (None on the others)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_can_shard(model, dist)
    for t in [*model.parameters(), *model.buffers()]:  # rank 0's weights everywhere, as DDP starts from them
        torch_dist.broadcast(t.data, src=0)
    skeleton = meta_copy(model) if dist.is_main else None
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16"
              else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return skeleton


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor whole)."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """The bytes this rank holds of the model's parameters, their gradients and the optimizer's state."""
    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()
    params = list(model.parameters())
    state = [v for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {"parameters": sum(size(p) for p in params),
           "gradients": sum(size(p.grad) for p in params if p.grad is not None),
           "optimizer": sum(size(v) for v in state)}
    out["total"] = sum(out.values())
    return out


def _state_dicts(state: TrainState) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(state.model, state.optimizer)
    return {"model": model, "optimizer": optim}


def save_sharded(out: Path, state: TrainState, dist: Dist, **extra: Any) -> None:
    """The run's checkpoint, every rank writing its part (see the module's docstring); a collective."""
    import torch.distributed.checkpoint as dcp

    shards = _state_dicts(state)
    with contextlib.ExitStack() as stack:
        tmp = None
        if dist.is_main:
            remove_stale_temps(out, SHARDS_PREFIX.rstrip("-"))
            tmp = stack.enter_context(locked_temp_folder(out, SHARDS_PREFIX.rstrip("-")))
        tmp = Path(broadcast_bytes(str(tmp).encode() if tmp is not None else None, dist).decode())
        dcp.save(shards, checkpoint_id=tmp / "shards")  # rank 0 writes the metadata once every part is written
        if dist.is_main:
            name = f"{SHARDS_PREFIX}{state.step:09d}-{tmp.name.split('.')[-2]}"
            os.replace(tmp / "shards", out / name)
            save_checkpoint(out, state, skip=SHARDED_FIELDS, sharded={"folder": name, "world": dist.world}, **extra)
            for old in out.glob(f"{SHARDS_PREFIX}*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
    barrier(dist)


def load_sharded(out: Path, ckpt: dict[str, Any], state: TrainState, dist: Dist) -> None:
    """Restore a sharded checkpoint (``ckpt``: checkpoint.pt's values) into the run's state; one written by another
    number of processes, or without sharding, is refused in one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    info, path = ckpt.get("sharded"), out / CHECKPOINT
    if not isinstance(info, dict) or not isinstance(info.get("folder"), str):
        raise VitlabError(f"{path} was written by a run that did not shard its model; accepted: shard='fsdp' "
                          "resumes a checkpoint of shard='fsdp'")
    if info.get("world") != dist.world:
        raise VitlabError(f"{path} was written by {info.get('world')} processes sharding the model, and this run has "
                          f"{dist.world}; accepted: --resume with {info.get('world')} processes in all (torchrun "
                          "--nnodes x --nproc-per-node)")
    folder = out / info["folder"]
    if not (folder / ".metadata").is_file():
        raise VitlabError(f"{path} names its shards {folder}, which is missing or incomplete; accepted: a run folder "
                          "as vitlab train wrote it")
    shards = _state_dicts(state)
    dcp.load(shards, checkpoint_id=folder)
    set_state_dict(state.model, state.optimizer, model_state_dict=shards["model"],
                   optim_state_dict=shards["optimizer"])
    state.load_state_dict(ckpt, skip=SHARDED_FIELDS)


def gathered(model: nn.Module, skeleton: nn.Module | None, dist: Dist) -> nn.Module | None:
    """The whole model, on rank 0's CPU (None on the others): every rank sends its parts (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_main:
        return None
    skeleton.load_state_dict(full, assign=True)
    return skeleton
