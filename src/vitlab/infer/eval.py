"""`vitlab eval`: a saved model's metrics, every head, on a data set's test split."""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import checkpoint
from ..data.sources import DataBundle, load_data
from ..data.views import Preprocess
from ..devices import eval_batch, resolve_device
from ..errors import VitlabError
from ..metrics import evaluate_model
from ..progress import progress_bar
from ..runs.folder import check_model_written, claim_folder
from ..runs.format import CONFUSION_PNG, EvalSummary, read_split, write_summary
from ..runs.identity import check_data
from .precision import cast_for_inference, inference_precision
from .predict import check_batch_size, check_has_head, class_names


@dataclass(frozen=True)
class Options:
    """How an evaluation runs: batch, precision (fp32, bf16, fp16, or auto: bf16 where it pays for the model,
    ``infer.precision.inference_precision``) and test-time augmentation (see ``head_logits``)."""

    batch_size: int | None = None  # None: devices.eval_batch of the model's device
    precision: str = "fp32"
    tta: bool = False
    tta_translate: int = 0


def model_data(model: torch.nn.Module, data: str, split: dict | None = None, cache_dir: str | None = None,
               download: bool = False) -> DataBundle:
    """A data set as a model takes it: its files decoded by the model's own rule, at its size and channels
    (``split``: the seed and val_fraction of a run's held-out split)."""
    prep = Preprocess.from_cfg(model.pretrained_cfg)
    return load_data(data, img_size=prep.size, in_chans=model.pretrained_cfg["input_size"][0], cache_dir=cache_dir,
                     download=download, fit=prep.fit, **(split or {}))


def evaluate_images(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, classes: list[str],
                    data: str, options: Options, n_train: int = 0, source: object = "the model") -> dict[str, dict]:
    """Metrics of every head of a model (on its device) on uint8 test images (N, C, H, W) of the data set named
    ``data``, labelled by ``classes``: images of another size are brought to the model's by its own rule, and the
    labels are mapped onto the model's classes by name where it names them. Logits that hold a NaN or an Inf are
    refused (ValueError naming ``source``), never scored."""
    check_has_head(model, source, "evaluate")
    if options.batch_size is not None:  # None: the device's own (eval_batch)
        check_batch_size(options.batch_size)
    prep = Preprocess.from_cfg(model.pretrained_cfg)
    if tuple(images.shape[-2:]) != prep.size:  # a store folder of another size
        images = torch.cat([prep.apply(x) for x in images.split(1024)] or [images])
    if len(images) == 0:
        raise VitlabError(f"{data} has no test images to evaluate on ({n_train} training images in "
                          f"{len(classes)} classes); accepted: a data set with a test split, or classes of at "
                          "least 2 images each")
    names = class_names(model)
    if model.pretrained_cfg.get("label_names") and set(classes) <= set(names):
        index = {n: i for i, n in enumerate(names)}  # map the data's labels onto the model's classes by name
        labels = torch.tensor([index[classes[int(y)]] for y in labels])
    elif len(classes) != model.num_classes:
        raise VitlabError(f"the model predicts {model.num_classes} classes, {data} has {len(classes)}: "
                          f"{', '.join(classes[:10])}")
    device = next(model.parameters()).device
    precision = inference_precision(model, options.precision, device)
    batch = options.batch_size or eval_batch(device)
    bar = progress_bar(total=len(images), unit="img", desc="eval", disable=len(images) <= batch, dynamic_ncols=True,
                       mininterval=1.0, file=sys.stderr)
    with contextlib.closing(bar):
        return evaluate_model(model, images, labels, names, model.pretrained_cfg["mean"],
                              model.pretrained_cfg["std"], batch_size=batch, precision=precision, tta=options.tta,
                              tta_translate=options.tta_translate, source=source, progress=bar)


def evaluate_folder(model_path: str | os.PathLike, data: str | None = None, out: str | os.PathLike | None = None,
                    batch_size: int | None = None, precision: str = "auto", cache_dir: str | None = None,
                    download: bool = False, tta: bool = False, device: str = "auto", tta_translate: int = 0) -> dict:
    """Metrics of every head of a saved model on a data set's test split; summary.json and confusion.png in out.

    ``tta`` averages each image's logits with its mirror image's, and with ``tta_translate`` N also with the image
    shifted by N pixels (see ``head_logits``). ``precision``:
    fp32, bf16, fp16 or auto (a run folder's own, so that its summary's figures are reproduced; else bf16 where
    it pays for the model: ``infer.precision.inference_precision``). A run folder is evaluated on its own
    test split (its data set unless ``data`` names another, its seed and val_fraction). ``out`` is claimed
    before the work (runs.folder.claim_folder): a folder holding others' files, or being written, is refused.
    """
    with claim_folder(out, "eval") if out is not None else contextlib.nullcontext():
        return _evaluate(model_path, data, out, batch_size, precision, cache_dir, download, tta, device, tta_translate)


def _evaluate(model_path, data, out, batch_size, precision, cache_dir, download, tta, device, tta_translate) -> dict:
    if tta_translate and not tta:
        raise VitlabError(f"tta_translate={tta_translate} needs --tta; accepted without it: 0")
    if batch_size is not None:  # None: the device's own (eval_batch)
        check_batch_size(batch_size)
    split = read_split(model_path)
    own = data is None
    data = data or split.get("data")
    split.pop("data", None)
    if not own:
        split.pop("test_data", None)  # the run's test shards go with its own data only
    if data is None:
        raise VitlabError(f"{model_path} is not a run folder (no config.yaml names its data): give --data "
                          "(digits, cifar10, cifar100, an image folder or a .tar.gz)")
    dev = resolve_device(device)
    check_model_written(model_path)
    model = checkpoint.load(model_path).to(dev)
    check_has_head(model, model_path, "evaluate")
    bundle = model_data(model, data, split, cache_dir, download)
    check_data(model_path, bundle.identity, "evaluate", own)
    precision = inference_precision(model, precision, dev, model_path)  # auto: the run's own, else the rule
    model = cast_for_inference(model, precision)
    heads = evaluate_images(model, bundle.test.images, bundle.test.labels, bundle.classes, data,
                            Options(batch_size, precision, tta, tta_translate), bundle.num_train, model_path)
    names = class_names(model)
    m = heads["logits"]
    result = EvalSummary(model=str(model_path), data=bundle.name, tta=tta, heads=heads, top1=m["top1"],
                         top5=m["top5"], per_class=m["per_class"], tta_translate=tta_translate, precision=precision)
    if out is not None:
        out = Path(out)
        write_summary(out, result)
        from ..runs.figures import plot_confusion  # matplotlib, for this figure only: predict starts without it
        plot_confusion(m["confusion"], names, out / CONFUSION_PNG,
                       title=f"{Path(model_path).name} on {bundle.name}: top-1 {100 * result.top1:.2f}%")
    return result.to_dict()
