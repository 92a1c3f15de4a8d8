"""`vitlab eval`: a saved model's metrics, every head, on a data set's test split."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from .. import checkpoint
from ..data.sources import load_data
from ..data.views import Preprocess
from ..devices import resolve_device
from ..runs.figures import plot_confusion
from ..runs.folder import check_model_written, claim_folder
from ..runs.format import CONFUSION_PNG, EvalSummary, read_split, write_summary
from ..runs.identity import check_data
from ..train.metrics import evaluate_model
from .predict import class_names


def evaluate_folder(model_path: str | os.PathLike, data: str | None = None, out: str | os.PathLike | None = None,
                    batch_size: int = 256, precision: str = "fp32", cache_dir: str | None = None,
                    download: bool = False, tta: bool = False, device: str = "auto", tta_translate: int = 0) -> dict:
    """Metrics of every head of a saved model on a data set's test split; summary.json and confusion.png in out.

    ``tta`` averages each image's logits with its mirror image's, and with ``tta_translate`` N also with the image
    shifted by N pixels (see ``head_logits``). ``precision``:
    fp32, bf16, fp16 or auto (bf16 on a GPU that has it, else fp32). A run folder is evaluated on its own
    test split (its data set unless ``data`` names another, its seed and val_fraction). ``out`` is claimed
    before the work (runs.folder.claim_folder): a folder holding others' files, or being written, is refused.
    """
    with claim_folder(out, "eval") if out is not None else contextlib.nullcontext():
        return _evaluate(model_path, data, out, batch_size, precision, cache_dir, download, tta, device, tta_translate)


def _evaluate(model_path, data, out, batch_size, precision, cache_dir, download, tta, device, tta_translate) -> dict:
    if tta_translate and not tta:
        raise ValueError(f"tta_translate={tta_translate} needs --tta; accepted without it: 0")
    split = read_split(model_path)
    own = data is None
    data = data or split.get("data")
    split.pop("data", None)
    if data is None:
        raise ValueError(f"{model_path} is not a run folder (no config.yaml names its data): give --data "
                         "(digits, cifar10, cifar100, an image folder or a .tar.gz)")
    dev = resolve_device(device)
    check_model_written(model_path)
    model = checkpoint.load(model_path).to(dev)
    c = model.pretrained_cfg["input_size"][0]
    prep = Preprocess.from_cfg(model.pretrained_cfg)  # files are decoded by the model's own rule
    bundle = load_data(data, img_size=prep.size, in_chans=c, cache_dir=cache_dir, download=download,
                       fit=prep.fit, **split)
    check_data(model_path, bundle.identity, "evaluate", own)
    test_images = bundle.test.images
    if tuple(test_images.shape[-2:]) != prep.size:  # a store folder of another size
        test_images = torch.cat([prep.apply(x) for x in test_images.split(1024)] or [test_images])
    if len(test_images) == 0:
        raise ValueError(f"{data} has no test images to evaluate on ({len(bundle.train.images)} training images in "
                         f"{len(bundle.classes)} classes); accepted: a data set with a test split, or classes of at "
                         "least 2 images each")
    names = class_names(model)
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
                           model.pretrained_cfg["std"], batch_size=batch_size, precision=precision, tta=tta,
                           tta_translate=tta_translate)
    m = heads["logits"]
    result = EvalSummary(model=str(model_path), data=bundle.name, tta=tta, heads=heads, top1=m["top1"],
                         top5=m["top5"], per_class=m["per_class"], tta_translate=tta_translate)
    if out is not None:
        out = Path(out)
        write_summary(out, result)
        plot_confusion(m["confusion"], names, out / CONFUSION_PNG,
                       title=f"{Path(model_path).name} on {bundle.name}: top-1 {100 * result.top1:.2f}%")
    return result.to_dict()
