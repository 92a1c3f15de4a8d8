"""Masked autoencoder (He et al. 2022) around a vitlab ViT or DeiT encoder.

The encoder embeds every patch and adds its position embedding, then keeps a random
(1 - mask_ratio) of the patch tokens per image, plus the prefix tokens (class, distillation,
registers), and runs its blocks on those alone. A light decoder puts a shared mask token where
the hidden patches were, adds a fixed 2D sin-cos position table and predicts every patch's
pixels; the loss is the mean squared error on the hidden patches, by default against
per-patch-normalised pixels (MAE's norm_pix_loss).

Decoder defaults: for encoders 768 wide or more, MAE's 512 wide x 8 deep (its ViT-B/L/H
setting); for smaller ones half the encoder's width (a multiple of 32) x 2 deep, about 5% of the
encoder's compute per token, near MAE's ViT-L ratio (8%). The decoder sees every patch, so one as
wide as a small encoder costs about as much as the encoder's pass over the visible quarter: on
vit_tiny_patch4_32 it cuts the speed-up over supervised training from 2.9x to 2.0x
(benchmarks/bench_pretrain.py). MAE's ablations find a shallow or narrow decoder as good for
fine-tuning, while a linear probe gains from a deeper, wider one: pass decoder_dim and
decoder_depth for that. Heads are 32 wide (MAE's 16 heads at 512).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from ..errors import VitlabError
from ..models.layers import Block, init_weights_vit, sincos_2d_pos_embed, to_2tuple
from ..models.vit import VisionTransformer
from .encoder import check_encoder, no_weight_decay, run_blocks, set_aside_head
from .masking import Masking, gather_tokens, num_visible, random_masking, restore_tokens


def patchify(imgs: torch.Tensor, patch_size: int | tuple[int, int]) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, ph*pw*C), patches in row-major grid order, each pixel's channels together."""
    ph, pw = to_2tuple(patch_size)
    B, C, H, W = imgs.shape
    if H % ph or W % pw:
        raise VitlabError(f"image size {H}x{W} is not divisible by the patch size {ph}x{pw}")
    h, w = H // ph, W // pw
    x = imgs.reshape(B, C, h, ph, w, pw).permute(0, 2, 4, 3, 5, 1)  # (B, h, w, ph, pw, C)
    return x.reshape(B, h * w, ph * pw * C)


def unpatchify(x: torch.Tensor, patch_size: int | tuple[int, int], grid_size: int | tuple[int, int]) -> torch.Tensor:
    """(B, N, ph*pw*C) -> (B, C, H, W), the inverse of patchify."""
    ph, pw = to_2tuple(patch_size)
    h, w = to_2tuple(grid_size)
    B, N, P = x.shape
    if N != h * w or P % (ph * pw):
        raise VitlabError(f"cannot place {N} patches of {P} values on a {h}x{w} grid of {ph}x{pw} patches")
    C = P // (ph * pw)
    x = x.reshape(B, h, w, ph, pw, C).permute(0, 5, 1, 3, 2, 4)  # (B, C, h, ph, w, pw)
    return x.reshape(B, C, h * ph, w * pw)


