"""How an image becomes a model's input (``Preprocess``), and its two executors: ``eval_view`` on uint8 tensors
here, ``decode.fit_image`` on Pillow images as files are decoded."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import VitlabError

CROP_MODES = ("center", "squash")  # the rules vitlab applies
# timm's rules vitlab records (a model's pretrained_cfg, its exports) but does not apply: 'border' (DeepSeek's
# towers), the longer side resized to the size and the rest padded with the mean colour
RECORDED_CROP_MODES = ("border",)
CROP_OFFSETS = ("round", "floor")  # torchvision's CenterCrop (timm), transformers' center_crop
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")  # Pillow's filters
TENSOR_INTERPOLATIONS = ("bicubic", "bilinear", "nearest")  # the ones eval_view computes on tensors
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
        raise VitlabError(f"size must be a positive int or a (height, width) pair of them, got {size!r}")
    return int(size[0]), int(size[1])


def _check_rule(crop_mode: Any, crop_pct: Any, interpolation: Any, applied: bool = True) -> None:
    """VitlabError for a rule vitlab cannot apply (``applied=False``: cannot record; timm's 'border' it records)."""
    if crop_mode not in CROP_MODES and (applied or crop_mode not in RECORDED_CROP_MODES):
        what = (" (timm's: the longer side resized, the rest padded with the mean colour)"
                if crop_mode in RECORDED_CROP_MODES else "")
        raise VitlabError(f"crop_mode {crop_mode!r}{what} is not one vitlab applies; accepted: {', '.join(CROP_MODES)}")
    if isinstance(crop_pct, bool) or not isinstance(crop_pct, (int, float)) or not 0 < crop_pct <= 1:
        raise VitlabError(f"crop_pct must be a number in (0, 1], got {crop_pct!r}")
    if interpolation not in INTERPOLATIONS:
        raise VitlabError(f"interpolation {interpolation!r} is not one vitlab applies; accepted: "
                          f"{', '.join(INTERPOLATIONS)}")


@dataclass(frozen=True)
class Preprocess:
    """How an image of any size becomes a model's (C, H, W) input, as timm's pretrained_cfg says it.

    ``squash``: the whole image resized to floor(size / crop_pct) (aspect not kept), then the centre ``size``
    (crop_pct 1: resized to exactly ``size``, as transformers' ViT processor). ``center``: the shorter side
    resized to floor(size / crop_pct), aspect kept (timm's ``Resize(int)``; for a non-square size timm's
    ResizeKeepRatio), then the centre ``size``, its top-left corner at round((H - h) / 2) (``crop_offset``
    round: torchvision's, timm's) or floor((H - h) / 2) (floor: transformers'). Pixels are resampled with
    ``interpolation`` (antialiased, as Pillow), then scaled to [0, 1] and normalised by ``mean`` and ``std``.
    A model carries one in its pretrained_cfg (``from_cfg``/``to_cfg``), a run records the one it applied, the
    exports write it (interop: timm's pretrained_cfg, transformers' preprocessor_config.json, preprocess.json).
    """

    size: tuple[int, int]
    crop_mode: str = "squash"
    crop_pct: float = 1.0
    interpolation: str = "bicubic"
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    crop_offset: str = "round"

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _pair(tuple(self.size) if isinstance(self.size, list) else self.size))
        _check_rule(self.crop_mode, self.crop_pct, self.interpolation, applied=False)
        if self.crop_offset not in CROP_OFFSETS:
            raise VitlabError(f"crop_offset {self.crop_offset!r} is not one vitlab applies; accepted: "
                             f"{', '.join(CROP_OFFSETS)}")
        object.__setattr__(self, "crop_pct", float(self.crop_pct))
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))

    # the reader and the writer of a pretrained_cfg (timm's keys; vitlab's model folders and runs hold the same)
    @classmethod
    def from_cfg(cls, cfg: dict[str, Any]) -> Preprocess:
        """A model's preprocessing from its pretrained_cfg; keys it lacks are what vitlab's training applies
        (squash, crop_pct 1, bicubic), which older vitlab folders did without recording it."""
        return cls(size=tuple(cfg["input_size"][-2:]), crop_mode=cfg.get("crop_mode") or "squash",
                   crop_pct=cfg.get("crop_pct") or 1.0, interpolation=cfg.get("interpolation") or "bicubic",
                   mean=tuple(cfg.get("mean") or IMAGENET_MEAN), std=tuple(cfg.get("std") or IMAGENET_STD),
                   crop_offset=cfg.get("crop_offset") or "round")

    def to_cfg(self) -> dict[str, Any]:
        """The pretrained_cfg keys that say this preprocessing (input_size without its channels)."""
        return {"crop_mode": self.crop_mode, "crop_pct": self.crop_pct, "interpolation": self.interpolation,
                "mean": list(self.mean), "std": list(self.std), "crop_offset": self.crop_offset}

    def at(self, size: int | tuple[int, int]) -> Preprocess:
        """The same rule for another input size."""
        return replace(self, size=_pair(size))

    @property
    def fit(self) -> str:
        """The resize rule as a data store's key and a decoder's argument ("squash" is vitlab's training rule)."""
        if (self.crop_mode, self.crop_pct, self.interpolation) == ("squash", 1.0, "bicubic"):
            return "squash"
        floor = "/floor" if self.crop_offset == "floor" else ""
        return f"{self.crop_mode}/{self.crop_pct!r}/{self.interpolation}{floor}"

    def describe(self) -> str:
        h, w = self.size
        sh, sw = scale_size(self.size, self.crop_pct)
        if self.crop_mode == "border":
            return (f"the longer side resized to fit {h}x{w} ({self.interpolation}), the rest padded with the mean "
                    "colour (timm's rule, which vitlab records and does not apply)")
        how = (f"the whole image resized to {sh}x{sw}" if self.crop_mode == "squash" else
               f"the shorter side resized to {sh}" if sh == sw else f"resized to cover {sh}x{sw}, aspect kept")
        crop = f", the centre {h}x{w} kept" if (sh, sw) != (h, w) or self.crop_mode == "center" else ""
        crop += " (offsets rounded down)" if crop and self.crop_offset == "floor" else ""
        return f"{how} ({self.interpolation}){crop}"

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H0, W0) -> uint8 (B, C, *size), on the images' device (Pillow's filters, in float)."""
        return eval_view(images, self.size, self.crop_pct, self.interpolation, self.crop_mode, self.crop_offset)


def parse_fit(fit: str) -> tuple[str, float, str, str]:
    """(crop_mode, crop_pct, interpolation, crop_offset) of a ``Preprocess.fit`` string."""
    if fit == "squash":
        return "squash", 1.0, "bicubic", "round"
    mode, pct, interpolation, *offset = fit.split("/")
    _check_rule(mode, float(pct), interpolation)
    return mode, float(pct), interpolation, offset[0] if offset else "round"


def scale_size(size: tuple[int, int], crop_pct: float | None) -> tuple[int, int]:
    """The size the crop is taken from: floor(size / crop_pct), as timm computes it."""
    if not crop_pct or crop_pct >= 1:
        return tuple(size)
    return math.floor(size[0] / crop_pct), math.floor(size[1] / crop_pct)


def resized_size(image: tuple[int, int], size: tuple[int, int], crop_mode: str, crop_pct: float) -> tuple[int, int]:
    """(H, W) an image of (H0, W0) is resized to before the centre crop of ``size`` (torchvision's and timm's
    arithmetic: the long side int(scale x long / short) for a square size; ResizeKeepRatio otherwise)."""
    sh, sw = scale_size(size, crop_pct)
    if crop_mode == "squash":
        return sh, sw
    hi, wi = image
    if sh == sw:
        if hi <= wi:
            return sh, int(sh * wi / hi)
        return int(sw * hi / wi), sw
    ratio = min(hi / sh, wi / sw)
    return round(hi / ratio), round(wi / ratio)


def crop_offsets(image: tuple[int, int], size: tuple[int, int], rule: str = "round") -> tuple[int, int]:
    """(top, left) of the centre (h, w) window of an (H, W) image: torchvision's CenterCrop (round, half to even)
    or transformers' center_crop (floor)."""
    if rule == "floor":
        return (image[0] - size[0]) // 2, (image[1] - size[1]) // 2
    return int(round((image[0] - size[0]) / 2.0)), int(round((image[1] - size[1]) / 2.0))


