"""`vitlab predict`: a saved model's top classes, with probabilities, for image files."""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from .. import checkpoint
from ..data.arrays import images_nchw, to_uint8
from ..data.augment import normalize
from ..data.sources import read_image
from ..data.views import Preprocess
from ..devices import PREDICT_BATCH, autocast, resolve_device, to_device
from ..errors import VitlabError
from ..finite import check_finite
from ..metrics import head_logits
from ..progress import progress_bar
from ..runs.folder import check_model_written
from .precision import cast_for_inference, inference_precision


def class_names(model: torch.nn.Module) -> list[str]:
    """The model's class names (its label_names), or the class indices as text."""
    names = model.pretrained_cfg.get("label_names")
    return list(names) if names else [str(i) for i in range(model.num_classes)]


def check_batch_size(batch_size: object) -> int:
    """``batch_size`` as given to predict or evaluate, refused in one line unless an integer >= 1."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise VitlabError(f"batch_size {batch_size!r} is not valid; accepted: an integer >= 1")
    return int(batch_size)


def check_has_head(model: torch.nn.Module, name: object, what: str) -> None:
    """One line for a model without a classifier head (a pre-trained encoder) given to ``what`` (predict,
    evaluate): it has no classes to score, and saying so beats "predicts 0 classes"."""
    if getattr(model, "num_classes", 0) == 0:
        folder = name if isinstance(name, (str, os.PathLike)) and name != "the model" else "ENCODER"
        raise VitlabError(f"{name} has no classifier head (a pre-trained encoder): nothing to {what}; accepted: a "
                          f"classifier, e.g. one fine-tuned with `vitlab train --init {folder}` (or judge the "
                          f"encoder's features with `vitlab probe {folder}`)")


def prepare_image(image: torch.Tensor, cfg: dict) -> torch.Tensor:
    """uint8 (C, H0, W0) -> uint8 (C, h, w) for a model of pretrained config ``cfg``: its ``Preprocess`` (resize
    rule, crop_pct, interpolation) applied to a decoded image."""
    return Preprocess.from_cfg(cfg).apply(image[None])[0]


def is_grey_batch(x: np.ndarray) -> bool:
    """Whether a 3-D array is (N, H, W) one-channel images, as Keras's MNIST gives them, not one (H, W, C) image:
    its last axis is no channel count (1 or 3)."""
    return x.ndim == 3 and x.shape[-1] not in (1, 3)


def decode_images(images: Any, cfg: dict) -> torch.Tensor:
    """Images as a model of pretrained config ``cfg`` takes them, uint8 (N, C, h, w): image files (decoded as
    ``predict_files`` decodes them), PIL images, or arrays (H, W, C), (H, W), (N, H, W) or (N, H, W, C) (uint8, or
    floats in [0, 1] or [0, 255]), brought to the model's size by its own rule (``Preprocess``)."""
    prep = Preprocess.from_cfg(cfg)
    chans = cfg["input_size"][0]
    if isinstance(images, (np.ndarray, torch.Tensor)) and np.asarray(images).dtype != np.uint8:
        images = to_uint8(np.asarray(images), "images")  # floats in [0, 1] or [0, 255]: the batch's range, not each's
    if isinstance(images, (np.ndarray, torch.Tensor)) and is_grey_batch(np.asarray(images)):
        images = np.asarray(images)[..., None]  # (N, H, W) as Keras's MNIST: one channel each
    if isinstance(images, (np.ndarray, torch.Tensor)) and np.asarray(images).ndim == 4:
        images = list(images)
    elif not isinstance(images, (list, tuple)):
        images = [images]
    decoded = []
    for image in images:
        if isinstance(image, (str, os.PathLike)):
            decoded.append(read_image(image, prep.size, chans, prep.fit))
            continue
        if isinstance(image, Image.Image):
            image = np.asarray(image.convert("RGB" if chans == 3 else "L"))
        array = np.asarray(image)
        if array.ndim == 3 and array.shape[-1] not in (1, 3):  # (N, H, W) or channels first: not one image
            raise VitlabError(f"an array of shape {array.shape} is not one image (H, W, C) with C 1 or 3; accepted: "
                              "(H, W, C) or (H, W) for one image, (N, H, W, C) for several (N one-channel images "
                              "(N, H, W): add their channel, x[..., None])")
        x = torch.from_numpy(images_nchw(array[None], "an image"))[0]
        if x.shape[0] != chans:
            raise VitlabError(f"an image of {x.shape[0]} channel(s) is not valid for this model; accepted: {chans} "
                              "channel(s), a file or a PIL image (converted)")
        decoded.append(x if tuple(x.shape[-2:]) == prep.size else prepare_image(x, cfg))
    if not decoded:
        raise VitlabError("no images given; accepted: image files, PIL images or uint8 arrays")
    return torch.stack(decoded)


