"""Compact Convolutional Transformer (Hassani et al. 2021): a ViT that learns from small data sets.

Two changes to the ViT make it train from scratch on CIFAR-sized data: a few convolution +
max-pool layers turn the image into the tokens (instead of cutting it into patches), and
sequence pooling (a learned softmax weighting of all output tokens) replaces the class token.
Everything between is the plain ViT (pre-norm blocks, learned position embedding).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from .layers import check_images, init_weights_vit, to_2tuple
from .vit import VisionTransformer


def tokenizer_reduction(kernel_size: int, layers: int) -> int:
    """How many input pixels one token spans along each side: each layer's convolution stride times its pool's 2."""
    return (max(1, kernel_size // 2 - 1) * 2) ** layers


class ConvTokenizer(nn.Module):
    """``layers`` x (k x k convolution, ReLU, 3x3 stride-2 max-pool) -> (B, h, w, D) tokens, as PatchEmbed."""

    def __init__(self, img_size, in_chans, embed_dim, layers=1, kernel_size=3, width=64, dynamic_img_size=False):
        super().__init__()
        chans = [in_chans] + [width] * (layers - 1) + [embed_dim]
        stride, padding = max(1, kernel_size // 2 - 1), max(1, kernel_size // 2)
        self.proj = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(chans[i], chans[i + 1], kernel_size, stride, padding, bias=False), nn.ReLU(),
                          nn.MaxPool2d(3, stride=2, padding=1))
            for i in range(layers)])
        r = tokenizer_reduction(kernel_size, layers)
        self.img_size = to_2tuple(img_size)
        if self.img_size[0] % r or self.img_size[1] % r:
            raise VitlabError(f"image size {self.img_size} is not divisible by the tokenizer's stride {r}")
        self.in_chans = in_chans
        self.patch_size = (r, r)
        self.grid_size = (self.img_size[0] // r, self.img_size[1] // r)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.dynamic_img_size = dynamic_img_size
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_images(x, self.in_chans, self.img_size, self.dynamic_img_size)
        return self.proj(x).permute(0, 2, 3, 1)  # (B, h, w, D)


class CompactTransformer(VisionTransformer):
    family = "CCT (convolutional tokenizer, sequence pooling)"
    parent_args_fixed = ("patch_size", "class_token", "global_pool", "fc_norm")
    global_pools = ("seq",)
    timm_names = frozenset()
    timm_spec = None
    no_timm = "timm has no Compact Convolutional Transformer"
    hf_model_type = None
    no_hf = "a CCT (its convolutional tokenizer and sequence pooling)"
    no_pretrain = ("its convolutional tokenizer mixes neighbouring pixels across token borders, so a hidden "
                   "token reaches the encoder through its neighbours")

    def __init__(self, img_size=32, in_chans=3, embed_dim=256, tokenizer_layers=1, tokenizer_kernel=3,
                 tokenizer_width=64, dynamic_img_size=False, **kwargs):
        stride = tokenizer_reduction(tokenizer_kernel, tokenizer_layers)
        super().__init__(img_size=img_size, patch_size=stride, in_chans=in_chans, embed_dim=embed_dim,
                         class_token=False, global_pool="avg", fc_norm=False, dynamic_img_size=dynamic_img_size,
                         **kwargs)  # then pooled by sequence pooling, not the average
        self.patch_embed = ConvTokenizer(img_size, in_chans, embed_dim, tokenizer_layers, tokenizer_kernel,
                                         tokenizer_width, dynamic_img_size)
        self.global_pool = "seq"
        self.attention_pool = nn.Linear(embed_dim, 1)  # one score per token
        init_weights_vit(self.attention_pool)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) tokens -> (B, D): their mean weighted by a softmax over the tokens' scores."""
        weights = self.attention_pool(x).softmax(dim=1)  # (B, N, 1)
        return (weights.transpose(1, 2) @ x).squeeze(1)
