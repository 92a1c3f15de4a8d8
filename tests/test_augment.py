"""Tests for vitlab.data.augment: batched DeiT-style augmentation, targets, loss and the repeated-aug order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.data.augment import (
    AUTO_AUGMENT_OPS,
    AugmentConfig,
    BatchAugment,
    _affine_grid,
    _op_values,
    _sample_rrc_boxes,
    apply_augment_ops,
    erase_boxes,
    mix_batch,
    normalize,
    pad_crop_flip,
    resized_crop_flip,
    smooth_one_hot,
)
from vitlab.train.feed import repeated_aug_indices
from vitlab.train.tasks.supervised import soft_target_cross_entropy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CIFAR_MEAN, CIFAR_STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
OFF = dict(crop="none", hflip=False, auto_augment="none", random_erasing=0.0, mixup=0.0, cutmix=0.0)


def _batch(b: int = 8, c: int = 3, h: int = 32, w: int = 32, k: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (b, c, h, w), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, k, (b,), generator=g)
    return images, labels


def _module(c: int = 3, size: tuple[int, int] = (32, 32), k: int = 10, **overrides) -> BatchAugment:
    mean, std = (CIFAR_MEAN, CIFAR_STD) if c == 3 else ((0.5,) * c, (0.25,) * c)
    return BatchAugment(AugmentConfig(**overrides), size, mean, std, k)


def _op(name: str, b: int) -> torch.Tensor:
    return torch.full((b,), AUTO_AUGMENT_OPS.index(name))


# ---------------------------------------------------------------------------------------------------------------
# Whole pipeline
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # defaults: pad crop, flip, TrivialAugment, erasing, mixup/cutmix, smoothing
        dict(crop="rrc", auto_augment="rand", ra_num_ops=3, random_erasing=1.0, mix_prob=1.0, switch_prob=1.0),
        dict(crop="pad", pad_mode="zero", auto_augment="rand", mixup=0.0, switch_prob=0.0),
    ],
)
def test_forward_shapes_dtypes_and_targets(device: str, overrides: dict) -> None:
    images, labels = _batch(16)
    images, labels = images.to(device), labels.to(device)
    before = images.clone()
    aug = _module(**overrides)
    for seed in range(3):
        torch.manual_seed(seed)
        x, t = aug(images, labels)
        assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and x.device == images.device
        assert t.shape == (16, 10) and t.dtype == torch.float32 and t.device == images.device
        assert torch.isfinite(x).all()
        assert torch.allclose(t.sum(1), torch.ones(16, device=device), atol=1e-5)
        assert (t >= 0).all() and (t <= 1).all()
    assert torch.equal(images, before), "forward must not modify its input"


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(crop="rrc", auto_augment="rand", random_erasing=1.0), dict(crop="none", switch_prob=1.0)],
)
def test_forward_keeps_everything_on_the_input_device(overrides: dict) -> None:
    # the 'meta' device stands in for CUDA when no GPU is present: any CPU tensor mixed into the
    # device computation raises
    images = torch.empty(16, 3, 32, 32, dtype=torch.uint8, device="meta")
    labels = torch.empty(16, dtype=torch.long, device="meta")
    aug = _module(**overrides)
    for seed in range(4):
        torch.manual_seed(seed)
        x, t = aug(images, labels)
        assert x.device.type == "meta" and x.shape == (16, 3, 32, 32) and t.shape == (16, 10)


def test_all_augmentation_off_equals_normalize() -> None:
    images, labels = _batch(8)
    x, t = _module(label_smoothing=0.1, **OFF)(images, labels)
    assert torch.equal(x, normalize(images, CIFAR_MEAN, CIFAR_STD))
    assert torch.equal(t, smooth_one_hot(labels, 10, 0.1))


def test_normalize_values() -> None:
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    out = normalize(images, [0.2], [0.5])
    assert out.dtype == torch.float32
    assert torch.allclose(out.flatten(), torch.tensor([-0.4, 0.0, 1.6]), atol=1e-6)
    with pytest.raises(TypeError, match="uint8"):
        normalize(images.float(), [0.2], [0.5])


def test_output_size_follows_img_size_for_crops() -> None:
    images, labels = _batch(4, h=36, w=40)
    x, _ = _module(size=(32, 32), crop="rrc")(images, labels)
    assert x.shape == (4, 3, 32, 32)
    x, _ = _module(size=(32, 32), crop="pad", padding=0)(images, labels)
    assert x.shape == (4, 3, 32, 32)
    with pytest.raises(ValueError, match="img_size"):
        _module(size=(32, 32), crop="none")(images, labels)


@pytest.mark.parametrize("auto_augment", ["trivial", "rand"])
@pytest.mark.parametrize("crop", ["pad", "rrc", "none"])
def test_one_channel_8x8_digits_full_pipeline(auto_augment: str, crop: str) -> None:
    images, labels = _batch(32, c=1, h=8, w=8)
    aug = _module(c=1, size=(8, 8), crop=crop, padding=1, auto_augment=auto_augment, ra_num_ops=4, random_erasing=1.0)
    for seed in range(4):
        torch.manual_seed(seed)
        x, t = aug(images, labels)
        assert x.shape == (32, 1, 8, 8) and torch.isfinite(x).all()
        assert torch.allclose(t.sum(1), torch.ones(32), atol=1e-5)


def test_every_op_runs_on_one_channel_and_tiny_images() -> None:
    for shape in [(14, 1, 8, 8), (14, 1, 2, 2), (14, 3, 5, 7)]:
        x = torch.randint(0, 256, shape).float()
        op = torch.arange(len(AUTO_AUGMENT_OPS))
        out = apply_augment_ops(x, op, torch.full((14,), 0.5), torch.zeros(1, shape[1], 1, 1))
        assert out.shape == x.shape and torch.isfinite(out).all()


def test_same_seed_same_output_different_seed_different_output() -> None:
    images, labels = _batch(16)
    aug = _module(random_erasing=0.5)
    torch.manual_seed(123)
    x1, t1 = aug(images, labels)
    torch.manual_seed(123)
    x2, t2 = aug(images, labels)
    torch.manual_seed(124)
    x3, _ = aug(images, labels)
    assert torch.equal(x1, x2) and torch.equal(t1, t2)
    assert not torch.equal(x1, x3)


def test_resume_from_saved_rng_state() -> None:
    images, labels = _batch(8)
    aug = _module()
    torch.manual_seed(0)
    aug(images, labels)
    state = torch.get_rng_state()
    x1, t1 = aug(images, labels)
    torch.set_rng_state(state)
    x2, t2 = aug(images, labels)
    assert torch.equal(x1, x2) and torch.equal(t1, t2)


def test_trivial_augment_picks_ops_per_image() -> None:
    # one image repeated: per-batch op choice (kornia's TrivialAugment) would give every copy the same op; here a
    # large share of copies must be bit-identical to the input (identity / no-op draws) and others must differ.
    images = _batch(1)[0].expand(256, -1, -1, -1).contiguous()
    labels = torch.zeros(256, dtype=torch.long)
    torch.manual_seed(0)
    x, _ = _module(**{**OFF, "auto_augment": "trivial"})(images, labels)
    unchanged = (x == normalize(images[:1], CIFAR_MEAN, CIFAR_STD)).flatten(1).all(1)
    assert 5 <= int(unchanged.sum()) <= 80


# ---------------------------------------------------------------------------------------------------------------
# Labels, loss, mixing
# ---------------------------------------------------------------------------------------------------------------


def test_smooth_one_hot_exact_values() -> None:
    t = smooth_one_hot(torch.tensor([2, 0]), num_classes=4, smoothing=0.2)
    expected = torch.tensor([[0.05, 0.05, 0.85, 0.05], [0.85, 0.05, 0.05, 0.05]])
    assert torch.allclose(t, expected, atol=1e-7)
    assert torch.equal(smooth_one_hot(torch.tensor([1]), 3, 0.0), torch.tensor([[0.0, 1.0, 0.0]]))


def test_soft_target_cross_entropy_matches_torch() -> None:
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 4, 2, 2, 1, 3])
    loss = soft_target_cross_entropy(logits, F.one_hot(labels, 5).float())
    assert torch.allclose(loss, F.cross_entropy(logits, labels), atol=1e-6)
    smoothed = soft_target_cross_entropy(logits, smooth_one_hot(labels, 5, 0.1))
    assert torch.allclose(smoothed, F.cross_entropy(logits, labels, label_smoothing=0.1), atol=1e-6)


def test_mixup_with_fixed_lam_equals_hand_computation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=g)
    t = smooth_one_hot(torch.tensor([0, 1, 2, 3]), 4, 0.1)
    lam = 0.3
    mixed, targets = mix_batch(x.clone(), t, lam, "mixup")
    assert torch.allclose(mixed, lam * x + (1 - lam) * x[[3, 2, 1, 0]], atol=1e-6)
    assert torch.allclose(targets, lam * t + (1 - lam) * t[[3, 2, 1, 0]], atol=1e-6)
    # image 0 is 0.3 * its own label and 0.7 * label 3, each smoothed (off = 0.025, on = 0.925)
    on, off = 0.925, 0.025
    assert torch.allclose(targets[0], torch.tensor([0.3 * on + 0.7 * off, off, off, 0.3 * off + 0.7 * on]))


def test_cutmix_pastes_box_from_flipped_batch_and_weights_by_area() -> None:
    b, h, w = 4, 8, 10
    x = torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 2, h, w).contiguous()  # image i == i
    t = F.one_hot(torch.arange(b), b).float()
    torch.manual_seed(0)
    for lam in (0.2, 0.5, 0.8):
        mixed, targets = mix_batch(x.clone(), t, lam, "cutmix")
        for i in range(b):
            partner = b - 1 - i
            pasted = mixed[i] == partner
            assert ((mixed[i] == i) | pasted).all()
            area = pasted[0].float().mean().item()
            rows, cols = pasted[0].any(1).nonzero(), pasted[0].any(0).nonzero()
            if area > 0:  # the pasted pixels form one rectangle, identical in every channel
                box = pasted[0, rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
                assert box.all() and int(box.sum()) == int(pasted[0].sum())
                assert torch.equal(pasted[0], pasted[1])
            assert targets[i, partner].item() == pytest.approx(area, abs=1e-6)
            assert targets[i, i].item() == pytest.approx(1 - area, abs=1e-6)
    # explicit box: rows 1..2, cols 2..4 -> area 6 / 80, lam = 1 - 6/80
    mixed, targets = mix_batch(x.clone(), t, 0.5, "cutmix", box=(1, 3, 2, 5))
    assert torch.equal(mixed[0, :, 1:3, 2:5], torch.full((2, 2, 3), 3.0))
    assert (mixed[0].sum() - 3.0 * 12).item() == 0.0
    assert targets[0, 0].item() == pytest.approx(1 - 6 / 80) and targets[0, 3].item() == pytest.approx(6 / 80)


def test_module_mixing_respects_mix_prob_and_alpha() -> None:
    images, labels = _batch(8)
    off = dict(crop="none", hflip=False, auto_augment="none", random_erasing=0.0, label_smoothing=0.0)
    torch.manual_seed(0)
    x, t = _module(**off, mix_prob=0.0)(images, labels)
    assert torch.equal(t, F.one_hot(labels, 10).float())
    torch.manual_seed(0)
    x, t = _module(**off, mixup=1.0, cutmix=0.0, mix_prob=1.0)(images, labels)
    lam = t[torch.arange(8), labels].max().item()  # labels may collide; the largest own-class weight is lam or more
    assert (t > 0).sum(1).max() <= 2 and 0 < lam < 1 + 1e-6
    assert not torch.equal(x, normalize(images, CIFAR_MEAN, CIFAR_STD))


# ---------------------------------------------------------------------------------------------------------------
# Crop, flip, erasing
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad_mode", ["reflect", "zero"])
def test_pad_crop_with_zero_translation_returns_input(pad_mode: str) -> None:
    images, _ = _batch(5)
    p = torch.full((5,), 4)
    out = pad_crop_flip(images, p, p, torch.zeros(5, dtype=torch.bool), 4, (32, 32), pad_mode)
    assert out.dtype == torch.uint8 and torch.equal(out, images)


@pytest.mark.parametrize("pad_mode,torch_mode", [("reflect", "reflect"), ("zero", "constant")])
def test_pad_crop_matches_padding_then_slicing(pad_mode: str, torch_mode: str) -> None:
    images, _ = _batch(6, h=8, w=8)
    top, left = torch.tensor([0, 1, 3, 6, 2, 4]), torch.tensor([6, 0, 3, 1, 5, 2])
    flip = torch.tensor([False, True, False, True, True, False])
    out = pad_crop_flip(images, top, left, flip, 3, (8, 8), pad_mode)
    padded = F.pad(images.float(), (3, 3, 3, 3), mode=torch_mode)
    for i in range(6):
        ref = padded[i, :, top[i] : top[i] + 8, left[i] : left[i] + 8]
        ref = ref.flip(-1) if flip[i] else ref
        assert torch.equal(out[i].float(), ref), i


def test_horizontal_flip() -> None:
    images, labels = _batch(64)
    zeros, ones = torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool)
    out = pad_crop_flip(images, zeros, zeros, ones, 0, (32, 32))
    assert torch.equal(out, images.flip(-1))
    # via the module (p = 0.5): every image is either unchanged or mirrored, and both happen
    torch.manual_seed(0)
    x, _ = _module(**{**OFF, "hflip": True})(images, labels)
    same = (x == normalize(images, CIFAR_MEAN, CIFAR_STD)).flatten(1).all(1)
    mirrored = (x == normalize(images.flip(-1), CIFAR_MEAN, CIFAR_STD)).flatten(1).all(1)
    assert (same | mirrored).all() and same.any() and mirrored.any()


def test_random_erasing_changes_only_a_rectangle() -> None:
    images, labels = _batch(32)
    torch.manual_seed(0)
    x, _ = _module(**{**OFF, "random_erasing": 1.0})(images, labels)
    changed = (x != normalize(images, CIFAR_MEAN, CIFAR_STD)).any(1)  # (B, H, W)
    assert changed.flatten(1).any(1).sum() >= 28  # p = 1: (nearly) every image erased
    for m in changed:
        if m.any():
            rows, cols = m.any(1).nonzero(), m.any(0).nonzero()
            box = m[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
            assert box.all() and int(box.sum()) == int(m.sum())
            assert m.float().mean() <= 1 / 3 + 0.05


def test_erase_boxes_explicit() -> None:
    x = torch.zeros(3, 2, 6, 6)
    boxes = torch.tensor([[1, 2, 3, 2], [0, 0, 6, 6], [0, 0, 1, 1]])
    out = erase_boxes(x.clone(), boxes, torch.tensor([True, True, False]))
    expected = torch.zeros(2, 6, 6, dtype=torch.bool)
    expected[:, 1:4, 2:4] = True  # rows 1..3, cols 2..3
    assert torch.equal(out[0] != 0, expected)
    assert (out[1] != 0).all() and (out[2] == 0).all()


def test_erasing_noise_comes_from_the_global_rng() -> None:
    x, boxes, apply = torch.zeros(2, 3, 8, 8), torch.tensor([[0, 0, 8, 8], [2, 2, 3, 3]]), torch.tensor([True, True])
    torch.manual_seed(0)
    a = erase_boxes(x.clone(), boxes, apply)
    torch.manual_seed(0)
    b = erase_boxes(x.clone(), boxes, apply)
    torch.manual_seed(1)
    c = erase_boxes(x.clone(), boxes, apply)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(a[0].mean().item()) < 0.3 and abs(a[0].std().item() - 1) < 0.2  # standard normal pixels


def test_resized_crop_flip() -> None:
    x = _batch(3, h=12, w=16)[0]
    full = torch.tensor([[0.0, 0.0, 12.0, 16.0]]).expand(3, 4)
    no, yes = torch.zeros(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)
    assert torch.allclose(resized_crop_flip(x, full, no, (12, 16)), x.float(), atol=1e-3)
    assert torch.allclose(resized_crop_flip(x, full, yes, (12, 16)), x.float().flip(-1), atol=1e-3)
    box = torch.tensor([[2.0, 5.0, 6.0, 4.0]]).expand(3, 4)  # top 2, left 5, 6 x 4 crop at scale 1
    assert torch.allclose(resized_crop_flip(x, box, no, (6, 4)), x[:, :, 2:8, 5:9].float(), atol=1e-3)
    half = resized_crop_flip(x, full, no, (6, 8))  # 2x downscale = mean of 2x2 blocks
    assert torch.allclose(half, F.avg_pool2d(x.float(), 2), atol=1e-3)


def test_rrc_boxes_within_image_and_scale() -> None:
    torch.manual_seed(0)
    boxes = _sample_rrc_boxes(500, 32, 40, (0.35, 1.0))
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all() and (left + w <= 40).all()
    area = h * w / (32 * 40)
    assert area.min() >= 0.3 and area.max() <= 1.0 and area.std() > 0.1
    assert ((w / h) >= 0.7).all() and ((w / h) <= 1.45).all()
    assert boxes.unique(dim=0).shape[0] > 400


# ---------------------------------------------------------------------------------------------------------------
# TrivialAugment / RandAugment ops
# ---------------------------------------------------------------------------------------------------------------


def _apply(name: str, x: torch.Tensor, value: float, fill: float = 0.0) -> torch.Tensor:
    b, c = x.shape[:2]
    return apply_augment_ops(x, _op(name, b), torch.full((b,), value), torch.full((1, c, 1, 1), fill))


def _equalize_reference(img: torch.Tensor) -> torch.Tensor:
    """torchvision's per-channel equalize on a uint8-valued (C, H, W) tensor, one channel at a time."""
    out = []
    for ch in img.long():
        hist = torch.bincount(ch.flatten(), minlength=256).float()
        nonzero = hist[hist != 0]
        step = torch.div(nonzero[:-1].sum(), 255, rounding_mode="floor")
        if step == 0:
            out.append(ch.float())
            continue
        lut = torch.div(torch.cumsum(hist, 0) + torch.div(step, 2, rounding_mode="floor"), step, rounding_mode="floor")
        lut = F.pad(lut, [1, 0])[:-1].clamp(0, 255)
        out.append(lut[ch])
    return torch.stack(out)


