"""The ViT paper's own hybrid (Dosovitskiy et al. 2020, section 3.1): a BiT ResNetV2 makes the token grid.

BiT's ResNet (Kolesnikov et al. 2019) as the ViT paper uses it: weight-standardised convolutions with
TensorFlow's SAME padding, GroupNorm (32 groups) in place of BatchNorm, bottleneck blocks with the
activation after the sum (the paper's hybrid is not pre-activated). Its stem (7x7 stride 2 and a 3x3
stride-2 max-pool) and first stages turn the image into a (C, H/r, W/r) map; a ``patch_size`` convolution
of that map is a token. Everything after is the plain ViT.

timm's names and keys (``patch_embed.backbone.stem.conv``, ``stages.N.blocks.M.conv1``, ...) are kept,
so R50+ViT-B/16, R26+ViT-S/32 and R+ViT-Ti/16 checkpoints load as they are. With no stages
(``backbone_layers=()``, the R+ViT-Ti models) the backbone is the stem alone (``patch_embed.backbone.conv``).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import TimmSpec
from .layers import check_images, to_2tuple
from .vit import TIMM_ARGS, VisionTransformer

# the backbone of each timm hybrid name: its stage depths, and a registered name timm builds it from
TIMM_BACKBONES = {(): "vit_tiny_r_s16_p8_224", (2, 2, 2, 2): "vit_small_r26_s32_224", (3, 4, 9): "vit_base_r50_s16_224",
                  (3, 4, 6, 3): "vit_large_r50_s32_224"}
STAGE_WIDTHS = (256, 512, 1024, 2048)  # each stage's output channels (a quarter of them inside the bottleneck)


def same_pad(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """TensorFlow's SAME padding: the output is ceil(size / stride), the extra pixel on the bottom/right."""
    pads = []
    for size in (x.shape[-1], x.shape[-2]):
        if isinstance(size, torch.Tensor):  # traced for ONNX with dynamic sizes: keep it a computation
            pad = torch.clamp(((size / stride).ceil() - 1) * stride + kernel - size, min=0)
        else:
            pad = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
        pads += [pad // 2, pad - pad // 2]
    tracing = any(isinstance(p, torch.Tensor) for p in pads)
    return F.pad(x, pads, value=value) if tracing or any(pads) else x


class StdConv2dSame(nn.Conv2d):
    """Convolution with weight standardisation (each filter to zero mean, unit variance) and SAME padding."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int, stride: int = 1, eps: float = 1e-8):
        super().__init__(in_chs, out_chs, kernel_size, stride=stride, bias=False,
                         padding=(kernel_size - 1) // 2 if stride == 1 else 0)  # stride 1: the same, statically
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride[0] > 1:
            x = same_pad(x, self.kernel_size[0], self.stride[0])
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=self.eps).reshape_as(self.weight)  # per filter: (w - mean) / sqrt(var + eps)
        return F.conv2d(x, w, None, self.stride, self.padding)


class GroupNormAct(nn.GroupNorm):
    """GroupNorm (32 groups, eps 1e-5), then ReLU unless ``act=False``."""

    def __init__(self, num_channels: int, act: bool = True):
        super().__init__(32, num_channels, eps=1e-5)
        self.act = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class MaxPoolSame(nn.Module):
    """3x3 stride-2 max-pool with SAME padding (padded with -inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(same_pad(x, 3, 2, value=-math.inf), 3, 2)


class Downsample(nn.Module):
    """The shortcut of a block that changes width or stride: a 1x1 convolution and GroupNorm."""

    def __init__(self, in_chs: int, out_chs: int, stride: int):
        super().__init__()
        self.conv = StdConv2dSame(in_chs, out_chs, 1, stride=stride)
        self.norm = GroupNormAct(out_chs, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1, GroupNorm after each, ReLU after the residual sum."""

    def __init__(self, in_chs: int, out_chs: int, stride: int = 1):
        super().__init__()
        mid = out_chs // 4
        self.downsample = Downsample(in_chs, out_chs, stride) if stride != 1 or in_chs != out_chs else None
        self.conv1 = StdConv2dSame(in_chs, mid, 1)
        self.norm1 = GroupNormAct(mid)
        self.conv2 = StdConv2dSame(mid, mid, 3, stride=stride)
        self.norm2 = GroupNormAct(mid)
        self.conv3 = StdConv2dSame(mid, out_chs, 1)
        self.norm3 = GroupNormAct(out_chs, act=False)
        self.act3 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.norm2(self.conv2(self.norm1(self.conv1(x))))
        return self.act3(self.norm3(self.conv3(x)) + shortcut)


class ResNetStage(nn.Module):
    def __init__(self, in_chs: int, out_chs: int, depth: int, stride: int):
        super().__init__()
        self.blocks = nn.Sequential(*[Bottleneck(in_chs if i == 0 else out_chs, out_chs, stride if i == 0 else 1)
                                      for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def resnetv2_stem(in_chans: int, width: int = 64) -> nn.Sequential:
    """7x7 stride-2 convolution, GroupNorm + ReLU, 3x3 stride-2 max-pool: (B, C, H, W) -> (B, 64, H/4, W/4)."""
    return nn.Sequential(OrderedDict(conv=StdConv2dSame(in_chans, width, 7, stride=2), norm=GroupNormAct(width),
                                     pool=MaxPoolSame()))


class ResNetV2(nn.Module):
    """The stem and the bottleneck stages (the first at stride 1, each later one halving the map)."""

    def __init__(self, layers: tuple[int, ...], in_chans: int = 3):
        super().__init__()
        self.stem = resnetv2_stem(in_chans)
        self.stages = nn.Sequential()
        chs = 64
        for i, depth in enumerate(layers):
            self.stages.add_module(str(i), ResNetStage(chs, STAGE_WIDTHS[i], depth, 1 if i == 0 else 2))
            chs = STAGE_WIDTHS[i]
        self.num_features = chs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


def feature_size(size: int, num_stages: int) -> int:
    """The backbone's map size for an input size: SAME padding rounds each halving up."""
    for _ in range(2 + max(num_stages - 1, 0)):  # the stem's two halvings, one for each stage after the first
        size = math.ceil(size / 2)
    return size


class ResNetV2Embed(nn.Module):
    """ResNetV2 backbone -> (B, h, w, D) token grid (timm's HybridEmbed), the PatchEmbed interface.

    ``patch_size`` is the projection's kernel and stride on the backbone's map; ``patch_embed.patch_size``
    is what one token spans in pixels, as for every vitlab embedding.
    """

    def __init__(self, img_size, patch_size, in_chans, embed_dim, layers, bias=True, dynamic_img_size=False):
        super().__init__()
        if len(layers) > len(STAGE_WIDTHS):
            raise VitlabError(f"backbone_layers {layers} has more than {len(STAGE_WIDTHS)} stages")
        self.backbone = ResNetV2(layers, in_chans) if layers else resnetv2_stem(in_chans)
        self.num_stages, self.in_chans = len(layers), in_chans
        width = self.backbone.num_features if layers else 64
        self.img_size, self.dynamic_img_size = to_2tuple(img_size), dynamic_img_size
        p = to_2tuple(patch_size)
        stride = 2 ** (2 + max(len(layers) - 1, 0))
        self.patch_size = (stride * p[0], stride * p[1])
        self.grid_size = tuple(feature_size(s, len(layers)) // q for s, q in zip(self.img_size, p))
        if min(self.grid_size) < 1:
            raise VitlabError(f"image size {self.img_size} is smaller than one token ({self.patch_size} pixels)")
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(width, embed_dim, kernel_size=p, stride=p, bias=bias)
        for m in self.backbone.modules():  # timm's ResNetV2 init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_images(x, self.in_chans, self.img_size, self.dynamic_img_size)
        return self.proj(self.backbone(x)).permute(0, 2, 3, 1)  # (B, h, w, D)


class ResNetV2VisionTransformer(VisionTransformer):
    """timm's hybrid VisionTransformer on a BiT ResNetV2 (``vit_base_r50_s16_384``, ``vit_small_r26_s32_224``, ...)."""

    family = "hybrid ViT (BiT ResNetV2 patch embedding, the ViT paper's)"
    timm_names = frozenset(f"vit_{n}" for n in ("tiny_r_s16_p8_224", "tiny_r_s16_p8_384", "small_r26_s32_224",
                                                "small_r26_s32_384", "base_r26_s32_224", "base_r50_s16_224",
                                                "base_r50_s16_384", "large_r50_s32_224", "large_r50_s32_384"))
    empty_args = ("backbone_layers",)  # no stages: the stem alone (R+ViT-Ti)
    hf_model_type = None
    no_hf = ("a ViT on a ResNetV2 (transformers' ViTHybrid was deprecated and is gone from transformers 5; "
             "export to timm)")
    no_pretrain = ("its ResNetV2 stem mixes neighbouring patches before they become tokens, so a hidden or "
                   "corrupted patch reaches the encoder through its neighbours")

    @property
    def timm_spec(self) -> TimmSpec | None:
        base = TIMM_BACKBONES.get(tuple(self.backbone_layers))
        if base is None:
            return None
        return TimmSpec("VisionTransformer", TIMM_ARGS, base, fixed={"norm_eps": 1e-6, "pos_embed_antialias": True},
                        dropped=("backbone_layers",))  # the name says the backbone

    @property
    def no_timm(self) -> str:
        return (f"timm has no hybrid on ResNetV2 stages {tuple(self.backbone_layers)}; its backbones are "
                f"{', '.join(map(str, TIMM_BACKBONES))}")

    def __init__(self, img_size=224, patch_size=1, in_chans=3, embed_dim=768, backbone_layers=(3, 4, 9),
                 pre_norm=False, dynamic_img_size=False, **kwargs):
        embed = ResNetV2Embed(img_size, patch_size, in_chans, embed_dim, tuple(backbone_layers), bias=not pre_norm,
                              dynamic_img_size=dynamic_img_size)
        grid, stride = embed.grid_size, embed.patch_size  # the parent's patch grid: the same number of tokens
        super().__init__(img_size=(grid[0] * stride[0], grid[1] * stride[1]), patch_size=stride, in_chans=in_chans,
                         embed_dim=embed_dim, pre_norm=pre_norm, dynamic_img_size=dynamic_img_size, **kwargs)
        self.backbone_layers = tuple(backbone_layers)
        self.patch_embed = embed