def patch_targets(patches: torch.Tensor, norm_pix: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(B, N, P) pixels -> targets: each patch minus its mean, over sqrt(var + eps) (unbiased var, as MAE)."""
    if not norm_pix:
        return patches
    mean = patches.mean(dim=-1, keepdim=True)
    var = patches.var(dim=-1, keepdim=True)
    return (patches - mean) / (var + eps).sqrt()


def decoder_defaults(embed_dim: int) -> tuple[int, int, int]:
    """(width, depth, heads) of the decoder for an encoder embed_dim wide (the rule in the module docstring)."""
    if embed_dim >= 768:
        return 512, 8, 16
    dim = max(32, embed_dim // 2 // 32 * 32)
    return dim, 2, attention_heads(dim)


def attention_heads(dim: int, head_width: int = 32) -> int:
    """The most heads of at least head_width channels that divide dim."""
    return next(h for h in range(max(dim // head_width, 1), 0, -1) if dim % h == 0)


class MAEDecoder(nn.Module):
    """Encoded visible tokens -> pixel predictions for every patch, (B, N, ph*pw*C)."""

    def __init__(self, embed_dim: int, grid_size: tuple[int, int], patch_size: tuple[int, int], in_chans: int,
                 num_prefix_tokens: int, dim: int, depth: int, num_heads: int, mlp_ratio: float = 4.0,
                 norm_in: bool = False):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.grid_size = tuple(grid_size)
        self.num_prefix_tokens = num_prefix_tokens
        self.norm_in = norm_layer(embed_dim) if norm_in else nn.Identity()  # GAP encoders end without a norm
        self.embed = nn.Linear(embed_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        # MAE's 2D sin-cos formula; the first half of the channels encodes the row (MAE's, the column)
        self.register_buffer("pos_embed", sincos_2d_pos_embed(self.grid_size, dim)[None], persistent=False)
        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                                      for _ in range(depth)])
        self.norm = norm_layer(dim)
        self.pred = nn.Linear(dim, patch_size[0] * patch_size[1] * in_chans)
        self.apply(init_weights_vit)
        nn.init.normal_(self.mask_token, std=0.02)

    def pos_table(self, grid_size: tuple[int, int]) -> torch.Tensor:
        """(1, h*w, dim) fixed sin-cos table for a patch grid (rebuilt for a grid other than the default)."""
        if tuple(grid_size) == self.grid_size:
            return self.pos_embed
        return sincos_2d_pos_embed(grid_size, self.pos_embed.shape[-1]).to(self.pos_embed)[None]

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        P = self.num_prefix_tokens
        x = self.embed(self.norm_in(latent))  # (B, P + V, Dd)
        prefix, x = x[:, :P], x[:, P:]
        x = restore_tokens(x, self.mask_token, ids_restore)  # (B, N, Dd), mask tokens at the hidden patches
        x = x + self.pos_table(grid_size).to(x.dtype)
        x = torch.cat([prefix, x], dim=1)  # prefix tokens take part without a position
        x = self.norm(self.blocks(x))
        return self.pred(x[:, P:])  # (B, N, ph*pw*C)


class MAEOutput(NamedTuple):
    loss: torch.Tensor  # () mean squared error over the hidden patches
    pred: torch.Tensor  # (B, N, ph*pw*C) predicted (normalised, with norm_pix_loss) pixels of every patch
    mask: torch.Tensor  # (B, N) 1 = hidden, 0 = visible


class MaskedAutoencoder(nn.Module):
    """An encoder (a vitlab ViT/DeiT, kept as ``self.encoder``) and a light pixel decoder (``self.decoder``)."""

    method = "mae"

    def __init__(self, encoder: nn.Module, mask_ratio: float = 0.75, decoder_dim: int | None = None,
                 decoder_depth: int | None = None, decoder_heads: int | None = None, decoder_mlp_ratio: float = 4.0,
                 norm_pix_loss: bool = True):
        super().__init__()
        check_encoder(encoder, "mae")
        embed = encoder.patch_embed
        num_visible(embed.num_patches, mask_ratio)  # a ratio that leaves no patch visible fails here
        set_aside_head(encoder)
        dim, depth, _ = decoder_defaults(encoder.embed_dim)
        dim = decoder_dim or dim
        depth = depth if decoder_depth is None else decoder_depth
        heads = decoder_heads or attention_heads(dim)
        self.encoder: VisionTransformer = encoder
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        self.patch_size = tuple(embed.patch_size)
        self.decoder = MAEDecoder(encoder.embed_dim, embed.grid_size, self.patch_size, embed.proj.in_channels,
                                  encoder.num_prefix_tokens, dim, depth, heads, decoder_mlp_ratio,
                                  norm_in=isinstance(encoder.norm, nn.Identity))

    def no_weight_decay(self) -> set[str]:
        return no_weight_decay(self)

    def forward_encoder(self, imgs: torch.Tensor, masking: Masking | None = None,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, Masking, tuple[int, int]]:
        """(B, C, H, W) -> (B, P + V, D) encoded prefix + visible tokens, the masking used, the patch grid."""
        e = self.encoder
        grid = e.patch_embed(imgs)  # (B, h, w, D)
        B, h, w, _ = grid.shape
        x = e._pos_embed(grid)  # (B, P + N, D): prefix tokens and position embedding, before masking
        P = e.num_prefix_tokens
        prefix, x = x[:, :P], x[:, P:]
        if masking is None:
            masking = random_masking(B, h * w, self.mask_ratio, x.device, generator)
        x = torch.cat([prefix, gather_tokens(x, masking.ids_keep)], dim=1)  # (B, P + V, D)
        return run_blocks(e, x), masking, (h, w)

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the hidden patches only."""
        target = patch_targets(patchify(imgs.float(), self.patch_size), self.norm_pix_loss)  # (B, N, P)
        per_patch = (pred.float() - target).pow(2).mean(dim=-1)  # (B, N)
        return (per_patch * mask).sum() / mask.sum().clamp(min=1)  # mask_ratio 0 hides nothing: loss 0

    def forward(self, imgs: torch.Tensor, masking: Masking | None = None,
                generator: torch.Generator | None = None) -> MAEOutput:
        latent, masking, grid = self.forward_encoder(imgs, masking, generator)
        pred = self.decoder(latent, masking.ids_restore, grid)  # (B, N, ph*pw*C)
        return MAEOutput(self.forward_loss(imgs, pred, masking.mask), pred, masking.mask)

    @torch.no_grad()
    def reconstruct(self, imgs: torch.Tensor, pred: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked input, reconstruction) images in the input's space: hidden patches zeroed, and predicted.

        With norm_pix_loss the predictions are put back into each patch's true mean and spread (as MAE's
        demo does): the colour and contrast of a patch come from the image, its structure from the model.
        """
        patches = patchify(imgs.float(), self.patch_size)  # (B, N, P)
        out = pred.float()
        if self.norm_pix_loss:
            out = out * (patches.var(dim=-1, keepdim=True) + 1e-6).sqrt() + patches.mean(dim=-1, keepdim=True)
        grid = (imgs.shape[-2] // self.patch_size[0], imgs.shape[-1] // self.patch_size[1])
        hidden = mask[..., None].to(patches.dtype)
        masked = unpatchify(patches * (1 - hidden), self.patch_size, grid)
        return masked, unpatchify(out, self.patch_size, grid)
