"""A hybrid ViT whose tokenizer is the speed-run CNN's front (models/airbench.py): the frozen 2x2 patch-whitening
convolution and BatchNorm conv groups, each group halving the grid, a 1x1 projection of each cell to a token, then
the plain ViT.

With ``stem_pad`` the image is padded by one pixel first so that the grid halves exactly (32x32 with two groups: an
8x8 grid of 64 tokens; three: 4x4). Without it the stem is the CNN's own, 32 -> 31 after the 2x2 whitening, then
15, 7, 3 (two groups: a 7x7 grid of 49 tokens; three: 3x3); a third cheaper on a CPU (the odd sizes pool away a row).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import VitlabError
from .airbench import WhitenStem, scaled_widths
from .hybrid import HybridVisionTransformer
from .layers import to_2tuple
from .vit import VisionTransformer


class WhitenEmbed(nn.Module):
    """Whitening stem -> (B, h, w, D) token grid, the PatchEmbed interface."""

    def __init__(self, img_size, in_chans, embed_dim, widths, bn_momentum=0.4, eps=5e-4, dynamic_img_size=False,
                 pad=True, from_data=True):
        super().__init__()
        self.stem = WhitenStem(in_chans, widths, bn_momentum, eps, pad=pad, from_data=from_data)
        self.proj = nn.Conv2d(self.stem.num_features, embed_dim, kernel_size=1)
        r = 2 ** len(widths)  # each conv group halves the grid
        self.img_size, self.patch_size, self.dynamic_img_size = to_2tuple(img_size), (r, r), dynamic_img_size
        if pad and any(s % r for s in self.img_size):
            raise VitlabError(f"image size {self.img_size} is not divisible by the stem's stride {r}; "
                              "accepted: a multiple of it, or stem_pad=False")
        self.grid_size = tuple(self.stem.out_size(s) for s in self.img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chans, size = self.stem.whiten.in_channels, tuple(x.shape[-2:])
        if x.ndim != 4 or x.shape[1] != chans:
            raise VitlabError(f"expected images of shape (B, {chans}, H, W), got {tuple(x.shape)}")
        if size != self.img_size and not self.dynamic_img_size:
            raise VitlabError(f"input size {size[0]}x{size[1]} does not match the model's {self.img_size[0]}x"
                              f"{self.img_size[1]}; use img_size=... or dynamic_img_size=True")
        return self.proj(self.stem(x)).permute(0, 2, 3, 1)  # (B, h, w, D)


class AirBenchHybrid(VisionTransformer):
    family = "hybrid ViT (whitening conv-group embedding)"
    parent_args_fixed = ("patch_size",)
    timm_names, timm_spec, hf_model_type = frozenset(), None, None  # not the ViT's
    no_timm, no_hf = "timm has no hybrid ViT on a patch-whitening stem", "a hybrid ViT (its whitening conv stem)"
    no_pretrain = HybridVisionTransformer.no_pretrain  # the same reason: a CNN stem mixes neighbouring patches

    def __init__(self, img_size=32, in_chans=3, embed_dim=128, stem_widths=(64, 256), width_mult=1.0,
                 bn_momentum=0.4, whiten_eps=5e-4, whiten_from_data=True, stem_pad=True, dynamic_img_size=False,
                 **kwargs):
        if not stem_widths or width_mult <= 0:
            raise VitlabError(f"stem_widths {stem_widths} must be non-empty and width_mult {width_mult} > 0")
        stride = 2 ** len(stem_widths)
        if not stem_pad:  # the stem takes any size (odd sizes pool a row away); the placeholder patches must tile it
            stride = math.gcd(stride, *to_2tuple(img_size))
        super().__init__(img_size=img_size, patch_size=stride, in_chans=in_chans,
                         embed_dim=embed_dim, dynamic_img_size=dynamic_img_size, **kwargs)
        self.patch_embed = WhitenEmbed(img_size, in_chans, embed_dim, scaled_widths(stem_widths, width_mult),
                                       bn_momentum, whiten_eps, dynamic_img_size, stem_pad, whiten_from_data)
        if not stem_pad:
            self.init_pos_embed()  # one embedding per cell of the stem's grid (7x7 for 32x32, not the stride's 8x8)

    def init_from_data(self, images: torch.Tensor) -> bool:
        """Set the whitening filters from normalised (B, C, H, W) training images (a few thousand suffice); False
        when the model trains its filters instead (``whiten_from_data=False``)."""
        return self.patch_embed.stem.init_from_data(images)

    def freeze_stem(self) -> bool:
        return self.patch_embed.stem.freeze_stem()
