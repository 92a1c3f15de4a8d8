"""The evaluation view of stored images: resize and centre crop, as timm and DeiT evaluate."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
        raise ValueError(f"size must be a positive int or a (height, width) pair of them, got {size!r}")
    return int(size[0]), int(size[1])


def eval_view(images: torch.Tensor, size: int | tuple[int, int], crop_pct: float = 0.875) -> torch.Tensor:
    """uint8 (B, C, H, W) -> uint8 (B, C, *size): shorter side resized to size / crop_pct, then the centre crop.

    As timm's eval transform: the scale is floor(size / crop_pct) (256 for 224 at 0.875), bicubic
    (antialiased when reducing); a (h, w) size with unequal scales resizes to those exactly. With
    crop_pct=1 and stored images of the training size this is the identity. Works on any device;
    give it a batch at a time.
    """
    h, w = _pair(size)
    if isinstance(crop_pct, bool) or not isinstance(crop_pct, (int, float)) or not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct must be a number in (0, 1], got {crop_pct!r}")
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise TypeError(f"expected a uint8 (B, C, H, W) image batch, got {images.dtype} {tuple(images.shape)}")
    hi, wi = images.shape[-2:]
    scale = (math.floor(h / crop_pct), math.floor(w / crop_pct))
    if scale[0] == scale[1]:  # shorter side to the scale, aspect kept (torchvision's Resize(int))
        short, long = (hi, wi) if hi <= wi else (wi, hi)
        new_long = int(scale[0] * long / short)
        out = (scale[0], new_long) if hi <= wi else (new_long, scale[0])
    else:
        out = scale
    x = images
    if tuple(out) != (hi, wi) and len(images):
        y = F.interpolate(images.float(), size=out, mode="bicubic", align_corners=False, antialias=True)
        x = y.round_().clamp_(0, 255).to(torch.uint8)
    ho, wo = x.shape[-2:]
    if h > ho or w > wo:
        raise ValueError(f"cannot crop {h}x{w} from images resized to {ho}x{wo}")
    top, left = int(round((ho - h) / 2.0)), int(round((wo - w) / 2.0))
    return x[:, :, top:top + h, left:left + w].contiguous()


def stratified_subset(labels: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """Sorted indices of ``fraction`` of the images, the same share of every class.

    Each class's images are shuffled once by ``seed`` and the first round(fraction x count) kept
    (at least one), so smaller fractions are subsets of larger ones and every run asking for the
    same fraction gets the same images, whatever its own seed.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    labels = torch.as_tensor(labels)
    if fraction == 1:
        return torch.arange(len(labels))
    g = torch.Generator().manual_seed(seed)
    keep = []
    for c in torch.unique(labels):
        members = torch.nonzero(labels == c).flatten()
        order = members[torch.randperm(len(members), generator=g)]
        keep.append(order[:max(1, round(fraction * len(members)))])
    return torch.cat(keep).sort().values


def balanced_order(labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A permutation of the images whose every prefix holds the classes in (nearly) equal shares.

    Each class's images are shuffled by ``seed`` and the classes then take turns, so "the first N
    images" of a split sorted by class (as image folders and archives are) are not all of one class.
    """
    labels = torch.as_tensor(labels)
    g = torch.Generator().manual_seed(seed)
    classes = torch.unique(labels)
    rank = torch.empty(len(labels), dtype=torch.long)
    for c in classes:
        members = torch.nonzero(labels == c).flatten()
        rank[members[torch.randperm(len(members), generator=g)]] = torch.arange(len(members))
    position = torch.searchsorted(classes, labels)
    return torch.argsort(rank * len(classes) + position)
