"""``vitlab.inspect``: what ``vitlab inspect`` does, from Python. It loads the model (a folder, or a module as it
is), chooses the images (files, or a data set's test split taken class by class), the precision and the output
folder, and hands them to ``report.inspect_model``; the command line only parses its options and calls it."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import load
from ..data.augment import normalize
from ..data.sources import read_image
from ..data.views import Preprocess, balanced_order
from ..devices import autocast, resolve_device
from ..errors import VitlabError
from ..infer.precision import inference_precision
from ..runs.folder import check_model_written, claim_folder
from ..runs.format import PRETRAIN_WEIGHTS, read_config, read_split
from ..runs.identity import check_data
from . import report
from .capture import attention_modules
from .inspection import IMPORTANCE_IMAGES
from .rollout import HEAD_FUSIONS

DISTANCE_IMAGES = 128  # the mean attention distance averages over a sample of the split (was 512; more: ask)
NUM_IMAGES = 8


@dataclass
class InspectResult:
    """What ``inspect`` wrote: ``report`` (report.html, self-contained), ``out`` (its folder), ``files`` (the JSON
    files and figures written, by name), ``faithfulness`` (faithfulness.json's content; None for a model without a
    trained classifier, which has none) and ``summary`` (analysis.json's)."""

    report: Path
    out: Path
    files: list[str]
    faithfulness: dict | None
    summary: dict


@dataclass
class Chosen:
    """The images a report reads, uint8 at the model's input size: the shown ones and their names, labels and
    classes (None from files), the mean-distance set, and the faithfulness set with its labels (None: the shown)."""

    shown: torch.Tensor
    names: list[str]
    labels: list[int] | None
    class_names: list[str] | None
    distance: torch.Tensor
    faithfulness: torch.Tensor | None = None
    faithfulness_labels: list[int] | None = None


def inspect(model: str | os.PathLike | nn.Module, data: str | os.PathLike | None = None, *,
            images: Sequence[str | os.PathLike] | None = None, out: str | os.PathLike | None = None,
            num_images: int = NUM_IMAGES, distance_images: int = DISTANCE_IMAGES, faithfulness_images: int = 0,
            importance_images: int = IMPORTANCE_IMAGES, curve_steps: int = 16, explorer_images: int = 4,
            head_fusion: str = "mean", discard_ratio: float = 0.9,
            batch_size: int = 64, precision: str = "auto", device: str | None = None, cache_dir: str | None = None,
            download: bool = False) -> InspectResult:
    """The ViT paper's analyses of a model as ``vitlab inspect`` writes them: the figures, faithfulness.json,
    analysis.json and one self-contained report.html in ``out`` (default ``inspect_<model folder name>``).

    model: a folder ``vitlab.load`` reads (a run: its own test split, precision and pre-training objective), or a
    module, analysed where it is (``device`` moves it). data: a source whose test split is shown, taken class by
    class (as ``vitlab inspect --data``; default: a run's own, or the embedded digits for an 8x8 one-channel
    model); or ``images``: image files. num_images are shown; the mean attention distance averages over
    distance_images of the split, head importance over the first importance_images of them; faithfulness_images
    > 0 measures the faithfulness scores over that many (else over the shown ones). precision: auto, fp32, bf16 or
    fp16; device: auto, cpu or cuda. Every refusal is one line (a VitlabError) naming the option and what it takes.

    Example::

        micro = vitlab.fit("vit_micro_patch2_8", "digits", epochs=5)        # a small run on the embedded digits
        found = vitlab.inspect(micro.out, num_images=4, distance_images=64)  # or a module: inspect(micro.model)
        found.report, found.files, found.faithfulness["methods"]["relevance"]["deletion_auc"]
    """
    check_options(num_images, distance_images, importance_images, faithfulness_images, curve_steps, explorer_images,
                  head_fusion, discard_ratio, batch_size)
    if images is not None and data is not None:
        raise VitlabError("give data or images, not both; accepted: data=SET (its test split) or images=[FILE, ...]")
    if faithfulness_images and data is None:
        raise VitlabError("faithfulness_images needs data=SET: the perturbation test runs over a test split")
    folder = None if isinstance(model, nn.Module) else os.fspath(model)
    called = Path(folder).resolve().name if folder else model_name(model)
    out = Path(out) if out is not None else Path(f"inspect_{called}")
    with claim_folder(out, "inspect"):  # refusals name the option as the command line does (--out)
        started = time.time() - 1  # the files written from here on (mtimes of whole seconds included)
        module, objective = prepared(model, folder, device)
        cfg = module.pretrained_cfg
        chosen = choose_images(module, folder, data, images, num_images, distance_images, faithfulness_images,
                               cache_dir, download)
        precision = inference_precision(module, precision, next(module.parameters()).device,
                                        folder if objective is None else None)
        mean, std = cfg["mean"], cfg["std"]
        title = f"vitlab inspect: {called}" + (f" ({module.arch})" if folder and getattr(module, "arch", None) else "")
        faith = None if chosen.faithfulness is None else normalize(chosen.faithfulness, mean, std)
        with autocast(next(module.parameters()).device, precision):  # a bf16 model's report: what it computes
            page = report.inspect_model(
                module, normalize(chosen.shown, mean, std), out, image_names=chosen.names, labels=chosen.labels,
                class_names=chosen.class_names, distance_images=normalize(chosen.distance, mean, std),
                head_fusion=head_fusion, discard_ratio=discard_ratio, batch_size=batch_size,
                faithfulness_images=faith, faithfulness_labels=chosen.faithfulness_labels, curve_steps=curve_steps,
                importance_images=importance_images, explorer_images=explorer_images, objective=objective,
                title=title)
    return written(page, out, started)


def check_options(num_images: int, distance_images: int, importance_images: int, faithfulness_images: int,
                  curve_steps: int, explorer_images: int, head_fusion: str, discard_ratio: float,
                  batch_size: int) -> None:
    """One line naming the first option out of its range, and the range."""
    for option, value, low in (("num_images", num_images, 1), ("distance_images", distance_images, 1),
                               ("importance_images", importance_images, 1),
                               ("faithfulness_images", faithfulness_images, 0), ("curve_steps", curve_steps, 1),
                               ("explorer_images", explorer_images, 1), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise VitlabError(f"{option} {value!r} is not valid; accepted: an integer >= {low}")
    if head_fusion not in HEAD_FUSIONS:
        raise VitlabError(f"head_fusion {head_fusion!r} is not valid; accepted: {', '.join(HEAD_FUSIONS)}")
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, (int, float)) or not 0 <= discard_ratio < 1:
        raise VitlabError(f"discard_ratio {discard_ratio!r} is not valid; accepted: a number in [0, 1)")


def model_name(model: nn.Module) -> str:
    """A module's name for a folder and a title: its registered architecture, else its class."""
    return getattr(model, "arch", None) or type(model).__name__


def prepared(model: str | os.PathLike | nn.Module, folder: str | None,
             device: str | None) -> tuple[nn.Module, nn.Module | None]:
    """The model to analyse on its device, and a pre-training run's objective around it (None for any other)."""
    if folder is None:
        module, objective = model, None
        if device is not None:
            module = module.to(resolve_device(device))
    else:
        where = resolve_device(device or "auto")
        check_model_written(folder)
        objective = pretraining_objective(folder)  # a pre-training run: its encoder, and its own section
        module = load(folder).to(where) if objective is None else objective.to(where).encoder
    try:
        if not getattr(module, "no_attention", ""):
            attention_modules(module)
    except ValueError as e:
        raise VitlabError(f"{folder or model_name(module)}: {e}") from None
    return module, objective


def pretraining_objective(folder: str) -> nn.Module | None:
    """A pre-training run's objective (encoder + decoder), or None for any other model folder."""
    folder_path = Path(folder)
    if not folder_path.is_dir() or (read_config(folder_path).get("pretrain") in (None, "none")
                                    and not (folder_path / PRETRAIN_WEIGHTS).is_file()):
        return None
    from ..objectives import load_objective
    return load_objective(folder)


def choose_images(model: nn.Module, folder: str | None, data: str | os.PathLike | None,
                  images: Sequence[str | os.PathLike] | None, num_images: int, distance_images: int,
                  faithfulness_images: int, cache_dir: str | None, download: bool) -> Chosen:
    """The files given, or the test split of ``data`` (a run's own, or the digits for an 8x8 one-channel model) in
    a balanced order: the first num_images are shown, the first distance_images and faithfulness_images measured."""
    cfg = model.pretrained_cfg
    input_size = tuple(int(s) for s in cfg["input_size"])
    fit = Preprocess.from_cfg(cfg).fit  # images are prepared by the model's own rule, as predict does
    if images is not None:
        if isinstance(images, (str, os.PathLike)) or not len(images):
            raise VitlabError(f"images={images!r} is not valid; accepted: a list of one or more image files")
        C, H, W = input_size
        every = torch.stack([read_image(f, (H, W), C, fit) for f in images])
        return Chosen(every[:num_images], [Path(f).name for f in images[:num_images]], None, None, every)
    source = os.fspath(data) if data is not None else read_split(folder).get("data") if folder else None
    if source is None:
        if input_size != (1, 8, 8):
            raise VitlabError(f"{folder or 'the model'} takes {'x'.join(map(str, input_size))} images: give "
                              "--images FILE... or --data SET (from Python images=[FILE, ...] or data=SET; a set: "
                              "digits, cifar10, an image folder or a .tar.gz)")
        source = "digits"  # the embedded 8x8 digits fit a 1-channel 8x8 model
    split = read_split(folder) if folder else {}  # a run folder: its own test split
    split = {k: v for k, v in split.items() if k != "data" and not (k == "test_data" and data is not None)}
    from ..data import load_data
    bundle = load_data(source, img_size=input_size[1:], in_chans=input_size[0], cache_dir=cache_dir,
                       download=download, fit=fit, **split)
    if folder:
        check_data(folder, bundle.identity, "inspect", own=data is None)
    test, labels = bundle.test.images, bundle.test.labels
    if len(test) == 0:
        raise VitlabError(f"the test split of {source!r} is empty")
    if faithfulness_images > len(test):
        raise VitlabError(f"faithfulness_images {faithfulness_images} is more than the {len(test)} test images of "
                          f"{source!r}; accepted: at most {len(test)}")
    # test splits are often sorted by class: take the images with the classes in turn (a seeded order)
    pick = balanced_order(labels)[:max(faithfulness_images, distance_images, num_images)]
    rows, where = pick.sort()  # read the rows in file order (a mapped store), then put them in pick's order
    test, labels = test[rows][torch.argsort(where)], labels[pick]
    classes = list(bundle.classes) if len(bundle.classes) == getattr(model, "num_classes", None) else None
    shown = test[:num_images]  # the data set's classes name the model's only where they are as many
    return Chosen(shown, [f"{Path(source).name} test #{int(i)}" for i in pick[:len(shown)]],  # short, for titles
                  labels[:num_images].tolist(), classes, test[:distance_images],
                  test[:faithfulness_images] if faithfulness_images else None,
                  labels[:faithfulness_images].tolist() if faithfulness_images else None)


def written(page: Path, out: Path, started: float) -> InspectResult:
    """The result of a report written in ``out`` since ``started``: the files of this run, not an earlier one's."""
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".png") and p.stat().st_mtime >= started)
    faith = out / "faithfulness.json"
    return InspectResult(page, out, files,
                         json.loads(faith.read_text()) if "faithfulness.json" in files else None,
                         json.loads((out / "analysis.json").read_text()))
