"""Memory per rank under --shard fsdp: the bytes of parameters, gradients and AdamW's state each rank holds.

Run it under torchrun at each world size (gloo on the CPU); it builds the model, shards it as ``--shard fsdp`` does
(vitlab.train.shard.shard_model: every block, then the root) and counts each rank's local bytes. With ``--step``
it first takes one real AdamW step (batch ``--batch`` at ``--img-size``), so the gradients and the optimizer's
moments exist and are counted as they lie in memory; with ``--meta`` the model is built on the meta device (no
memory: for a model whose step does not fit this machine) and the gradients and AdamW's two moments are counted
from the local shards' shapes (one gradient and two moments per trainable element, float32).

    torchrun --nproc-per-node 2 benchmarks/fsdp_memory.py --model vit_base_patch16_224 --step
    torchrun --nproc-per-node 2 benchmarks/fsdp_memory.py --model vit_giant_patch14_224 --meta
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

import vitlab
from vitlab.train.distributed import init_distributed
from vitlab.train.shard import local, local_bytes, shard_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--meta", action="store_true", help="count from shapes on the meta device (no step)")
    ap.add_argument("--step", action="store_true", help="take one real AdamW step before counting")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--img-size", type=int, default=None)
    ap.add_argument("--json", default=None, help="append rank 0's row to this JSON-lines file")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist = init_distributed("cpu")
    torch.manual_seed(0)
    kwargs = {"img_size": args.img_size} if args.img_size else {}
    if args.meta:
        with torch.device("meta"):
            model = vitlab.create_model(args.model, **kwargs)
    else:
        model = vitlab.create_model(args.model, **kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    if args.meta:
        meta_shard(model, dist)
        params = sum(local(p).numel() * p.element_size() for p in model.parameters())
        trained = sum(local(p).numel() * 4 for p in model.parameters() if p.requires_grad)
        mem = {"parameters": params, "gradients": trained, "optimizer": 2 * trained}
        mem["total"] = sum(mem.values())
        how = "counted from shapes (meta device)"
    else:
        shard_model(model, dist, "fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        how = "counted after sharding"
        if args.step:
            c, h, w = model.pretrained_cfg["input_size"]
            x = torch.randn(args.batch, c, args.img_size or h, args.img_size or w)
            y = torch.randint(0, model.num_classes, (args.batch,))
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            how = f"measured after one AdamW step (batch {args.batch} a rank)"
        mem = local_bytes(model, optimizer)
    rows = [None] * dist.world
    torch_dist.all_gather_object(rows, mem)
    if dist.is_main:
        worst = {k: max(r[k] for r in rows) for k in mem}
        row = {"model": args.model, "parameters_M": round(n_params / 1e6, 1), "world": dist.world, "how": how,
               **{f"{k}_GiB": round(v / 2**30, 3) for k, v in worst.items()}}
        print(json.dumps(row))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    torch_dist.barrier()
    torch_dist.destroy_process_group()


def meta_shard(model: torch.nn.Module, dist) -> None:
    """fully_shard as shard_model applies it, on a meta-device model (nothing to broadcast or copy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vitlab.train.shard import transformer_blocks

    mesh = init_device_mesh("cpu", (dist.world,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


if __name__ == "__main__":
    main()