def eval_view(images: torch.Tensor, size: int | tuple[int, int], crop_pct: float = 0.875,
              interpolation: str = "bicubic", crop_mode: str = "center", crop_offset: str = "round") -> torch.Tensor:
    """uint8 (B, C, H, W) -> uint8 (B, C, *size): resized as ``Preprocess`` says, then the centre crop.

    The default is timm's eval transform: the shorter side resized to floor(size / crop_pct) (256 for 224 at
    0.875), bicubic (antialiased when reducing), the centre kept. With crop_pct=1 and stored images of the
    training size this is the identity. Works on any device; give it a batch at a time.
    """
    h, w = _pair(size)
    _check_rule(crop_mode, crop_pct, interpolation)
    if interpolation not in TENSOR_INTERPOLATIONS:
        raise VitlabError(f"interpolation {interpolation!r} is applied to image files only; accepted on decoded "
                          f"images: {', '.join(TENSOR_INTERPOLATIONS)}")
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise TypeError(f"expected a uint8 (B, C, H, W) image batch, got {images.dtype} {tuple(images.shape)}")
    hi, wi = images.shape[-2:]
    out = resized_size((hi, wi), (h, w), crop_mode, crop_pct)
    x = images
    if tuple(out) != (hi, wi) and len(images):
        mode = "nearest-exact" if interpolation == "nearest" else interpolation
        y = F.interpolate(images.float(), size=out, mode=mode, **({} if mode == "nearest-exact" else
                                                                     {"align_corners": False, "antialias": True}))
        x = y.round_().clamp_(0, 255).to(torch.uint8)
    ho, wo = x.shape[-2:]
    if h > ho or w > wo:
        raise VitlabError(f"cannot crop {h}x{w} from images resized to {ho}x{wo}")
    top, left = crop_offsets((ho, wo), (h, w), crop_offset)
    return x[:, :, top:top + h, left:left + w].contiguous()


def stratified_subset(labels: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """Sorted indices of ``fraction`` of the images, the same share of every class.

    Each class's images are shuffled once by ``seed`` and the first round(fraction x count) kept
    (at least one), so smaller fractions are subsets of larger ones and every run asking for the
    same fraction gets the same images, whatever its own seed.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise VitlabError(f"fraction must be a number in (0, 1], got {fraction!r}")
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
