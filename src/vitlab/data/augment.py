"""Batched DeiT-style training augmentation on uint8 image tensors, on whatever device the batch lives on.

Pipeline (DeiT/timm order): crop -> horizontal flip -> TrivialAugment/RandAugment op(s) -> float & normalise ->
random erasing -> mixup/cutmix + label smoothing on the whole batch.

Every stage works on the whole batch with a handful of tensor ops; no per-image Python. All randomness comes from
torch's global RNG: small per-image parameters are drawn on the CPU generator (so the device never has to sync
to decide control flow), bulk noise (random-erasing pixels) on the images' device generator. ``torch.manual_seed``
therefore makes a forward pass reproducible, and saving/restoring torch's RNG state resumes it exactly.

Why hand-written rather than ``kornia.augmentation.auto``: kornia 0.9's ``TrivialAugment``/``RandAugment`` pick ONE
op per forward call for the whole batch (TrivialAugment is meant to pick one per image), run at ~2k CIFAR img/s
on a 2-core CPU, and ``RandAugment``'s colour op raises on 1-channel input. Here each image draws its own op and
images are grouped by op, so a batch costs two gathers, one ``grid_sample`` for all geometric ops and a few small
kernels per colour op.

Small per-image parameter arithmetic (box sizes, angles) is done in numpy on torch-drawn uniforms: torch runs
sqrt/exp/cos and batched matmuls multi-threaded even on 256-element CPU tensors, and on a busy 2-core machine each
such call can stall ~10 ms waiting for the second thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import Tensor

from ..devices import to_device
from ..errors import VitlabError
from ..settings import Settings

__all__ = [
    "AUTO_AUGMENT_OPS",
    "AugmentConfig",
    "alternating_flip",
    "BatchAugment",
    "apply_augment_ops",
    "cutmix_box",
    "erase_boxes",
    "mix_batch",
    "normalize",
    "pad_crop_flip",
    "resized_crop_flip",
    "smooth_one_hot",
]

Crop = Literal["pad", "rrc", "none"]
PadMode = Literal["reflect", "zero"]
AutoAugment = Literal["trivial", "rand", "none"]
CROP_MODES, PAD_MODES, AUTO_AUGMENT_MODES = get_args(Crop), get_args(PadMode), get_args(AutoAugment)
RRC_SCALE_ACCEPTED = "a pair lo, hi with 0 < lo <= hi <= 1"
MIX_MODES = ("mixup", "cutmix")

# The op set shared by TrivialAugment and RandAugment. The geometric ops (indices 1-5) are kept contiguous so that,
# once a batch is sorted by op, all of them are warped by a single grid_sample.
AUTO_AUGMENT_OPS = (
    "identity",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
    "rotate",
    "brightness",
    "color",
    "contrast",
    "sharpness",
    "posterize",
    "solarize",
    "autocontrast",
    "equalize",
)
_OP = {name: i for i, name in enumerate(AUTO_AUGMENT_OPS)}
_GEOMETRIC = range(_OP["shear_x"], _OP["rotate"] + 1)
_ENHANCE = range(_OP["brightness"], _OP["sharpness"] + 1)

# Magnitude at full strength (magnitude 1.0); an op's strength is magnitude * this. Signed ops (geometry and the
# enhance factors 1 +- x) get a random sign per image. Translation is a fraction of the image side so that the same
# table suits 8x8 and 224x224 images; posterize removes up to this many bits; solarize's threshold goes 256 -> 0.
_TRIVIAL_WIDE = {"shear": 0.99, "translate": 0.45, "rotate": 135.0, "enhance": 0.99, "posterize": 6.0, "solarize": 1.0}
_RAND_TIMM = {"shear": 0.3, "translate": 0.45, "rotate": 30.0, "enhance": 0.9, "posterize": 4.0, "solarize": 1.0}
_GRAY_WEIGHTS = (0.299, 0.587, 0.114)


class AugmentConfig(Settings):
    """Settings of the batched DeiT-style augmentation pipeline, checked on construction and on assignment."""

    crop: Crop = Field("pad", description="pad (random crop after padding), rrc (random resized crop) or none")
    padding: int = Field(4, ge=0, description="padding of the random crop (crop=pad)")
    rrc_scale: tuple[float, float] = Field((0.35, 1.0), description="area range of the random resized crop",
                                           json_schema_extra={"accepted": RRC_SCALE_ACCEPTED})
    hflip: bool = Field(True, description="random horizontal flips")
    alternating_flip: bool = Field(False, description="with hflip: mirror a fixed half of the images in even "
                                   "epochs and the other half in odd ones instead of at random (airbench)")
    auto_augment: AutoAugment = Field("trivial", description="trivial (TrivialAugment), rand (RandAugment) or none")
    ra_num_ops: int = Field(2, ge=1, description="RandAugment ops per image")
    ra_magnitude: int = Field(9, ge=0, le=10, description="RandAugment magnitude (timm scale, 10 = full strength)")
    random_erasing: float = Field(0.25, ge=0, le=1, description="random erasing probability per image")
    mixup: float = Field(0.8, ge=0, description="mixup alpha (0 = off)")
    cutmix: float = Field(1.0, ge=0, description="cutmix alpha (0 = off)")
    mix_prob: float = Field(1.0, ge=0, le=1, description="probability of mixup/cutmix for a batch")
    switch_prob: float = Field(0.5, ge=0, le=1, description="probability of cutmix instead of mixup when both are on")
    label_smoothing: float = Field(0.1, ge=0, lt=1, description="label smoothing")
    repeated_aug: int = Field(1, ge=1, description="repeated augmentation count (DeiT: 3; 1 = off)")
    pad_mode: PadMode = Field("reflect", description="padding of crop=pad: reflect or zero")

    @field_validator("rrc_scale")
    @classmethod
    def _ordered(cls, scale: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < scale[0] <= scale[1] <= 1.0:
            raise VitlabError(f"rrc_scale={scale!r} is not valid; accepted: {RRC_SCALE_ACCEPTED}")
        return scale

# ----------------------------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------------------------


def smooth_one_hot(labels: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """Label-smoothed one-hot targets (B, K): off = smoothing / K, on = 1 - smoothing + off."""
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    out = torch.full((labels.shape[0], num_classes), off, dtype=torch.float32, device=labels.device)
    return out.scatter_(1, labels.long().view(-1, 1), on)


# ----------------------------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------------------------


def _norm_affine(mean: Sequence[float], std: Sequence[float], device: torch.device) -> tuple[Tensor, Tensor]:
    """(scale, shift), each (C, 1, 1), such that x_0_255 * scale + shift == (x / 255 - mean) / std."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=device).view(-1, 1, 1)
    return 1.0 / (255.0 * s), -m / s


