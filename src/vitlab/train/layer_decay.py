"""Layer-wise learning-rate decay (BEiT, MAE, DeiT III fine-tuning): deeper layers learn faster.

Every parameter gets a layer id: the embeddings (patch embedding, a hybrid's CNN backbone, position
embedding, class / distillation / register tokens; a ResNet's stem) are layer 0, block i is layer
i + 1 (CaiT's class-attention blocks count after its self-attention blocks, a ResNet's stage k is
layer k, the members of the stack a model names in ``layer_stack`` are its layers; airbench's conv
groups), and everything after the last block (final norm, fc_norm, the heads) is layer depth + 1.
A parameter in layer i learns at ``lr * decay ** (depth + 1 - i)``: the heads at the full rate, the
last block at ``lr * decay``, the embeddings at ``lr * decay ** (depth + 1)``. As in BEiT and MAE,
the final norm counts with the heads (timm's ViT puts it with the last block instead).

The groups carry ``lr_scale``; a schedule applies it as timm's schedulers do (``lr * lr_scale``, see
``schedule.set_lr``). Weight decay follows the trainer's rule (``setup.param_groups``) unchanged.
"""
from __future__ import annotations

import torch.nn as nn

# parameters (first name part) that are the input side of a model: layer 0
EMBED_NAMES = ("patch_embed", "pos_embed", "cls_token", "dist_token", "reg_token", "mask_token", "norm_pre",
               "conv1", "bn1", "stem")
# module lists whose members are the layers, in the order the input passes through them
BLOCK_STACKS = ("blocks", "blocks_token_only")


def layer_units(model: nn.Module) -> list[str]:
    """The name prefixes of the model's layers in depth order ('blocks.0', ..., or 'layer1', ...)."""
    units = []
    for stack in (*BLOCK_STACKS, getattr(model, "layer_stack", None)):
        blocks = model.get_submodule(stack) if stack and hasattr(model, stack.split(".")[0]) else None
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
            units += [f"{stack}.{i}" for i in range(len(blocks))]
    k = 1
    while isinstance(getattr(model, f"layer{k}", None), nn.Module):  # a ResNet's stages
        units.append(f"layer{k}")
        k += 1
    if not units:
        raise ValueError(f"{type(model).__name__} has neither transformer blocks nor ResNet stages; layer-wise "
                         "settings accept ViT, DeiT, CaiT, ConViT, hybrid ViT, ResNet and airbench models")
    return units


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int]:
    """({parameter name: layer id}, depth): embeddings 0, the layers 1..depth, the rest depth + 1."""
    units = layer_units(model)
    unit_id = {name: i + 1 for i, name in enumerate(units)}
    depth = len(units)
    ids = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        unit = next((unit_id[p] for p in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)) if p in unit_id),
                    None)  # the longest prefix that is a layer
        ids[name] = unit if unit is not None else 0 if parts[0] in EMBED_NAMES else depth + 1
    return ids, depth


def layer_scales(depth: int, decay: float) -> list[float]:
    """The lr scale of layers 0..depth + 1: ``decay ** (depth + 1 - i)``."""
    return [decay ** (depth + 1 - i) for i in range(depth + 2)]


def check_layer_decay(decay: float) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
        raise ValueError(f"layer decay must be a number in (0, 1] (1: no decay; BEiT and MAE use 0.65-0.75), "
                         f"got {decay!r}")
    return float(decay)


def param_groups_layer_decay(model: nn.Module, weight_decay: float, layer_decay: float) -> list[dict]:
    """AdamW groups by (layer, weight decay or not), each with ``lr_scale``; trainable parameters only.

    ``layer_decay`` 1 gives the trainer's two groups unchanged (``lr_scale`` 1), so a run without
    layer decay keeps its optimizer state layout.
    """
    from .setup import param_groups  # setup reads data and checkpoints: import it only here

    decay = check_layer_decay(layer_decay)
    base = param_groups(model, weight_decay)
    if decay == 1.0:
        return [dict(g, lr_scale=1.0) for g in base]
    ids, depth = layer_ids(model)
    scales = layer_scales(depth, decay)
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups: dict[tuple[int, int], dict] = {}
    for kind, group in enumerate(base):
        for p in group["params"]:
            layer = ids[name_of[id(p)]]
            g = groups.setdefault((layer, kind), {"params": [], "weight_decay": group["weight_decay"],
                                                  "lr_scale": scales[layer], "layer": layer})
            g["params"].append(p)
    return [groups[key] for key in sorted(groups)]
