"""Hybrid ViT (Dosovitskiy et al. 2020, section 3.1): ResNet feature maps as the patch tokens.

A ResNet stem and its first stages turn the image into a (C, H/r, W/r) map; a 1x1 projection of
each cell is a token. Everything after the embedding is the plain ViT.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from .layers import to_2tuple
from .resnet import ResNet, resnet_reduction
from .vit import VisionTransformer


class HybridEmbed(nn.Module):
    """CNN backbone -> (B, h, w, D) token grid, the PatchEmbed interface."""

    def __init__(self, img_size, in_chans, embed_dim, layers, widths, stem, dynamic_img_size=False):
        super().__init__()
        self.backbone = ResNet(layers=layers, widths=widths, stem=stem, in_chans=in_chans, num_classes=0)
        r = self.backbone.reduction
        self.img_size = to_2tuple(img_size)
        if self.img_size[0] % r or self.img_size[1] % r:
            raise VitlabError(f"image size {self.img_size} is not divisible by the backbone's stride {r}")
        self.patch_size = (r, r)
        self.grid_size = (self.img_size[0] // r, self.img_size[1] // r)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.dynamic_img_size = dynamic_img_size
        self.proj = nn.Conv2d(self.backbone.num_features, embed_dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.backbone.conv1.in_channels:
            raise VitlabError(f"expected images of shape (B, {self.backbone.conv1.in_channels}, H, W), "
                              f"got {tuple(x.shape)}")
        if not self.dynamic_img_size and tuple(x.shape[-2:]) != self.img_size:
            raise VitlabError(f"input size {x.shape[-2]}x{x.shape[-1]} does not match the model's "
                              f"{self.img_size[0]}x{self.img_size[1]}; use img_size=... or dynamic_img_size=True")
        return self.proj(self.backbone.forward_features(x)).permute(0, 2, 3, 1)  # (B, h, w, D)


class HybridVisionTransformer(VisionTransformer):
    family = "hybrid ViT (ResNet patch embedding)"
    parent_args_fixed = ("patch_size",)
    timm_names = frozenset()
    timm_spec = None
    no_timm = "timm has no hybrid ViT on a ResNet-18-style backbone (its hybrids use ResNetV2 stems)"
    hf_model_type = None
    no_hf = "a hybrid ViT (its ResNet backbone)"
    no_pretrain = ("its CNN stem mixes neighbouring patches before they become tokens, so a hidden or "
                   "corrupted patch reaches the encoder through its neighbours")

    def __init__(self, img_size=224, in_chans=3, embed_dim=384, backbone_layers=(2, 2, 2),
                 backbone_widths=(64, 128, 256), backbone_stem="imagenet", dynamic_img_size=False, **kwargs):
        stride = resnet_reduction(backbone_stem, len(backbone_layers))
        super().__init__(img_size=img_size, patch_size=stride, in_chans=in_chans, embed_dim=embed_dim,
                         dynamic_img_size=dynamic_img_size, **kwargs)
        self.patch_embed = HybridEmbed(img_size, in_chans, embed_dim, backbone_layers, backbone_widths,
                                       backbone_stem, dynamic_img_size)