def _normalize_0_255_(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """Normalise a float (B, C, H, W) batch on the 0..255 scale in place."""
    return x.mul_(scale).add_(shift)


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 (B, C, H, W) -> float32 (x / 255 - mean) / std (the eval path)."""
    _check_uint8(images)
    scale, shift = _norm_affine(mean, std, images.device)
    return _normalize_0_255_(images.float(), scale, shift)  # .float() of uint8 is a new tensor


def _check_uint8(images: Tensor) -> None:
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise TypeError(f"expected a uint8 (B, C, H, W) image batch, got {images.dtype} {tuple(images.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Crops and flip
# ----------------------------------------------------------------------------------------------------------------


def _reflect(idx: Tensor, n: int) -> Tensor:
    """Map indices in any range into [0, n) by mirror reflection without repeating the edge (numpy 'reflect')."""
    if n == 1:
        return torch.zeros_like(idx)
    period = 2 * (n - 1)
    idx = idx.abs() % period
    return torch.where(idx >= n, period - idx, idx)


def _affine_grid(theta: Tensor, h: int, w: int) -> Tensor:
    """F.affine_grid(theta, (N, C, h, w), align_corners=False) by broadcasting: (N, h, w, 2).

    Same values; avoids affine_grid's batched matmul, which MKL runs multi-threaded however small the batch.
    """
    n, dev = theta.shape[0], theta.device
    u = (torch.arange(w, device=dev, dtype=theta.dtype) * 2 + 1) / w - 1  # pixel centres in [-1, 1]
    v = (torch.arange(h, device=dev, dtype=theta.dtype) * 2 + 1) / h - 1
    along_x = theta[:, :, 0].view(n, 1, 1, 2) * u.view(1, 1, w, 1)  # (N, 1, w, 2)
    along_y = theta[:, :, 1].view(n, 1, 1, 2) * v.view(1, h, 1, 1) + theta[:, :, 2].view(n, 1, 1, 2)  # (N, h, 1, 2)
    return along_x + along_y


def pad_crop_flip(
    images: Tensor,
    top: Tensor,
    left: Tensor,
    flip: Tensor,
    padding: int,
    size: tuple[int, int],
    pad_mode: str = "reflect",
) -> Tensor:
    """Crop size=(h, w) at (top, left) of each padded image, mirrored where flip; one gather, dtype kept.

    top/left (B,) are offsets into the image padded by `padding` on every side (0..H+2p-h), so top=left=padding
    and h, w = H, W is the identity crop.
    """
    b, c, hi, wi = images.shape
    h, w = size
    dev = images.device
    rows = to_device(top, dev).view(b, 1) - padding + torch.arange(h, device=dev)  # (B, h) source rows
    cols = to_device(left, dev).view(b, 1) - padding + torch.arange(w, device=dev)  # (B, w) source cols
    cols = torch.where(to_device(flip, dev).view(b, 1), cols.flip(1), cols)  # mirroring the output = reversed columns
    if pad_mode == "reflect":
        rows, cols, valid = _reflect(rows, hi), _reflect(cols, wi), None
    elif pad_mode == "zero":
        valid = ((rows >= 0) & (rows < hi)).view(b, 1, h, 1) & ((cols >= 0) & (cols < wi)).view(b, 1, 1, w)
        rows, cols = rows.clamp(0, hi - 1), cols.clamp(0, wi - 1)
    else:
        raise VitlabError(f"pad_mode={pad_mode!r} is invalid; expected one of {PAD_MODES}")
    index = (rows.view(b, h, 1) * wi + cols.view(b, 1, w)).view(b, 1, h * w).expand(b, c, h * w)
    out = images.reshape(b, c, hi * wi).gather(2, index).view(b, c, h, w)
    if valid is not None:
        out = out.masked_fill_(~valid, 0)
    return out


def alternating_flip(images: Tensor, index: Tensor, epoch: int, seed: int = 0) -> Tensor:
    """Mirror image ``index[i]`` of the training set in epoch ``epoch`` where its flip bit says: a hash of
    (index, seed) picks half of the images for the even epochs, the others are mirrored in the odd ones, so
    every image is seen mirrored every other epoch (airbench's alternating flip). Same dtype, a new tensor."""
    idx = to_device(index, images.device).long()
    bit = (((idx * 2654435761 + seed * 40503 + 12345) % 4294967296) >> 16) & 1  # Knuth's multiplicative hash
    flip = (bit ^ (epoch % 2)).bool().view(-1, *([1] * (images.dim() - 1)))
    return torch.where(flip, images.flip(-1), images)


def resized_crop_flip(images: Tensor, boxes: Tensor, flip: Tensor, size: tuple[int, int]) -> Tensor:
    """Bilinearly resample box (B, 4) = (top, left, height, width) in pixels of each image to size, mirrored where flip.

    Returns float32 on the 0..255 scale.
    """
    b, c, hi, wi = images.shape
    top, left, bh, bw = boxes.cpu().float().unbind(1)  # (B,) each
    sx = (bw / wi) * torch.where(flip.bool().cpu(), -1.0, 1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0] = sx
    theta[:, 0, 2] = (2 * left + bw) / wi - 1  # box centre in normalised coords
    theta[:, 1, 1] = bh / hi
    theta[:, 1, 2] = (2 * top + bh) / hi - 1
    x = images.float()
    grid = _affine_grid(to_device(theta, x.device), *size)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _random_boxes(
    b: int, h: int, w: int, area_frac: tuple[float, float], log_ratio: tuple[float, float], strict: bool
) -> tuple[np.ndarray, np.ndarray]:
    """timm-style boxes (B, 4) = (top, left, height, width) in pixels and whether one was found (B,).

    Per image, up to 10 (area fraction, log aspect ratio) draws; the first box that fits (strictly smaller than the
    image when strict) wins, at a uniform position. Draws come from torch's global RNG; the arithmetic is numpy,
    because torch runs sqrt/exp on even tiny CPU tensors multi-threaded (~10 ms per call on a busy 2-core machine).
    """
    u = torch.rand(b, 10, 2, dtype=torch.float64).numpy()
    area = h * w * (area_frac[0] + (area_frac[1] - area_frac[0]) * u[..., 0])
    aspect = np.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[..., 1])  # width / height
    bw, bh = np.round(np.sqrt(area * aspect)), np.round(np.sqrt(area / aspect))
    fits = ((bw < w) & (bh < h)) if strict else ((bw <= w) & (bh <= h))
    fits &= (bw > 0) & (bh > 0)
    first = fits.argmax(1)  # first fitting attempt (0 if none)
    bh, bw = bh[np.arange(b), first], bw[np.arange(b), first]
    pos = torch.rand(b, 2, dtype=torch.float64).numpy()
    top, left = np.floor(pos[:, 0] * (h - bh + 1)), np.floor(pos[:, 1] * (w - bw + 1))
    return np.stack([top, left, bh, bw], 1), fits.any(1)


def _sample_rrc_boxes(b: int, hi: int, wi: int, scale: tuple[float, float]) -> Tensor:
    """timm RandomResizedCrop boxes (B, 4) = (top, left, h, w) (CPU float): 10 tries per image, else a centre crop."""
    ratio = (3.0 / 4.0, 4.0 / 3.0)
    boxes, found = _random_boxes(b, hi, wi, scale, (math.log(ratio[0]), math.log(ratio[1])), strict=False)
    in_ratio = wi / hi  # fallback: the whole image, cropped to the allowed ratio range
    if in_ratio < ratio[0]:
        fw, fh = wi, round(wi / ratio[0])
    elif in_ratio > ratio[1]:
        fw, fh = round(hi * ratio[1]), hi
    else:
        fw, fh = wi, hi
    boxes[~found] = [(hi - fh) // 2, (wi - fw) // 2, fh, fw]
    return torch.from_numpy(boxes).float()


# ----------------------------------------------------------------------------------------------------------------
# TrivialAugment / RandAugment ops (float images on the 0..255 scale)
# ----------------------------------------------------------------------------------------------------------------


def _gray(x: Tensor) -> Tensor:
    """Luma (N, 1, H, W) of RGB images; a 1-channel (or non-RGB) image's channel mean."""
    if x.shape[1] == 3:
        r, g, b = x.unbind(1)
        return (_GRAY_WEIGHTS[0] * r + _GRAY_WEIGHTS[1] * g + _GRAY_WEIGHTS[2] * b).unsqueeze(1)
    return x.mean(1, keepdim=True)


def _blend(x: Tensor, degenerate: Tensor, factor: Tensor) -> Tensor:
    """PIL ImageEnhance blend: degenerate + factor * (x - degenerate), clamped to 0..255."""
    return torch.lerp(degenerate.expand_as(x), x, factor).clamp_(0, 255)


def _color(x: Tensor, factor: Tensor) -> Tensor:
    """Saturation: blend with the grayscale image (identity for 1-channel images)."""
    if x.shape[1] != 3:
        return x
    return _blend(x, _gray(x), factor)


def _contrast(x: Tensor, factor: Tensor) -> Tensor:
    """Blend with the mean grey level of each image."""
    return _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), factor)


