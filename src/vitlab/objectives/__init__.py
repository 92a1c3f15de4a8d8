"""Self-supervised pre-training objectives around a vitlab ViT/DeiT encoder: MAE, masked patch prediction, DINO, iBOT
and feature distillation from a frozen backbone."""
from __future__ import annotations

from .dino import DINO
from .distill import FeatureDistillation
from .encoder import check_encoder, load_decoder_state, split_pretrained
from .ibot import IBOT
from .mae import MaskedAutoencoder, patchify, unpatchify
from .masking import Masking, random_masking
from .mpp import MaskedPatchPrediction, mean_color_classes
from .objective import OBJECTIVES, create_objective, load_objective, objective_options, save_objective

__all__ = ["DINO", "IBOT", "OBJECTIVES", "FeatureDistillation", "Masking", "MaskedAutoencoder", "MaskedPatchPrediction",
           "check_encoder",
           "create_objective", "load_decoder_state", "load_objective", "mean_color_classes", "objective_options",
           "patchify",
           "random_masking", "save_objective", "split_pretrained", "unpatchify"]