@torch.no_grad()
def class_probabilities(model: torch.nn.Module, images: torch.Tensor, source: object = "the model",
                        precision: str = "fp32") -> torch.Tensor:
    """Softmax of the model's eval logits (the mean of a distilled model's heads) for a uint8 batch, on the
    model's device, the model run in ``precision`` (fp32, bf16 or fp16 autocast; the softmax in float32); logits
    that hold a NaN or an Inf are refused (ValueError naming ``source``)."""
    dev = next(model.parameters()).device
    x = normalize(to_device(images, dev), model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    with autocast(dev, precision):
        logits = head_logits(model.eval(), x)["logits"]
    probs = logits.float().softmax(-1)
    check_finite(probs, len(probs), "class probabilities", source)
    return probs


@torch.no_grad()
def predict_files(model_path: str | os.PathLike, images: Sequence[str | os.PathLike], top_k: int = 5,
                  device: str = "auto", precision: str = "auto", batch_size: int = PREDICT_BATCH) -> list[dict]:
    """Top-k classes with probabilities for each image file; a file that cannot be read gets ``error`` (why)
    instead, and the others are predicted (none readable: a ValueError).

    Each image is prepared as the model's pretrained config says (``Preprocess``: the resize rule, crop_pct
    and interpolation applied by Pillow as the file is decoded, as timm and transformers do; mean and std),
    the rule that decodes a run's test images. ``precision``: fp32, bf16, fp16 or auto (a run folder's own, else
    bf16 where it pays for the model: ``infer.precision.inference_precision``). The files are decoded and run
    ``batch_size`` at a time, so memory stays that of one batch however many files there are; more files than one
    batch show a progress bar (with its ETA) on stderr.
    """
    if not images:
        raise VitlabError("no images given; accepted: one image file or more")
    check_batch_size(batch_size)
    dev = resolve_device(device)
    check_model_written(model_path)
    model = checkpoint.load(model_path).to(dev)
    check_has_head(model, model_path, "predict")
    cfg = model.pretrained_cfg
    names = class_names(model)
    prep = Preprocess.from_cfg(cfg)
    precision = inference_precision(model, precision, dev, model_path)
    model = cast_for_inference(model, precision)
    results = []
    bar = progress_bar(total=len(images), unit="img", desc="predict", disable=len(images) <= batch_size)
    for start in range(0, len(images), batch_size):
        chunk = images[start:start + batch_size]
        decoded, readable = [], []
        for p in chunk:
            try:
                decoded.append(read_image(p, prep.size, cfg["input_size"][0], prep.fit))
                readable.append({"image": str(p)})
                results.append(readable[-1])
            except ValueError as e:  # one unreadable file: the others are still predicted, and it is reported
                results.append({"image": str(p), "error": str(e)})
        bar.update(len(chunk))
        if not decoded:
            continue
        probs = class_probabilities(model, torch.stack(decoded), model_path, precision).cpu()
        top = probs.topk(min(top_k, probs.shape[1]), dim=1)
        for r, values, indices in zip(readable, top.values, top.indices):
            r["top"] = [{"class": names[int(i)], "probability": float(v)} for v, i in zip(values, indices)]
    bar.close()
    if not any("top" in r for r in results):
        raise VitlabError(results[0]["error"] if len(results) == 1 else
                          f"none of the {len(results)} images could be read; the first: {results[0]['error']}")
    return results