def _sharpness(x: Tensor, factor: Tensor) -> Tensor:
    """PIL sharpness: blend with a copy smoothed by [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 (border pixels kept)."""
    if x.shape[-2] < 3 or x.shape[-1] < 3:
        return x
    rows = x[..., :-2, :] + x[..., 1:-1, :] + x[..., 2:, :]  # (N, C, H-2, W) vertical 3-sums
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]  # (N, C, H-2, W-2) 3x3 sums (separable; faster than conv)
    degenerate = x.clone()
    degenerate[..., 1:-1, 1:-1] = box.add_(x[..., 1:-1, 1:-1], alpha=4.0).div_(13.0).round_()
    return _blend(x, degenerate, factor)


def _posterize(x: Tensor, step: Tensor) -> Tensor:
    """Keep the top bits: floor(x / step) * step with step = 2 ** (8 - bits)."""
    return torch.floor(x.round() / step).mul_(step)


def _solarize(x: Tensor, threshold: Tensor) -> Tensor:
    """Invert pixels at or above threshold."""
    return torch.where(x >= threshold, 255.0 - x, x)


def _autocontrast(x: Tensor) -> Tensor:
    """Stretch each channel of each image to the full 0..255 range."""
    lo = x.amin((2, 3), keepdim=True)
    hi = x.amax((2, 3), keepdim=True)
    flat = hi <= lo
    scale = torch.where(flat, 1.0, 255.0 / (hi - lo))
    lo = torch.where(flat, 0.0, lo)
    return ((x - lo) * scale).clamp_(0, 255)