def test_colour_ops_against_references() -> None:
    x = _batch(4, h=20, w=20)[0].float()
    assert torch.equal(_apply("identity", x, 0.7), x)
    assert torch.equal(_apply("brightness", x, 1.5), (x * 1.5).clamp(0, 255))
    assert torch.equal(_apply("solarize", x, 128.0), torch.where(x >= 128, 255 - x, x))
    assert torch.equal(_apply("posterize", x, 8.0), (x.to(torch.uint8) & 0b11111000).float())  # step 8 = 3 bits off
    lo, hi = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    assert torch.allclose(_apply("autocontrast", x, 0.0), (x - lo) * 255 / (hi - lo), atol=1e-4)
    eq = _apply("equalize", x, 0.0)
    assert torch.equal(eq, torch.stack([_equalize_reference(img) for img in x]))
    gray = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    assert torch.allclose(_apply("color", x, 0.0), gray.expand_as(x), atol=1e-4)
    assert torch.allclose(_apply("contrast", x, 0.0), gray.mean((1, 2, 3), keepdim=True).expand_as(x), atol=1e-4)
    for name in ("color", "contrast", "sharpness"):  # factor 1 = unchanged
        assert torch.allclose(_apply(name, x, 1.0), x, atol=1e-4), name
    sharp = _apply("sharpness", x, 0.0)  # factor 0 = the smoothed image, borders unchanged
    smooth = F.conv2d(x.view(12, 1, 20, 20), torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]]).view(1, 1, 3, 3) / 13)
    assert torch.allclose(sharp[..., 1:-1, 1:-1], smooth.view(4, 3, 18, 18).round(), atol=1.0)
    assert torch.equal(sharp[..., 0, :], x[..., 0, :]) and torch.equal(sharp[..., :, -1], x[..., :, -1])
    one = x[:, :1]
    assert torch.equal(_apply("color", one, 0.0), one)  # saturation is a no-op on 1 channel


