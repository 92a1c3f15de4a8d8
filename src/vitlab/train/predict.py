"""`vitlab eval` and `vitlab predict`: a saved model on a data set, or on image files."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import io as vio
from ..data.augment import normalize
from ..data.sources import load_data, read_image
from ..devices import resolve_device, to_device
from ..fileio import atomic_write_json
from .evaluate import evaluate_model, head_logits


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
    model = vio.load(model_path).to(dev)
    c, h, w = model.pretrained_cfg["input_size"]
    bundle = load_data(data, img_size=(h, w), in_chans=c, cache_dir=cache_dir, download=download)
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
    heads = evaluate_model(model, bundle.test.images, labels, names, model.pretrained_cfg["mean"],
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
    """Top-k classes with probabilities for each image file."""
    dev = resolve_device(device)
    model = vio.load(model_path).to(dev)
    c, h, w = model.pretrained_cfg["input_size"]
    names = _class_names(model)
    batch = torch.stack([read_image(p, (h, w), c) for p in images])
    probs = class_probabilities(model, batch).cpu()
    k = min(top_k, probs.shape[1])
    top = probs.topk(k, dim=1)
    return [{"image": str(p), "top": [{"class": names[int(i)], "probability": float(v)}
                                      for v, i in zip(top.values[n], top.indices[n])]}
            for n, p in enumerate(images)]
