"""`vitlab eval` and `vitlab predict`: a saved model on a data set, or on image files."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .. import checkpoint
from ..atomic import atomic_write_json
from ..data.augment import normalize
from ..data.sources import load_data, read_image
from ..devices import resolve_device, to_device
from .evaluate import evaluate_model, head_logits

PIL_FILTERS = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
               "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS, "box": Image.Resampling.BOX,
               "hamming": Image.Resampling.HAMMING}


def scale_size(size: tuple[int, int], crop_pct: float | None) -> tuple[int, int]:
    """The size an image is resized to before a centre crop of ``size`` keeps ``crop_pct`` of it (timm's rule)."""
    if not crop_pct or crop_pct >= 1:
        return tuple(size)
    return math.floor(size[0] / crop_pct), math.floor(size[1] / crop_pct)


def center_crop(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The central (h, w) window of (..., H, W) images."""
    H, W = images.shape[-2:]
    top, left = int(round((H - size[0]) / 2.0)), int(round((W - size[1]) / 2.0))
    return images[..., top:top + size[0], left:left + size[1]]


def eval_transform(image: torch.Tensor, size: tuple[int, int], interpolation: str = "bicubic",
                   crop_pct: float | None = None) -> torch.Tensor:
    """uint8 (C, H0, W0) -> uint8 (C, h, w) as timm's eval transform does it.

    With ``crop_pct``: the shorter side resized to size / crop_pct (both sides for a non-square size),
    keeping the aspect ratio, then a centre crop; without: resized to ``size``.
    """
    if interpolation not in PIL_FILTERS:
        raise ValueError(f"interpolation {interpolation!r} is not supported; accepted: {', '.join(PIL_FILTERS)}")
    arr = image.permute(1, 2, 0).numpy()
    img = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    W0, H0 = img.size
    h, w = size
    if crop_pct:
        sh, sw = scale_size(size, crop_pct)
        if sh == sw:  # the shorter side to the scale, the longer in proportion
            short, long_ = min(H0, W0), max(H0, W0)
            new_long = int(sh * long_ / short)
            sh, sw = (sh, new_long) if H0 <= W0 else (new_long, sh)
        else:  # both sides at least their target, aspect ratio kept
            ratio = max(sh / H0, sw / W0)
            sh, sw = round(H0 * ratio), round(W0 * ratio)
        img = img.resize((sw, sh), PIL_FILTERS[interpolation])
    else:
        img = img.resize((w, h), PIL_FILTERS[interpolation])
    out = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())
    out = out[:, :, None] if out.ndim == 2 else out
    return center_crop(out.permute(2, 0, 1), (h, w)).contiguous()


def _class_names(model: torch.nn.Module) -> list[str]:
    names = model.pretrained_cfg.get("label_names")
    return list(names) if names else [str(i) for i in range(model.num_classes)]


def evaluate_folder(model_path: str | os.PathLike, data: str, out: str | os.PathLike | None = None,
                    batch_size: int = 256, precision: str = "fp32", cache_dir: str | None = None,
                    download: bool = False, tta: bool = False, device: str = "auto") -> dict[str, Any]:
    """Metrics of every head of a saved model on a data set's test split; summary.json and confusion.png in out.

    ``tta`` averages each image's logits with its mirror image's (see ``head_logits``). ``precision``:
    fp32, bf16, fp16 or auto (bf16 on a GPU that has it, else fp32).
    """
    dev = resolve_device(device)
    model = checkpoint.load(model_path).to(dev)
    c, h, w = model.pretrained_cfg["input_size"]
    # a pretrained crop_pct: decode at size / crop_pct, then keep the centre (the data set's own resampling)
    scaled = scale_size((h, w), model.pretrained_cfg.get("crop_pct"))
    bundle = load_data(data, img_size=scaled, in_chans=c, cache_dir=cache_dir, download=download)
    test_images = center_crop(bundle.test.images, (h, w))
    names = _class_names(model)
    labels = bundle.test.labels
    if model.pretrained_cfg.get("label_names") and set(bundle.classes) <= set(names):
        index = {n: i for i, n in enumerate(names)}  # map the data's labels onto the model's classes by name
        labels = torch.tensor([index[bundle.classes[int(y)]] for y in labels])
    elif len(bundle.classes) != model.num_classes:
        raise ValueError(f"the model predicts {model.num_classes} classes, {data} has {len(bundle.classes)}: "
                         f"{', '.join(bundle.classes[:10])}")
    if precision == "auto":
        precision = "bf16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    heads = evaluate_model(model, test_images, labels, names, model.pretrained_cfg["mean"],
                           model.pretrained_cfg["std"], batch_size=batch_size, precision=precision, tta=tta)
    m = heads["logits"]
    result = {"model": str(model_path), "data": bundle.name, "tta": tta, "heads": heads,
              "top1": m["top1"], "top5": m["top5"], "per_class": m["per_class"]}
    if out is not None:
        from .report import plot_confusion
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "summary.json", result)
        plot_confusion(m["confusion"], names, out / "confusion.png",
                       title=f"{Path(model_path).name} on {bundle.name}: top-1 {100 * result['top1']:.2f}%")
    return result


@torch.no_grad()
def class_probabilities(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Softmax of the model's eval logits (the mean of a distilled model's heads) for a uint8 batch, on the
    model's device."""
    dev = next(model.parameters()).device
    x = normalize(to_device(images, dev), model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    return head_logits(model.eval(), x)["logits"].float().softmax(-1)


@torch.no_grad()
def predict_files(model_path: str | os.PathLike, images: Sequence[str | os.PathLike], top_k: int = 5,
                  device: str = "auto") -> list[dict]:
    """Top-k classes with probabilities for each image file.

    Each image is prepared as the model's pretrained config says: interpolation, crop_pct (resize and
    centre crop), mean and std.
    """
    dev = resolve_device(device)
    model = checkpoint.load(model_path).to(dev)
    cfg = model.pretrained_cfg
    c, h, w = cfg["input_size"]
    names = _class_names(model)
    batch = torch.stack([eval_transform(read_image(p, None, c), (h, w), cfg.get("interpolation", "bicubic"),
                                        cfg.get("crop_pct")) for p in images])
    probs = class_probabilities(model, batch).cpu()
    k = min(top_k, probs.shape[1])
    top = probs.topk(k, dim=1)
    return [{"image": str(p), "top": [{"class": names[int(i)], "probability": float(v)}
                                      for v, i in zip(top.values[n], top.indices[n])]}
            for n, p in enumerate(images)]