def test_affine_grid_matches_torch() -> None:
    theta = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(0))
    for h, w in [(8, 8), (32, 40), (3, 5)]:
        expected = F.affine_grid(theta, [5, 1, h, w], align_corners=False)
        assert torch.allclose(_affine_grid(theta, h, w), expected, atol=1e-6)


def test_geometric_ops_conventions() -> None:
    x = _batch(2, h=16, w=16)[0].float()
    out = _apply("translate_x", x, 0.25, fill=7.0)  # 4 px
    assert torch.allclose(out[..., :12], x[..., 4:], atol=1e-3) and torch.allclose(out[..., 12:], torch.tensor(7.0))
    out = _apply("translate_y", x, -0.25, fill=7.0)
    assert torch.allclose(out[..., 4:, :], x[..., :12, :], atol=1e-3)
    out = _apply("rotate", x, 90.0)
    assert torch.allclose(out, torch.rot90(x, 1, (2, 3)), atol=1e-3) or torch.allclose(
        out, torch.rot90(x, -1, (2, 3)), atol=1e-3
    )
    for name in ("shear_x", "shear_y", "rotate", "translate_x"):
        assert torch.allclose(_apply(name, x, 0.0), x, atol=1e-3), name


def test_op_magnitude_tables() -> None:
    names = ["rotate", "shear_x", "translate_y", "brightness", "sharpness", "posterize", "solarize"]
    op = torch.tensor([AUTO_AUGMENT_OPS.index(n) for n in names])
    ones = torch.ones(len(names))
    trivial = _module(auto_augment="trivial").op_max_values
    expected = torch.tensor([135.0, 0.99, 0.45, 1.99, 1.99, 64.0, 0.0])  # posterize: 6 bits off -> step 64
    assert torch.allclose(_op_values(op, ones, ones, trivial), expected)
    expected = torch.tensor([-135.0, -0.99, -0.45, 0.01, 0.01, 64.0, 0.0])  # negative sign: ops 1 - m
    assert torch.allclose(_op_values(op, ones, -ones, trivial), expected)
    rand = _module(auto_augment="rand", ra_magnitude=5).op_max_values
    expected = torch.tensor([15.0, 0.15, 0.225, 1.45, 1.45, 4.0, 128.0])  # timm scale m / 10, posterize 2 bits off
    assert torch.allclose(_op_values(op, ones * 0.5, ones, rand), expected)


