"""A CIFAR-10 speed-run CNN after airbench (Jordan 2024, "94% on CIFAR-10 in 3.29 seconds on a single GPU").

    image (B, 3, 32, 32)
      -> whiten: a frozen 2x2 convolution without padding whose filters are the eigenvectors of the training
         images' 2x2 patch covariance scaled by 1 / sqrt(eigenvalue + eps), and their negations  (B, 24, 31, 31)
      -> GELU
      -> three conv groups (conv 3x3, max-pool 2, BatchNorm, GELU, conv 3x3, BatchNorm, GELU)
         of widths 64, 256, 256                               (B, 64, 15, 15) -> (B, 256, 7, 7) -> (B, 256, 3, 3)
      -> max-pool over what is left, a linear head without bias, logits scaled by 1/9

The 3x3 convolutions start as identities on their first input channels (dirac); the BatchNorm scales are
fixed at 1 and only their biases learn; the whitening filters never learn, their bias does until
``freeze_stem``. ``init_from_data`` sets the filters from images; a trainer calls it once on a fresh run.
``whiten_from_data=False`` (the ablation) leaves the filters at PyTorch's default init and trains them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import Model


def patches_2d(images: torch.Tensor, size: int) -> torch.Tensor:
    """Every size x size patch (stride 1) of (B, C, H, W) images, flattened: (B * h * w, C * size * size)."""
    c = images.shape[1]
    p = images.unfold(2, size, 1).unfold(3, size, 1)  # (B, C, h, w, size, size)
    return p.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * size * size).double()


def whitening_filters(images: torch.Tensor, size: int = 2, eps: float = 5e-4) -> torch.Tensor:
    """(C*size*size, C, size, size) filters: the eigenvectors of the patches' second-moment matrix, largest
    eigenvalue first, each divided by sqrt(its eigenvalue + eps). With eps 0 the filtered patches have the
    identity as their second-moment matrix."""
    flat = patches_2d(images, size)
    cov = flat.T @ flat / len(flat)  # (D, D), D = C*size*size
    eigenvalues, eigenvectors = torch.linalg.eigh(cov)  # ascending
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
    filters = eigenvectors.T / torch.sqrt(eigenvalues.clamp(min=0) + eps).unsqueeze(1)  # (D, D), one filter a row
    return filters.reshape(-1, images.shape[1], size, size).float()


class Whiten(nn.Conv2d):
    """The frozen patch-whitening convolution: D filters and their negations (2 * C * size * size channels)."""

    def __init__(self, in_chans: int = 3, size: int = 2, eps: float = 5e-4, from_data: bool = True):
        super().__init__(in_chans, 2 * in_chans * size * size, size, padding=0, bias=True)
        self.eps, self.from_data = eps, from_data
        self.weight.requires_grad = not from_data  # without the data's filters: an ordinary trained convolution
        nn.init.zeros_(self.bias)

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor) -> bool:
        """Set the filters from normalised (B, C, H, W) training images; False (nothing done) unless ``from_data``."""
        if not self.from_data:
            return False
        filters = whitening_filters(images.to(self.weight.device), self.kernel_size[0], self.eps)
        self.weight.copy_(torch.cat([filters, -filters]))
        return True


def dirac_conv(in_chs: int, out_chs: int) -> nn.Conv2d:
    """A 3x3 'same' convolution without bias whose first min(in, out) filters start as identities."""
    conv = nn.Conv2d(in_chs, out_chs, 3, padding=1, bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:min(in_chs, out_chs)])
    return conv


def batch_norm(chs: int, momentum: float) -> nn.BatchNorm2d:
    """BatchNorm whose scale is fixed at 1 (only the bias learns); ``momentum`` in PyTorch's sense."""
    bn = nn.BatchNorm2d(chs, eps=1e-12, momentum=momentum)
    bn.weight.requires_grad = False
    return bn


class ConvGroup(nn.Module):
    """conv, max-pool 2, BN, GELU, conv, BN, GELU: (B, in, H, W) -> (B, out, H // 2, W // 2)."""

    def __init__(self, in_chs: int, out_chs: int, bn_momentum: float = 0.4):
        super().__init__()
        self.conv1 = dirac_conv(in_chs, out_chs)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = batch_norm(out_chs, bn_momentum)
        self.conv2 = dirac_conv(out_chs, out_chs)
        self.norm2 = batch_norm(out_chs, bn_momentum)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