def _equalize(x: Tensor) -> Tensor:
    """PIL/torchvision histogram equalisation of each channel of each image (identity when it would be degenerate)."""
    n, c, h, w = x.shape
    v = x.round().clamp_(0, 255).long().view(n * c, h * w)
    hist = torch.zeros(n * c, 256, device=x.device).scatter_add_(1, v, torch.ones(1, 1, device=x.device).expand_as(v))
    top_count = hist.gather(1, v.amax(1, keepdim=True))  # count of the highest value present
    step = torch.div(h * w - top_count, 255, rounding_mode="floor")  # (N*C, 1)
    lut = torch.div(
        hist.cumsum(1) + torch.div(step, 2, rounding_mode="floor"), step.clamp(min=1), rounding_mode="floor"
    )
    lut = F.pad(lut, (1, 0))[:, :-1].clamp_(0, 255)
    out = torch.where(step > 0, lut.gather(1, v), v.float())
    return out.view(n, c, h, w)


def _affine_theta(op: np.ndarray, value: np.ndarray, h: int, w: int) -> Tensor:
    """Per-image (N, 2, 3) output->input maps in normalised coords for the geometric ops (CPU float32).

    Each map is built in pixel coords centred on the image, then rescaled to normalised coords (u = 2x/W, v = 2y/H).
    """
    is_rot = op == _OP["rotate"]
    rad = np.deg2rad(np.where(is_rot, value, 0.0))
    cos, sin = np.cos(rad), np.sin(rad)
    shear_x = np.where(op == _OP["shear_x"], value, 0.0)
    shear_y = np.where(op == _OP["shear_y"], value, 0.0)
    shift_x = np.where(op == _OP["translate_x"], 2.0 * value, 0.0)  # value = fraction of the width
    shift_y = np.where(op == _OP["translate_y"], 2.0 * value, 0.0)
    row0 = np.stack([cos, (shear_x - sin) * (h / w), shift_x], 1)
    row1 = np.stack([(shear_y + sin) * (w / h), cos, shift_y], 1)
    return torch.from_numpy(np.stack([row0, row1], 1)).float()