def test_rand_augment_magnitude_zero_only_keeps_parameter_free_ops() -> None:
    # at magnitude 0 every op is the identity except autocontrast / equalize; with 2 ops per image roughly
    # (12/14)^2 ~ 73% of the images are unchanged (at the default magnitude 9 almost none would be)
    images = _batch(1)[0].expand(256, -1, -1, -1).contiguous()
    cfg = {**OFF, "auto_augment": "rand", "ra_magnitude": 0}
    torch.manual_seed(0)
    x, _ = _module(**cfg)(images, torch.zeros(256, dtype=torch.long))
    unchanged = (x - normalize(images[:1], CIFAR_MEAN, CIFAR_STD)).abs().flatten(1).amax(1) < 1e-4
    assert 150 <= int(unchanged.sum()) <= 230


def test_mixed_ops_batch_equals_per_image_application() -> None:
    x = _batch(28, h=12, w=12)[0].float()
    op = torch.arange(28) % len(AUTO_AUGMENT_OPS)
    value = torch.linspace(0.2, 1.8, 28)
    fill = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)
    out = apply_augment_ops(x, op, value, fill)
    for i in range(28):
        assert torch.allclose(out[i], apply_augment_ops(x[i : i + 1], op[i : i + 1], value[i : i + 1], fill)[0]), i


