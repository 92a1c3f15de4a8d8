"""Self-supervised pre-training objectives around a vitlab ViT/DeiT encoder: MAE and masked patch prediction."""
from __future__ import annotations

from typing import Any

from torch import nn

from .encoder import check_encoder, load_decoder_state, split_pretrained
from .mae import MaskedAutoencoder, patchify, unpatchify
from .masking import Masking, random_masking
from .mpp import MaskedPatchPrediction, mean_color_classes

OBJECTIVES: dict[str, type[nn.Module]] = {"mae": MaskedAutoencoder, "mpp": MaskedPatchPrediction}


def create_objective(method: str, encoder: nn.Module, **options: Any) -> nn.Module:
    """The pre-training objective ``method`` ('mae' or 'mpp') wrapped around ``encoder``."""
    if method not in OBJECTIVES:
        raise ValueError(f"unknown pre-training method {method!r}; accepted: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[method](encoder, **options)


__all__ = ["OBJECTIVES", "Masking", "MaskedAutoencoder", "MaskedPatchPrediction", "check_encoder", "create_objective",
           "load_decoder_state", "mean_color_classes", "patchify", "random_masking", "split_pretrained",
           "unpatchify"]
