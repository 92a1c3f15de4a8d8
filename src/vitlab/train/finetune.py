"""Fine-tuning a pretrained model: how its new head starts, and which of its first layers stay fixed."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ..errors import VitlabError
from ..models.groups import classifiers, layer_ids

# "zero": weight and bias 0 (timm's --head-init-scale 0); "trunc_normal": weight ~ N(0, 2e-5) truncated at
# +-2 (absolute), bias 0, as MAE's fine-tuning starts the head
HEAD_INITS = ("zero", "trunc_normal")
HEAD_INIT_STD = 2e-5


@torch.no_grad()
def init_head(model: nn.Module, mode: str) -> list[str]:
    """Re-initialise every classifier of the model ('zero' or 'trunc_normal'); returns their names."""
    if mode not in HEAD_INITS:
        raise VitlabError(f"head initialisation {mode!r} is not one of {', '.join(HEAD_INITS)}")
    heads = classifiers(model)
    if not heads:
        raise VitlabError(f"{type(model).__name__} has no classifier head to initialise (num_classes=0?)")
    for head in heads.values():
        if mode == "zero":
            nn.init.zeros_(head.weight)
        else:
            nn.init.trunc_normal_(head.weight, std=HEAD_INIT_STD)
        if head.bias is not None:
            nn.init.zeros_(head.bias)
    return list(heads)


def fit_head(model: nn.Module, classes: Sequence[str], mode: str, log: Callable[[str], None]) -> None:
    """Give a pretrained model the head the data's classes need, as ``mode`` says (the recipe's ``head_init``).

    'auto': a head that predicts exactly the data's classes (the same names in the same order) is kept, any
    other is replaced by one that starts at zero (timm's fine-tuning: the first steps' gradients reach the
    backbone through a head that adds no noise); 'zero' and 'trunc_normal' always start new heads; 'keep'
    keeps the checkpoint's head and refuses one of other classes.
    """
    classes = list(classes)
    names = model.pretrained_cfg.get("label_names")
    same = names == classes and model.num_classes == len(classes)
    if mode == "keep" or (mode == "auto" and same):
        if not same:
            raise VitlabError(f"head_init 'keep' needs --init to predict the data's classes: it predicts "
                              f"{model.num_classes} ({_some(names)}), the data has {len(classes)} ({_some(classes)}); "
                              "accepted here: auto, zero, trunc_normal")
        log(f"kept the head of --init: it predicts the data's {len(classes)} classes")
        return
    model.reset_classifier(len(classes))
    init = "zero" if mode == "auto" else mode
    log(f"new head(s) for {len(classes)} classes, initialised {init.replace('_', ' ')}")
    init_head(model, init)


def _some(names: Sequence[str] | None, n: int = 4) -> str:
    if not names:
        return "no class names"
    return ", ".join(map(str, names[:n])) + (", ..." if len(names) > n else "")


def freeze_blocks(model: nn.Module, n: int) -> list[str]:
    """Freeze the embeddings and the first ``n`` blocks (requires_grad False); returns the frozen names.

    ``n`` counts the layers of ``layer_decay.layer_ids``: transformer blocks (CaiT's class-attention
    blocks after its self-attention blocks) or a ResNet's stages; 0 freezes the embeddings alone.
    A ResNet's frozen BatchNorm layers still update their running statistics in train mode.
    """
    ids, depth = layer_ids(model)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= depth:
        raise VitlabError(f"cannot freeze {n!r} blocks of {type(model).__name__}: it has {depth} "
                          f"(accepted 0..{depth})")
    frozen = []
    for name, p in model.named_parameters():
        if ids[name] <= n:
            p.requires_grad = False
            frozen.append(name)
    return frozen