# ---------------------------------------------------------------------------------------------------------------
# Config validation and the repeated-augmentation order
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,accepted",
    [
        ("crop", "zoom", "pad, rrc, none"),
        ("auto_augment", "auto", "trivial, rand, none"),
        ("pad_mode", "edge", "reflect, zero"),
        ("random_erasing", 1.5, "a number >= 0 and <= 1"),
        ("mixup", -1.0, "a number >= 0"),
        ("cutmix", float("nan"), "a number >= 0"),
        ("cutmix", float("inf"), "a number >= 0"),
        ("mix_prob", -0.1, "a number >= 0 and <= 1"),
        ("switch_prob", 2, "a number >= 0 and <= 1"),
        ("label_smoothing", 1.0, "a number >= 0 and < 1"),
        ("padding", -1, "an integer >= 0"),
        ("padding", 2.5, "an integer >= 0"),
        ("ra_num_ops", 0, "an integer >= 1"),
        ("ra_magnitude", 11, "an integer >= 0 and <= 10"),
        ("repeated_aug", 0, "an integer >= 1"),
        ("rrc_scale", (0.5, 0.2), "a pair lo, hi with 0 < lo <= hi <= 1"),
        ("rrc_scale", (0.0, 1.0), "a pair lo, hi with 0 < lo <= hi <= 1"),
        ("rrc_scale", (0.5,), "a pair lo, hi with 0 < lo <= hi <= 1"),
        ("hflip", "maybe", "true or false"),
    ],
)
def test_bad_value_is_one_line_naming_it_and_what_is_accepted(field: str, value: object, accepted: str) -> None:
    with pytest.raises(ValueError) as err:
        AugmentConfig(**{field: value})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{field}=") and f"accepted: {accepted}" in msg, msg
    cfg = AugmentConfig()
    with pytest.raises(ValueError) as err:  # an assignment is checked too: a BatchAugment never sees a bad value
        setattr(cfg, field, value)
    assert str(err.value) == msg and cfg == AugmentConfig()