def _op_max_values(ranges: dict[str, float]) -> np.ndarray:
    """Full-strength parameter of each op in AUTO_AUGMENT_OPS order."""
    key = {"shear_x": "shear", "shear_y": "shear", "translate_x": "translate", "translate_y": "translate"}
    key.update({name: "enhance" for name in ("brightness", "color", "contrast", "sharpness")})
    key.update({name: name for name in ("rotate", "posterize", "solarize")})
    return np.array([ranges[key[name]] if name in key else 0.0 for name in AUTO_AUGMENT_OPS])


def _op_values(op: Tensor, magnitude: Tensor, sign: Tensor, max_values: np.ndarray) -> Tensor:
    """Per-image op parameter (B,) (CPU float32) from magnitude in [0, 1] and sign in {-1, 1}.

    Geometric ops: degrees / shear / translate fraction; enhance ops: factor 1 +- m; posterize: the quantisation
    step 2 ** bits_removed; solarize: the threshold 256 * (1 - m); other ops: unused.
    """
    op_np = op.numpy()
    strength = magnitude.double().numpy() * max_values[op_np]
    signed = sign.double().numpy() * strength
    is_enhance = (op_np >= _ENHANCE[0]) & (op_np <= _ENHANCE[-1])
    value = np.where(is_enhance, 1.0 + signed, signed)
    value = np.where(op_np == _OP["posterize"], np.exp2(np.round(strength)), value)
    value = np.where(op_np == _OP["solarize"], 256.0 * (1.0 - strength), value)
    return torch.from_numpy(value).float()


