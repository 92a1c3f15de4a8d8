"""Masked patch prediction, the ViT paper's self-supervision (Dosovitskiy et al. 2021, appendix B.1.2).

Half of each image's patch embeddings are corrupted before the position embedding is added:
of those, 80% become a learned [mask] embedding, 10% another patch's embedding (from the same
image) and 10% stay as they are, as BERT does with words. A linear head reads the encoder's
output at every corrupted position and predicts the patch's 3-bit mean colour: the mean of each
channel over the patch, in [0, 1], quantised to 8 levels, 8^3 = 512 classes for RGB. The loss is
the cross-entropy over the corrupted patches only.

The encoder is fed normalised images, (x - mean) / std with x in [0, 1]; ``mean`` and ``std``
(the data set's, per channel) undo that for the targets. Without them the images are taken to be
in [0, 1] already.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from ..models.vit import VisionTransformer
from .encoder import check_encoder, no_weight_decay, output_norm, run_blocks, set_aside_head
from .masking import gather_tokens, random_masking, uniform_noise


class Corruption(NamedTuple):
    """Which patch embeddings are corrupted, and how; (B, N) each."""

    corrupted: torch.Tensor  # bool: the patches to predict (mask_token | swapped | kept as is)
    mask_token: torch.Tensor  # bool: replaced by the learned [mask] embedding
    swapped: torch.Tensor  # bool: replaced by the embedding of patch `source`
    source: torch.Tensor  # long: for swapped patches, the other patch of the same image they take


class MPPOutput(NamedTuple):
    loss: torch.Tensor  # () cross-entropy over the corrupted patches
    logits: torch.Tensor  # (B, N, num_colors) for every patch
    targets: torch.Tensor  # (B, N) long, every patch's mean-colour class
    corrupted: torch.Tensor  # (B, N) bool


def check_options(num_tokens: int, corrupt_ratio: float, mask_prob: float, random_prob: float) -> None:
    """Raise a one-line ValueError for options that cannot be drawn."""
    if num_tokens < 2:
        raise VitlabError(f"masked patch prediction needs at least 2 patches per image, got {num_tokens}")
    if not 0 < corrupt_ratio < 1:
        raise VitlabError(f"corrupt_ratio {corrupt_ratio} must lie in (0, 1)")
    if not (0 <= mask_prob and 0 <= random_prob and mask_prob + random_prob <= 1):
        raise VitlabError(f"mask_prob {mask_prob} and random_prob {random_prob} must be >= 0 and sum to at most 1")


def draw_corruption(batch: int, num_tokens: int, corrupt_ratio: float = 0.5, mask_prob: float = 0.8,
                    random_prob: float = 0.1, device: torch.device | str | None = None,
                    generator: torch.Generator | None = None) -> Corruption:
    """Per sample exactly N - int(N * (1 - corrupt_ratio)) corrupted patches, each then mask / swap / keep."""
    check_options(num_tokens, corrupt_ratio, mask_prob, random_prob)
    corrupted = random_masking(batch, num_tokens, 1 - corrupt_ratio, device, generator).mask.bool()
    u = uniform_noise(batch, num_tokens, corrupted.device, generator)  # (B, N), one draw per patch
    mask_token = corrupted & (u < mask_prob)
    swapped = corrupted & (u >= mask_prob) & (u < mask_prob + random_prob)
    shift = torch.randint(1, num_tokens, (batch, num_tokens), generator=generator,
                          device=generator.device if generator is not None else corrupted.device)
    source = (torch.arange(num_tokens, device=corrupted.device) + shift.to(corrupted.device)) % num_tokens  # != own
    return Corruption(corrupted, mask_token, swapped, source)


def mean_color_classes(imgs: torch.Tensor, patch_size: int | Sequence[int], bits: int = 3) -> torch.Tensor:
    """(B, C, H, W) images in [0, 1] -> (B, N) class of each patch's mean colour, 2**(bits*C) classes.

    Each channel's mean is quantised to floor(mean * 2**bits), clamped to 2**bits - 1; the first channel
    is the most significant digit (for RGB with 3 bits: class = 64 r + 8 g + b).
    """
    levels = 2 ** bits
    means = F.avg_pool2d(imgs.float().clamp(0, 1), kernel_size=patch_size, stride=patch_size)  # (B, C, h, w)
    q = (means * levels).floor().clamp(max=levels - 1).long().flatten(2)  # (B, C, N)
    C = q.shape[1]
    weights = levels ** torch.arange(C - 1, -1, -1, device=q.device)  # (C,) most significant first
    return (q * weights[None, :, None]).sum(dim=1)  # (B, N)


class MaskedPatchPrediction(nn.Module):
    """An encoder (a vitlab ViT/DeiT, kept as ``self.encoder``), a [mask] embedding and a mean-colour head."""

    method = "mpp"

    def __init__(self, encoder: nn.Module, corrupt_ratio: float = 0.5, mask_prob: float = 0.8,
                 random_prob: float = 0.1, bits: int = 3, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None):
        super().__init__()
        check_encoder(encoder, "mpp")
        check_options(encoder.patch_embed.num_patches, corrupt_ratio, mask_prob, random_prob)
        set_aside_head(encoder)
        in_chans = encoder.patch_embed.proj.in_channels
        mean = (0.0,) * in_chans if mean is None else tuple(mean)
        std = (1.0,) * in_chans if std is None else tuple(std)
        if len(mean) != in_chans or len(std) != in_chans:
            raise VitlabError(f"mean {mean} and std {std} need one value per input channel ({in_chans})")
        self.encoder: VisionTransformer = encoder
        self.corrupt_ratio, self.mask_prob, self.random_prob, self.bits = corrupt_ratio, mask_prob, random_prob, bits
        self.num_colors = 2 ** (bits * in_chans)
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, encoder.embed_dim))
        self.norm = output_norm(encoder)  # GAP encoders end without a norm on the tokens
        self.head = nn.Linear(encoder.embed_dim, self.num_colors)
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def no_weight_decay(self) -> set[str]:
        return no_weight_decay(self)

    def targets(self, imgs: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) normalised images -> (B, N) mean-colour classes of their un-normalised patches."""
        return mean_color_classes(imgs.float() * self.std + self.mean, self.encoder.patch_embed.patch_size, self.bits)

    def corrupt(self, x: torch.Tensor, c: Corruption) -> torch.Tensor:
        """(B, N, D) patch embeddings -> the same with the corruption applied."""
        x_swapped = gather_tokens(x, c.source)  # (B, N, D), drawn from the uncorrupted embeddings
        x = torch.where(c.swapped[..., None], x_swapped, x)
        return torch.where(c.mask_token[..., None], self.mask_token.to(x.dtype), x)

    def forward(self, imgs: torch.Tensor, corruption: Corruption | None = None,
                generator: torch.Generator | None = None) -> MPPOutput:
        e = self.encoder
        grid = e.patch_embed(imgs)  # (B, h, w, D)
        B, h, w, D = grid.shape
        if corruption is None:
            corruption = draw_corruption(B, h * w, self.corrupt_ratio, self.mask_prob, self.random_prob,
                                         grid.device, generator)
        x = self.corrupt(grid.reshape(B, h * w, D), corruption).reshape(B, h, w, D)
        x = e._pos_embed(x)  # (B, P + N, D): the position embedding goes on after the corruption
        x = self.norm(run_blocks(e, x))[:, e.num_prefix_tokens:]  # (B, N, D)
        logits = self.head(x)  # (B, N, num_colors)
        targets = self.targets(imgs)  # (B, N)
        loss = F.cross_entropy(logits[corruption.corrupted].float(), targets[corruption.corrupted])
        return MPPOutput(loss, logits, targets, corruption.corrupted)