def test_text_values_are_coerced_as_in_a_recipe_and_unknown_options_are_named() -> None:
    cfg = AugmentConfig(hflip="no", mixup="0", rrc_scale=["0.2", "1"], padding="2")
    assert (cfg.hflip, cfg.mixup, cfg.rrc_scale, cfg.padding) == (False, 0.0, (0.2, 1.0), 2)
    with pytest.raises(ValueError, match="unknown option colour; accepted: crop, padding"):
        AugmentConfig(colour="red")


def test_defaults_and_edges_are_accepted() -> None:
    for cfg in (AugmentConfig(), AugmentConfig(crop="rrc", auto_augment="none", random_erasing=1.0, mixup=0,
                                               ra_magnitude=10)):
        BatchAugment(cfg, (8, 8), (0.5,), (0.25,), 10)


def test_repeated_aug_single_replica_blocks() -> None:
    n, r = 20, 3
    order = repeated_aug_indices(n, r, torch.Generator().manual_seed(0))
    assert order.shape == (n,) and order.dtype == torch.long
    assert ((order >= 0) & (order < n)).all()
    blocks = order[: n // r * r].view(-1, r)
    assert (blocks == blocks[:, :1]).all()  # each sample's copies are adjacent (same batch)
    firsts = order[::r]
    assert firsts.unique().numel() == firsts.numel()  # drawn without replacement
    assert torch.bincount(order, minlength=n).max() <= r
    # without truncation (repeats = 1) it is a permutation
    assert torch.equal(repeated_aug_indices(n, 1, torch.Generator().manual_seed(0)).sort().values, torch.arange(n))


def test_repeated_aug_each_index_repeats_times_across_replicas() -> None:
    # with num_replicas == repeats every rank sees the same samples (different augmentations), so across ranks
    # each kept index appears exactly `repeats` times
    n, r = 12, 3
    shards = [repeated_aug_indices(n, r, torch.Generator().manual_seed(5), num_replicas=r, rank=k) for k in range(r)]
    assert all(s.shape == (n // r,) for s in shards)
    assert all(torch.equal(s, shards[0]) for s in shards) and shards[0].unique().numel() == n // r
    counts = torch.bincount(torch.cat(shards), minlength=n)
    assert set(counts.tolist()) <= {0, r}


def test_repeated_aug_shards_are_disjoint_and_cover_the_epoch() -> None:
    n, r, world = 23, 3, 2
    single = repeated_aug_indices(n, r, torch.Generator().manual_seed(1))
    shards = [repeated_aug_indices(n, r, torch.Generator().manual_seed(1), world, k) for k in range(world)]
    assert all(s.numel() == n // world for s in shards)
    interleaved = torch.stack(shards, 1).flatten()  # position i of the global order belongs to rank i % world
    assert torch.equal(interleaved, single[: interleaved.numel()])
    # deterministic for a given generator state; another seed gives another order
    assert torch.equal(shards[0], repeated_aug_indices(n, r, torch.Generator().manual_seed(1), world, 0))
    assert not torch.equal(single, repeated_aug_indices(n, r, torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError):
        repeated_aug_indices(n, r, torch.Generator(), num_replicas=2, rank=2)