def apply_augment_ops(x: Tensor, op: Tensor, value: Tensor, fill: Tensor) -> Tensor:
    """Apply AUTO_AUGMENT_OPS[op[i]] with parameter value[i] to image i of a float 0..255 batch (B, C, H, W).

    op, value: (B,) CPU tensors (see `_op_values`); fill: (1, C, 1, 1) colour for pixels warped in from outside.
    Images are sorted by op so each op runs once on a contiguous slice; returns a new tensor in the input order.
    """
    b, c, h, w = x.shape
    order = torch.argsort(op, stable=True)
    op, value = op[order], value[order]
    counts = torch.bincount(op, minlength=len(AUTO_AUGMENT_OPS)).tolist()
    starts = [0]
    for k in counts:
        starts.append(starts[-1] + k)
    if counts[_OP["identity"]] == b:
        return x
    xs = x.index_select(0, to_device(order, x.device))  # (B, C, H, W) grouped by op
    value_dev = to_device(value, x.device).view(b, 1, 1, 1)

    g0, g1 = starts[_GEOMETRIC[0]], starts[_GEOMETRIC[-1] + 1]
    if g1 > g0:  # all geometric ops in one warp; out-of-image pixels get `fill`
        theta = to_device(_affine_theta(op[g0:g1].numpy(), value[g0:g1].double().numpy(), h, w), x.device)
        grid = _affine_grid(theta, h, w)
        warped = F.grid_sample(xs[g0:g1] - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        xs[g0:g1] = warped.add_(fill)

    for name, fn in (
        ("brightness", lambda t, v: (t * v).clamp_(0, 255)),
        ("color", _color),
        ("contrast", _contrast),
        ("sharpness", _sharpness),
        ("posterize", _posterize),
        ("solarize", _solarize),
        ("autocontrast", lambda t, v: _autocontrast(t)),
        ("equalize", lambda t, v: _equalize(t)),
    ):
        i0, i1 = starts[_OP[name]], starts[_OP[name] + 1]
        if i1 > i0:
            xs[i0:i1] = fn(xs[i0:i1], value_dev[i0:i1])
    return xs.index_select(0, to_device(torch.argsort(order), x.device))  # back to the input order


# ----------------------------------------------------------------------------------------------------------------
# Random erasing
# ----------------------------------------------------------------------------------------------------------------


def _sample_erase_boxes(b: int, h: int, w: int, p: float) -> tuple[Tensor, Tensor]:
    """timm RandomErasing boxes (B, 4) = (top, left, h, w) and which images to erase (B,) bool (CPU)."""
    apply = torch.rand(b) < p
    boxes, found = _random_boxes(b, h, w, (0.02, 1.0 / 3.0), (math.log(0.3), math.log(1.0 / 0.3)), strict=True)
    return torch.from_numpy(boxes).long(), apply & torch.from_numpy(found)


def erase_boxes(x: Tensor, boxes: Tensor, apply: Tensor) -> Tensor:
    """Fill box (top, left, h, w) of each image where apply with per-pixel N(0, 1) noise, in place (timm 'pixel')."""
    idx = apply.nonzero().squeeze(1)
    if idx.numel() == 0:
        return x
    n, (_, c, h, w) = idx.numel(), x.shape
    top, left, bh, bw = to_device(boxes[idx], x.device).unbind(1)  # (n,) each
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    in_rows = (rows >= top.view(n, 1)) & (rows < (top + bh).view(n, 1))  # (n, H)
    in_cols = (cols >= left.view(n, 1)) & (cols < (left + bw).view(n, 1))  # (n, W)
    mask = (in_rows.view(n, 1, h, 1) & in_cols.view(n, 1, 1, w)).expand(n, c, h, w)
    idx_dev = to_device(idx, x.device)
    sub = x.index_select(0, idx_dev)
    noise = torch.randn(sub.shape, dtype=sub.dtype, device=sub.device)
    return x.index_copy_(0, idx_dev, torch.where(mask, noise, sub))


# ----------------------------------------------------------------------------------------------------------------
# Mixup / CutMix (timm Mixup, mode='batch')
# ----------------------------------------------------------------------------------------------------------------


def cutmix_box(h: int, w: int, lam: float) -> tuple[int, int, int, int]:
    """timm rand_bbox: (y0, y1, x0, x1) of a box with sides sqrt(1 - lam) * (h, w) at a random centre, clipped."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(h * ratio), int(w * ratio)
    cy = int(torch.randint(h, ()).item())
    cx = int(torch.randint(w, ()).item())
    y0, y1 = min(max(cy - cut_h // 2, 0), h), min(max(cy + cut_h // 2, 0), h)
    x0, x1 = min(max(cx - cut_w // 2, 0), w), min(max(cx + cut_w // 2, 0), w)
    return y0, y1, x0, x1


def mix_batch(
    images: Tensor,
    targets: Tensor,
    lam: float,
    mode: str,
    box: tuple[int, int, int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Mix each sample with its partner in images.flip(0); returns (images, targets).

    mixup: lam * x + (1 - lam) * partner (a new tensor). cutmix: the partner's box (y0, y1, x0, x1) (random from lam
    if None) is pasted into `images` in place and lam becomes 1 - box area / image area. targets (B, K) are mixed
    with the final lam: lam * t + (1 - lam) * t.flip(0).
    """
    if mode == "mixup":
        images = torch.lerp(images.flip(0), images, lam)  # lam * x + (1 - lam) * x.flip(0)
    elif mode == "cutmix":
        h, w = images.shape[-2:]
        y0, y1, x0, x1 = cutmix_box(h, w, lam) if box is None else box
        images[:, :, y0:y1, x0:x1] = images[:, :, y0:y1, x0:x1].flip(0)  # flip() copies before the write
        lam = 1.0 - (y1 - y0) * (x1 - x0) / float(h * w)
    else:
        raise VitlabError(f"mode={mode!r} is invalid; expected one of {MIX_MODES}")
    return images, torch.lerp(targets.flip(0), targets, lam)


# ----------------------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------------------


class BatchAugment(torch.nn.Module):
    """DeiT-style training augmentation of a whole uint8 batch on its own device."""

    def __init__(
        self,
        cfg: AugmentConfig,
        img_size: tuple[int, int],
        mean: Sequence[float],
        std: Sequence[float],
        num_classes: int,
    ) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise VitlabError(f"mean and std must have the same length, got {len(mean)} and {len(std)}")
        self.cfg = cfg
        self.img_size = (int(img_size[0]), int(img_size[1]))
        self.num_classes = num_classes
        scale, shift = _norm_affine(mean, std, torch.device("cpu"))
        self.register_buffer("norm_scale", scale, persistent=False)  # (C, 1, 1)
        self.register_buffer("norm_shift", shift, persistent=False)  # (C, 1, 1)
        fill = torch.tensor([min(255.0, round(255.0 * m)) for m in mean]).view(1, -1, 1, 1)  # timm: mean colour
        self.register_buffer("fill", fill, persistent=False)
        self.op_max_values = _op_max_values(_TRIVIAL_WIDE if cfg.auto_augment == "trivial" else _RAND_TIMM)

    def extra_repr(self) -> str:
        return f"img_size={self.img_size}, num_classes={self.num_classes}, cfg={self.cfg}"

    def alternate(self, images: Tensor, index: Tensor, epoch: int, seed: int) -> Tensor:
        """The training images ``index`` of epoch ``epoch`` mirrored by ``alternating_flip`` when the config asks
        for alternating flips (``crop_flip`` then draws no random flip); else unchanged."""
        if not (self.cfg.hflip and self.cfg.alternating_flip):
            return images
        return alternating_flip(images, index, epoch, seed)

    def crop_flip(self, images: Tensor) -> Tensor:
        """Random crop (pad / resized / none) and horizontal flip: uint8 (B, C, H, W) -> (B, C, h, w).

        The result stays uint8 except after 'rrc', which resamples and returns float on the 0..255 scale.
        """
        cfg, (h, w) = self.cfg, self.img_size
        b, _, hi, wi = images.shape
        flip = torch.rand(b) < 0.5 if cfg.hflip else torch.zeros(b, dtype=torch.bool)
        if cfg.alternating_flip:  # mirrored already, before the batch was split (``alternate``)
            flip = torch.zeros(b, dtype=torch.bool)
        if cfg.crop == "rrc":
            return resized_crop_flip(images, _sample_rrc_boxes(b, hi, wi, cfg.rrc_scale), flip, (h, w))
        if cfg.crop == "pad":
            p = cfg.padding
            if hi + 2 * p < h or wi + 2 * p < w:
                raise VitlabError(f"crop size {(h, w)} is larger than the padded image {(hi + 2 * p, wi + 2 * p)}")
            top = torch.randint(hi + 2 * p - h + 1, (b,))
            left = torch.randint(wi + 2 * p - w + 1, (b,))
            return pad_crop_flip(images, top, left, flip, p, (h, w), cfg.pad_mode)
        if (hi, wi) != (h, w):
            raise VitlabError(f"crop='none' needs images of img_size {(h, w)}, got {(hi, wi)}")
        if not cfg.hflip:
            return images
        return torch.where(to_device(flip, images.device).view(b, 1, 1, 1), images.flip(-1), images)

    def auto_augment(self, x: Tensor) -> Tensor:
        """TrivialAugment (one op per image, uniform magnitude) or RandAugment (ra_num_ops ops per image at
        ra_magnitude / 10): float 0..255 (B, C, H, W) -> same."""
        cfg = self.cfg
        if cfg.auto_augment == "none":
            return x
        b = x.shape[0]
        fill = to_device(self.fill, x.device)
        layers = 1 if cfg.auto_augment == "trivial" else cfg.ra_num_ops
        for _ in range(layers):
            op = torch.randint(len(AUTO_AUGMENT_OPS), (b,))
            if cfg.auto_augment == "trivial":
                magnitude = torch.rand(b)
            else:
                magnitude = torch.full((b,), cfg.ra_magnitude / 10.0)
            sign = torch.where(torch.rand(b) < 0.5, -1.0, 1.0)
            x = apply_augment_ops(x, op, _op_values(op, magnitude, sign, self.op_max_values), fill)
        return x

    def erase(self, x: Tensor) -> Tensor:
        """timm RandomErasing (mode 'pixel', one box) with probability cfg.random_erasing per image, in place."""
        if self.cfg.random_erasing <= 0:
            return x
        b, _, h, w = x.shape
        boxes, apply = _sample_erase_boxes(b, h, w, self.cfg.random_erasing)
        return erase_boxes(x, boxes, apply)

    def mix(self, x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """timm Mixup (batch mode): maybe mixup or cutmix the whole batch with one lam ~ Beta(alpha, alpha)."""
        cfg = self.cfg
        use_mixup, use_cutmix = cfg.mixup > 0, cfg.cutmix > 0
        if not (use_mixup or use_cutmix) or cfg.mix_prob <= 0 or torch.rand(()).item() >= cfg.mix_prob:
            return x, targets
        if use_mixup and use_cutmix:
            mode = "cutmix" if torch.rand(()).item() < cfg.switch_prob else "mixup"
        else:
            mode = "cutmix" if use_cutmix else "mixup"
        alpha = torch.tensor(cfg.cutmix if mode == "cutmix" else cfg.mixup)
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        if lam >= 1.0:
            return x, targets
        return mix_batch(x, targets, lam, mode)

    def forward(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 (B, C, H, W) + int64 (B,) on any device -> normalised float32 (B, C, h, w) and soft targets
        (B, num_classes) whose rows sum to 1."""
        _check_uint8(images)
        b, c = images.shape[:2]
        if labels.shape != (b,):
            raise VitlabError(f"labels must have shape ({b},), got {tuple(labels.shape)}")
        if self.norm_scale.shape[0] not in (1, c):
            raise VitlabError(f"mean/std have {self.norm_scale.shape[0]} channels but the images have {c}")
        dev = images.device
        x = self.crop_flip(images)  # (B, C, h, w) uint8 (float 0..255 after 'rrc')
        x = self.auto_augment(x.float())  # float 0..255, a tensor of our own (never `images`), so in-place ops are safe
        x = _normalize_0_255_(x, to_device(self.norm_scale, dev), to_device(self.norm_shift, dev))
        x = self.erase(x)
        targets = smooth_one_hot(to_device(labels, dev), self.num_classes, self.cfg.label_smoothing)
        return self.mix(x, targets)