class WhitenStem(nn.Module):
    """Whitening convolution, GELU, then conv groups: the CNN of the speed run without its head.

    ``pad``: pad the image by one pixel on the right and bottom first, so that 32x32 stays 32x32 after the
    2x2 whitening and each group halves it exactly (32 -> 16 -> 8): the grid a transformer tokenizer wants.
    """

    def __init__(self, in_chans: int = 3, widths=(64, 256, 256), bn_momentum: float = 0.4, eps: float = 5e-4,
                 pad: bool = False, from_data: bool = True):
        super().__init__()
        self.pad = pad
        self.whiten = Whiten(in_chans, 2, eps, from_data)
        self.act = nn.GELU()
        chs = [self.whiten.out_channels, *widths]
        self.groups = nn.Sequential(*[ConvGroup(a, b, bn_momentum) for a, b in zip(chs[:-1], chs[1:])])
        self.num_features = chs[-1]

    def init_from_data(self, images: torch.Tensor) -> bool:
        return self.whiten.init_from_data(images)

    def out_size(self, size: int) -> int:
        """The side of the output grid for an input side ``size``."""
        size = size + 1 if self.pad else size
        size -= self.whiten.kernel_size[0] - 1
        for _ in self.groups:
            size //= 2
        return size

    def freeze_stem(self) -> bool:
        """Stop training the whitening bias (its filters never train); True when it was still training."""
        was = self.whiten.bias.requires_grad
        self.whiten.bias.requires_grad = False
        return was

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad:
            x = F.pad(x, (0, 1, 0, 1), mode="replicate")
        return self.groups(self.act(self.whiten(x)))


def scaled_widths(widths, width_mult: float) -> tuple[int, ...]:
    return tuple(max(1, round(w * width_mult)) for w in widths)


class AirBench(Model):
    family = "speed-run CNN (airbench)"
    no_weight_decay_names = ()
    global_pools = ("max",)
    layer_stack = "stem.groups"  # layer-wise lr decay: the whitening is the embedding, each conv group a layer
    no_timm = "timm has no airbench network"
    no_hf = "an airbench CNN"
    no_pretrain = "a convolutional network has no patch tokens to hide"

    def __init__(self, widths=(64, 256, 256), width_mult: float = 1.0, in_chans: int = 3, num_classes: int = 10,
                 img_size: int = 32, scale: float = 1 / 9, bn_momentum: float = 0.4, whiten_eps: float = 5e-4,
                 whiten_from_data: bool = True, drop_rate: float = 0.0):
        super().__init__()
        if not widths or width_mult <= 0:
            raise VitlabError(f"widths {widths} must be non-empty and width_mult {width_mult} > 0")
        self.num_classes = num_classes
        self.img_size = img_size
        self.global_pool = "max"
        self.scale = scale
        self.stem = WhitenStem(in_chans, scaled_widths(widths, width_mult), bn_momentum, whiten_eps,
                               from_data=whiten_from_data)
        self.num_features = self.stem.num_features
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes, bias=False) if num_classes > 0 else nn.Identity()

    def init_from_data(self, images: torch.Tensor) -> bool:
        """Set the whitening filters from normalised (B, C, H, W) training images (a few thousand suffice); False
        when the model trains its filters instead (``whiten_from_data=False``)."""
        return self.stem.init_from_data(images)

    def freeze_stem(self) -> bool:
        return self.stem.freeze_stem()

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new untrained head for num_classes (0: none); the pooling is always the maximum."""
        if global_pool not in (None, "max"):
            raise VitlabError(f"global_pool {global_pool!r} is not valid for {type(self).__name__}; accepted: 'max'")
        self.num_classes = num_classes
        device = self.stem.whiten.weight.device
        self.head = nn.Linear(self.num_features, num_classes, bias=False, device=device) \
            if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, num_features, h, w) feature map."""
        return self.stem(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, C), the maximum over positions."""
        return x.amax(dim=(2, 3))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x) * self.scale
