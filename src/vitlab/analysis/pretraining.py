"""What a pre-training objective does with a few images, under a fixed-seed mask: MAE's reconstructions and masked
patch prediction's mean colours, as displayable arrays (B, H, W, C) in [0, 1] for the report's figures."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..objectives.mae import patch_targets, patchify, unpatchify
from ..objectives.masking import random_masking
from ..objectives.mpp import draw_corruption
from .plots import display_images

MASK_GREY = 0.5  # how a hidden patch is drawn


class Reconstructions(NamedTuple):
    images: np.ndarray  # (B, H, W, C) the inputs
    masked: np.ndarray  # the inputs with the hidden patches grey: what the encoder sees
    reconstructed: np.ndarray  # the decoder's prediction of every patch
    pasted: np.ndarray  # the prediction at the hidden patches, the input at the visible ones
    loss: list[float]  # per image: the training loss (mean squared error over its hidden patches)
    mask_ratio: float


class ColourPredictions(NamedTuple):
    images: np.ndarray  # (B, H, W, C) the inputs
    corrupted: np.ndarray  # the inputs as the encoder reads them: [mask] patches grey, swapped ones moved
    true: np.ndarray  # every patch filled with its true 3-bit mean colour
    predicted: np.ndarray  # corrupted patches filled with the predicted mean colour, the others with the true one
    corrupted_mask: np.ndarray  # (B, h, w) bool, the patches the objective predicts
    accuracy: list[float]  # per image: share of its corrupted patches whose colour class is predicted exactly
    patch_size: tuple[int, int]


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """The module in eval mode for the block; its own mode back after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _patch_mask(mask: torch.Tensor, grid: tuple[int, int], patch_size: Sequence[int]) -> torch.Tensor:
    """(B, N) per-patch values -> (B, 1, H, W) per pixel."""
    m = mask.float().reshape(-1, 1, *grid)
    return F.interpolate(m, scale_factor=tuple(int(p) for p in patch_size), mode="nearest")


def _display(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    return display_images(images, mean, std)


@torch.no_grad()
def mae_reconstructions(objective: nn.Module, images: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                        seed: int = 0) -> Reconstructions:
    """A MaskedAutoencoder's reconstructions of normalised images (B, C, H, W) under a mask drawn from ``seed``."""
    B, _, H, W = images.shape
    ph, pw = objective.patch_size
    grid = (H // ph, W // pw)
    masking = random_masking(B, grid[0] * grid[1], objective.mask_ratio, images.device,
                             torch.Generator().manual_seed(seed))
    with eval_mode(objective):
        out = objective(images, masking=masking)
    masked, recon = objective.reconstruct(images, out.pred, out.mask)
    target = patch_targets(patchify(images.float(), objective.patch_size), objective.norm_pix_loss)
    per_patch = (out.pred.float() - target).pow(2).mean(-1)  # (B, N)
    loss = (per_patch * out.mask).sum(1) / out.mask.sum(1).clamp(min=1)
    hidden = _patch_mask(out.mask, grid, (ph, pw)).cpu().permute(0, 2, 3, 1).numpy()  # (B, H, W, 1)
    shown = _display(images, mean, std)
    rec = _display(recon, mean, std)
    return Reconstructions(shown, shown * (1 - hidden) + MASK_GREY * hidden, rec, shown * (1 - hidden) + rec * hidden,
                           [float(v) for v in loss], float(objective.mask_ratio))


def colour_of_classes(classes: torch.Tensor, channels: int, bits: int = 3) -> torch.Tensor:
    """(B, N) mean-colour classes -> (B, N, C) colours in [0, 1], each level at its bin's centre (the inverse of
    mean_color_classes up to the quantisation)."""
    levels = 2 ** bits
    digits = [(classes // levels ** (channels - 1 - c)) % levels for c in range(channels)]  # most significant first
    return (torch.stack(digits, dim=-1).float() + 0.5) / levels


def _fill_patches(colours: torch.Tensor, patch_size: tuple[int, int], grid: tuple[int, int]) -> np.ndarray:
    """(B, N, C) one colour per patch -> (B, H, W, C) images."""
    ph, pw = patch_size
    patches = colours[:, :, None, :].expand(-1, -1, ph * pw, -1).reshape(colours.shape[0], colours.shape[1], -1)
    return unpatchify(patches, patch_size, grid).permute(0, 2, 3, 1).cpu().numpy()


@torch.no_grad()
def mpp_predictions(objective: nn.Module, images: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                    seed: int = 0) -> ColourPredictions:
    """A MaskedPatchPrediction's mean-colour predictions on normalised images under a corruption drawn from seed."""
    B, C, H, W = images.shape
    patch_size = tuple(int(p) for p in objective.encoder.patch_embed.patch_size)
    grid = (H // patch_size[0], W // patch_size[1])
    c = draw_corruption(B, grid[0] * grid[1], objective.corrupt_ratio, objective.mask_prob, objective.random_prob,
                        images.device, torch.Generator().manual_seed(seed))
    with eval_mode(objective):
        out = objective(images, corruption=c)
    shown = _display(images, mean, std)
    pixels = patchify(torch.from_numpy(shown).permute(0, 3, 1, 2), patch_size)  # (B, N, P) display space
    seen = torch.where(c.swapped[..., None].cpu(), pixels.gather(1, c.source.cpu()[..., None].expand_as(pixels)),
                       pixels)
    seen = torch.where(c.mask_token[..., None].cpu(), torch.full_like(seen, MASK_GREY), seen)
    corrupted = unpatchify(seen, patch_size, grid).permute(0, 2, 3, 1).numpy()
    predicted = out.logits.argmax(-1)  # (B, N)
    shown_classes = torch.where(out.corrupted, predicted, out.targets)
    hits = ((predicted == out.targets) & out.corrupted).sum(1).float() / out.corrupted.sum(1).clamp(min=1)
    return ColourPredictions(shown, corrupted, _fill_patches(colour_of_classes(out.targets, C, objective.bits),
                                                             patch_size, grid),
                             _fill_patches(colour_of_classes(shown_classes, C, objective.bits), patch_size, grid),
                             out.corrupted.reshape(B, *grid).cpu().numpy(), [float(v) for v in hits], patch_size)
