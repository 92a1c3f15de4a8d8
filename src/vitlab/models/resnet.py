"""ResNet (He et al. 2015) with basic blocks: a distillation teacher, and the stem of hybrid ViTs.

``stem='cifar'`` is the 32x32 variant (one 3x3 convolution, no max-pool); ``stem='imagenet'``
the 7x7 stride-2 convolution and max-pool. Names follow timm's ResNet (conv1, bn1, layer1, fc).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec


def resnet_reduction(stem: str, num_stages: int) -> int:
    """How many input pixels one feature-map cell spans along each side."""
    return (1 if stem == "cifar" else 4) * 2 ** (num_stages - 1)


class BasicBlock(nn.Module):
    def __init__(self, in_chs: int, out_chs: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_chs, out_chs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_chs)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_chs, out_chs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_chs)
        self.act2 = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_chs != out_chs:
            self.downsample = nn.Sequential(nn.Conv2d(in_chs, out_chs, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_chs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return self.act2(x + shortcut)


class ResNet(Model):
    family = "ResNet (CNN)"
    classifier_names = ("fc",)
    no_weight_decay_names = ()
    timm_names = frozenset({"resnet18", "resnet34"})
    timm_spec = TimmSpec("ResNet", ("layers", "num_classes", "in_chans", "drop_rate"), "resnet18",
                         fixed={"stem": "imagenet", "widths": [64, 128, 256, 512]},
                         dropped=("img_size",))  # fully convolutional: timm's takes any size
    no_hf = "a ResNet"
    no_pretrain = "a convolutional network has no patch tokens to hide"

    def __init__(self, layers=(2, 2, 2, 2), widths=(64, 128, 256, 512), stem="cifar", in_chans=3,
                 num_classes=1000, img_size=32, drop_rate=0.0):
        super().__init__()
        if stem not in ("cifar", "imagenet"):
            raise VitlabError(f"stem {stem!r} is not one of ('cifar', 'imagenet')")
        if len(layers) != len(widths) or not layers:
            raise VitlabError(f"layers {layers} and widths {widths} must be non-empty and of one length")
        self.num_classes = num_classes
        self.img_size = img_size
        stem_chs = widths[0]
        if stem == "cifar":
            self.conv1 = nn.Conv2d(in_chans, stem_chs, 3, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_chans, stem_chs, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(stem_chs)
        self.act1 = nn.ReLU(inplace=True)
        in_chs = stem_chs
        for i, (n, w) in enumerate(zip(layers, widths)):
            stage = nn.Sequential(*[BasicBlock(in_chs if j == 0 else w, w, stride=2 if (i > 0 and j == 0) else 1)
                                    for j in range(n)])
            self.add_module(f"layer{i + 1}", stage)
            in_chs = w
        self.num_stages = len(layers)
        self.num_features = in_chs
        self.reduction = resnet_reduction(stem, len(layers))
        self.head_drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(in_chs, num_classes) if num_classes > 0 else nn.Identity()
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():  # zero-init the last BN of each block: every block starts as identity
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new untrained fc for num_classes (0: none); the pooling is always the average."""
        if global_pool not in (None, "avg"):
            raise VitlabError(f"global_pool {global_pool!r} is not valid for a ResNet; accepted: 'avg'")
        super().reset_classifier(num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, num_features, H / reduction, W / reduction)."""
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return x

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) feature map -> (B, C), the average over positions."""
        return x.mean(dim=(2, 3))
