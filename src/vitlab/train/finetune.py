"""Fine-tuning a pretrained model: how its new head starts, and which of its first layers stay fixed."""
from __future__ import annotations

import torch
import torch.nn as nn

from .layer_decay import layer_ids

# "zero": weight and bias 0 (timm's --head-init-scale 0); "trunc_normal": weight ~ N(0, 2e-5) truncated at
# +-2 (absolute), bias 0, as MAE's fine-tuning starts the head
HEAD_INITS = ("zero", "trunc_normal")
HEAD_INIT_STD = 2e-5


def classifiers(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's classifier layers by name (its ``classifier_names``: 'head', DeiT's 'head_dist', a ResNet's 'fc')."""
    heads = {name: getattr(model, name, None) for name in getattr(model, "classifier_names", ())}
    return {name: m for name, m in heads.items() if isinstance(m, nn.Linear)}


@torch.no_grad()
def init_head(model: nn.Module, mode: str) -> list[str]:
    """Re-initialise every classifier of the model ('zero' or 'trunc_normal'); returns their names."""
    if mode not in HEAD_INITS:
        raise ValueError(f"head initialisation {mode!r} is not one of {', '.join(HEAD_INITS)}")
    heads = classifiers(model)
    if not heads:
        raise ValueError(f"{type(model).__name__} has no classifier head to initialise (num_classes=0?)")
    for head in heads.values():
        if mode == "zero":
            nn.init.zeros_(head.weight)
        else:
            nn.init.trunc_normal_(head.weight, std=HEAD_INIT_STD)
        if head.bias is not None:
            nn.init.zeros_(head.bias)
    return list(heads)


def freeze_blocks(model: nn.Module, n: int) -> list[str]:
    """Freeze the embeddings and the first ``n`` blocks (requires_grad False); returns the frozen names.

    ``n`` counts the layers of ``layer_decay.layer_ids``: transformer blocks (CaiT's class-attention
    blocks after its self-attention blocks) or a ResNet's stages; 0 freezes the embeddings alone.
    A ResNet's frozen BatchNorm layers still update their running statistics in train mode.
    """
    ids, depth = layer_ids(model)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= depth:
        raise ValueError(f"cannot freeze {n!r} blocks of {type(model).__name__}: it has {depth} "
                         f"(accepted 0..{depth})")
    frozen = []
    for name, p in model.named_parameters():
        if ids[name] <= n:
            p.requires_grad = False
            frozen.append(name)
    return frozen
