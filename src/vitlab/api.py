"""vitlab from Python: ``fit``, ``pretrain``, ``evaluate``, ``predict``, ``explain`` and ``inspect``.

Each is a thin caller of what the command line calls (``vitlab train``, ``pretrain``, ``eval``, ``predict``,
``inspect``): the same recipe with the same defaults, the same trainer writing the same run folder, the same
evaluation and the same preprocessing. A notebook gets back what it shows next: the trained model, its history,
its figures.
"""
from __future__ import annotations

import inspect as introspect
import os
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from . import progress
from .analysis.inspect_api import InspectResult, inspect
from .checkpoint import load, save
from .data.arrays import hold_out_last, is_arrays, split_arrays, store_arrays
from .data.augment import normalize
from .devices import PREDICT_BATCH, to_device
from .errors import NotFoundError, VitlabError
from .infer.eval import Options, evaluate_folder, evaluate_images, model_data
from .infer.precision import inference_precision
from .infer.predict import (
    check_batch_size,
    check_has_head,
    class_names,
    class_probabilities,
    decode_images,
    is_grey_batch,
)
from .models import list_models
from .runs.figures import confusion_figure, curves_figure
from .runs.folder import LOCK, STARTED, check_model_written, new_run_folder
from .runs.format import (
    CHECKPOINT,
    CONFIG_YAML,
    METRICS,
    SUMMARY,
    check_out_dir,
    is_finished,
    read_config,
    read_history,
    read_summary,
)
from .runs.identity import ON_RESUME
from .train.auto import AUTO, auto_values
from .train.recipe import (
    AUGMENT_FIELDS,
    FIELDS,
    PRETRAIN_DEFAULTS,
    SECTIONS,
    SUPERVISED_ONLY,
    Recipe,
    check_given,
    default_words,
    field_default,
    load_recipe,
    make_recipe,
    recipe_values,
)
from .train.trainer import train

__all__ = ["FitResult", "InspectResult", "evaluate", "explain", "fit", "inspect", "predict", "pretrain"]

ModelLike = str | os.PathLike | nn.Module  # a registered name, a folder (or hf-hub: id), or a module


@dataclass
class FitResult:
    """A finished run, read back from its folder: ``model`` (trained, in eval mode), ``history`` (one dict per
    epoch, as metrics.jsonl), ``history_dict`` (the same as lists, as Keras's ``History.history``), ``summary``
    (summary.json), ``out`` (the run folder), and its figures."""

    out: Path
    model: nn.Module
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    _confusion: list | None = field(default=None, repr=False)

    @classmethod
    def read(cls, out: str | os.PathLike) -> FitResult:
        """The result of the finished run in ``out``."""
        out = Path(out)
        return cls(out, load(out).eval(), [row.to_dict() for row in read_history(out)], read_summary(out).to_dict())

    @property
    def history_dict(self) -> dict[str, list[Any]]:
        """The history as one list a metric, one value an epoch (None where an epoch has none: not evaluated), in
        Keras's ``History.history`` shape: vitlab's names (``train_loss``, ``test_top1``, ``lr``, ...) and Keras's
        (``loss``, ``accuracy``, ``val_loss``, ``val_accuracy``: train_loss, train_acc, test_loss, test_top1)."""
        names = list(dict.fromkeys(k for row in self.history for k in row))
        lists = {k: [row.get(k) for row in self.history] for k in names}
        keras = {"loss": "train_loss", "accuracy": "train_acc", "val_loss": "test_loss", "val_accuracy": "test_top1"}
        return {**{k: lists[v] for k, v in keras.items() if v in lists}, **lists}

    def plot(self) -> Figure:
        """Loss and accuracy against epoch, train and test (the run's curves.png)."""
        return curves_figure(read_history(self.out), f"{self.summary['model']} on {self.summary['data']}")

    def confusion(self) -> Figure:
        """The confusion matrix of the trained model on the run's test split (the run's confusion.png)."""
        if self.summary.get("top1") is None:
            raise VitlabError(f"{self.out} is a pre-training run ({self.summary.get('pretrain')}): it has no classes "
                              "to confuse; accepted: a supervised run")
        if self._confusion is None:
            self._confusion = evaluate(self.out)["confusion"]
        return confusion_figure(self._confusion, self.summary["classes"],
                                f"{self.summary['model']} on {self.summary['data']}: test top-1 "
                                f"{100 * self.summary['top1']:.2f}%")


def fit(model: ModelLike | None = None, data: Any = None, *, out: str | os.PathLike | None = None,
        resume: str | os.PathLike | None = None, class_names: Sequence[str] | None = None,
        validation_split: float | None = None, validation_data: Any = None, **options: Any) -> FitResult:
    """Train ``model`` on ``data`` as ``vitlab train`` does, into a run folder; returns its ``FitResult``.

    model: None (or "auto"): chosen for the data, the machine and the budget by the rule table of measured recipes
    (``vitlab/train/auto.yaml``; one logged line says what and why, ``result.summary["auto"]`` keeps it), the
    options given by name winning; a registered name (``vitlab.list_models()``); a module from ``create_model``
    or ``load``, which is trained in place, as Keras's ``model.fit`` trains its model: it ends with the trained
    weights and is the result's ``model``, so a second ``fit`` of it goes on from where the first ended (the
    weights it started from are kept beside the run as ``<out>.init``, the run's ``init``); or a run or model
    folder (``--init``).
    data: any source ``vitlab train --data`` reads ("digits", "cifar10", an image folder, ...), or NumPy arrays in
    Keras's layout, ``((x_train, y_train), (x_test, y_test))``: images (N, H, W, C), or (N, H, W) as one channel
    (Keras's MNIST), uint8 or floats in [0, 1] or [0, 255] (converted, said in the log); labels (N,) or (N, 1) of
    class indices, or one-hot (N, C) (``to_categorical``'s). ``(x, y)`` alone holds out ``val_fraction`` of each
    class, drawn at random, as the test split; or, given ``validation_split``, the LAST share of the arrays as
    Keras's ``fit(validation_split=...)`` does (taken before any shuffling: ``x[:k]`` trains and ``x[k:]`` is the
    test split, ``k = floor(N * (1 - validation_split))``); ``validation_data=(x_test, y_test)`` beside ``(x, y)`` is
    the test split, as Keras's. ``class_names`` names the arrays' classes ("0".."K-1" without). options: every
    recipe field by name, listed below with the command line's defaults (``vitlab train --help``). out: the run
    folder (default ``runs/<model>-<time>``). resume: a run folder to continue (with only the options a resume may
    change, e.g. a larger ``epochs``). Stopped by an interrupt (Ctrl-C, the notebook's stop button), the run keeps
    its last finished epoch for ``fit(resume=...)``; a module given stays as it was.

    Example::

        (x, y), (x_test, y_test) = keras.datasets.cifar10.load_data()   # or any uint8 arrays
        result = vitlab.fit(data=((x, y), (x_test, y_test)), time_budget=10)   # the recipe chosen for 10 min
        result.plot()                       # the curves; result.confusion(): the confusion matrix
        result.history_dict["test_top1"], result.summary["top1"], result.out
        vitlab.fit(resume=result.out, time_budget=15)                   # five minutes more
    """
    if resume is not None:
        if (model is not None or data is not None or out is not None or class_names is not None
                or validation_split is not None or validation_data is not None):
            raise VitlabError("fit(resume=RUN) goes on with the run's own model, data and folder; accepted with "
                              f"resume: {', '.join(ON_RESUME)}")
        recipe = resumed_recipe(resume, checked(options))
        reopen(Path(resume), options)
        return train_recipe(recipe, resume=True)
    if model is None and options.get("init") is not None:
        model = options.pop("init")  # the folder to fine-tune, named as the recipe names it
    if data is None:
        raise VitlabError("fit needs data, e.g. vitlab.fit(data='digits') (the model chosen for it) or "
                          "vitlab.fit('vit_micro_patch2_8', 'digits'); or resume=RUN to continue a run")
    if validation_data is not None:
        data = with_test_split(data, validation_data, validation_split)
    if validation_split is not None:
        data = hold_out_last(data, validation_split)
    result = train_recipe(new_recipe(model, data, out, class_names, checked(options)), resume=False)
    if isinstance(model, nn.Module):
        result.model = adopt(model, result.model)
    return result


def pretrain(model: ModelLike | None = None, data: Any = None, *, method: str = "mae",
             out: str | os.PathLike | None = None, resume: str | os.PathLike | None = None,
             **options: Any) -> FitResult:
    """Self-supervised pre-training as ``vitlab pretrain --method METHOD``: ``fit`` with the objective ``method``
    (mae, mpp, dino, ibot, or distill with ``teacher=MODEL``) and pre-training's defaults; labels, where the data
    has them, are not used.

    Example::

        encoder = vitlab.pretrain("vit_micro_patch2_8", "digits", method="mae", epochs=50)
        result = vitlab.fit(encoder.out, "digits", epochs=20)          # fine-tune the encoder
    """
    if resume is not None:
        return fit(resume=resume, **options)
    return fit(model, data, out=out, pretrain=method, **options)


def evaluate(model: ModelLike, data: Any = None, *, batch_size: int | None = None, precision: str = "auto",
             tta: bool = False, tta_translate: int = 0, cache_dir: str | None = None,
             download: bool = False) -> dict[str, Any]:
    """Metrics of a model on a test split: ``top1``, ``top5``, ``loss``, ``per_class`` (top-1 by class name),
    ``confusion`` (counts, true x predicted), ``count``, and ``heads`` (each head's, for a distilled model).

    model: a module, or a run or model folder (a run is evaluated on its own test split when ``data`` is None).
    data: a source (as ``vitlab eval --data``), or arrays: ``(x_test, y_test)`` or Keras's pair, whose test part
    is used. Images are brought to the model's input by its own preprocessing.

    Example::

        metrics = vitlab.evaluate(result.model, (x_test, y_test))
        metrics["top1"], metrics["per_class"]
    """
    options = Options(batch_size, precision, tta, tta_translate)
    if not isinstance(model, nn.Module) and not is_arrays(data):
        found = evaluate_folder(model, None if data is None else os.fspath(data), batch_size=batch_size,
                                precision=precision, cache_dir=cache_dir, download=download, tta=tta,
                                tta_translate=tta_translate)
        return {**found["heads"]["logits"], "heads": found["heads"], "data": found["data"]}
    module = loaded(model)
    check_has_head(module, "the model" if isinstance(model, nn.Module) else model, "evaluate")
    if is_arrays(data):
        train, test = split_arrays(data, say)
        x, y = test if test is not None else train
        classes = class_names(module)
        if len(y) and int(y.max()) >= len(classes):
            raise VitlabError(f"the labels hold {int(y.max())}, the model predicts {len(classes)} classes; accepted: "
                              f"labels 0..{len(classes) - 1}")
        heads = evaluate_images(module, torch.from_numpy(x), torch.from_numpy(y), classes, "the arrays", options)
        return {**heads["logits"], "heads": heads, "data": "arrays"}
    if data is None:
        raise VitlabError("a model in memory has no test split of its own: give data (a source or arrays)")
    bundle = model_data(module, os.fspath(data), cache_dir=cache_dir, download=download)
    heads = evaluate_images(module, bundle.test.images, bundle.test.labels, bundle.classes, os.fspath(data), options,
                            bundle.num_train)
    return {**heads["logits"], "heads": heads, "data": bundle.name}


def predict(model: ModelLike, images: Any, *, batch_size: int = PREDICT_BATCH, precision: str = "auto") -> np.ndarray:
    """Class probabilities, an (N, classes) array, for image files, PIL images or arrays ((H, W, C) one image,
    (N, H, W, C) or, one channel, (N, H, W) several; uint8, or floats in [0, 1] or [0, 255]), each prepared by the
    model's own preprocessing (as ``vitlab predict``); ``precision`` as ``vitlab predict --precision`` (auto: a run
    folder's own, else bf16 where it pays for the model).

    Example::

        probs = vitlab.predict(result.model, x_test[:8])      # or "cat.png", or [PIL.Image.open(...)]
        probs.argmax(1)                                        # class indices; vitlab names: model.pretrained_cfg
    """
    batch_size = check_batch_size(batch_size)
    module = classifier(model)
    folder = None if isinstance(model, nn.Module) else model
    precision = inference_precision(module, precision, next(module.parameters()).device, folder)
    grey = module.pretrained_cfg["input_size"][0] == 1  # (N, H, W): several one-channel images, as Keras's MNIST
    many = isinstance(images, (list, tuple)) or (isinstance(images, (np.ndarray, torch.Tensor)) and (
        images.ndim == 4 or grey and is_grey_batch(np.asarray(images))))
    items = images if many else [images]
    if not len(items):
        decode_images(items, module.pretrained_cfg)  # the one line for no images
    # decoded a batch at a time, as `vitlab predict` does: memory stays that of one batch however many files
    return torch.cat([class_probabilities(module, decode_images(items[i:i + batch_size], module.pretrained_cfg),
                                          precision=precision).cpu()
                      for i in range(0, len(items), batch_size)]).numpy()


def explain(model: ModelLike, image: Any, method: str = "rollout", *, target_class: int | None = None,
            token: str = "cls") -> np.ndarray:
    """The relevance map ``vitlab inspect`` draws, (grid_h, grid_w) over the model's patches (high = relevant,
    maximum 1), of one image (a file, a PIL image or a uint8 (H, W, C) array), or (N, grid_h, grid_w) of several;
    ``method`` one of ``vitlab.analysis.explain.METHODS``; ``target_class`` (default: the predicted class) for the
    class-specific ones.

    Example::

        heat = vitlab.explain(result.model, x_test[0], method="relevance")   # (grid_h, grid_w)
    """
    from .analysis.explain import explain as explain_map  # the analysis code, loaded by its first use only
    module = classifier(model)
    x = decode_images(image, module.pretrained_cfg)
    cfg, dev = module.pretrained_cfg, next(module.parameters()).device
    target = class_probabilities(module, x).argmax(1) if target_class is None else target_class
    maps = explain_map(module.eval(), normalize(to_device(x, dev), cfg["mean"], cfg["std"]), method, target, token)
    maps = maps.detach().float().cpu().numpy()
    array = np.asarray(image) if isinstance(image, (np.ndarray, torch.Tensor)) else None
    one = not isinstance(image, (list, tuple)) and not (array is not None and (array.ndim == 4 or
                                                                               is_grey_batch(array)))
    return maps[0] if one else maps


# --- what fit hands the trainer ---


def adopt(module: nn.Module, trained: nn.Module) -> nn.Module:
    """``module``, the one given to ``fit``, made the ``trained`` model in place: its tensors take the trained values
    (the same tensor objects, where the run kept every shape), or, where the run changed its layers (a new head for
    the data's classes, another input size), its layers become the run's; its config (classes, preprocessing) is the
    run's. A module of another class (which a run from a module never builds) is left as it was, ``trained``
    returned."""
    if type(module) is not type(trained):
        return trained
    own, new = module.state_dict(), trained.state_dict()
    if own.keys() == new.keys() and all(own[k].shape == new[k].shape for k in own):
        with torch.no_grad():
            module.load_state_dict(new)
        kept = {"_parameters", "_buffers", "_modules"}
        module.__dict__.update({k: v for k, v in trained.__dict__.items() if k not in kept and not k.startswith("_")})
        module.to(next(trained.parameters()).device)
    else:
        module.__dict__.update(trained.__dict__)
    return module.eval()


def with_test_split(data: Any, test: Any, split: float | None) -> tuple[Any, Any]:
    """Keras's ``fit((x, y), validation_data=(x_test, y_test))`` as vitlab's pair of pairs (one line when the data
    is not arrays ``(x, y)`` alone, or ``validation_split`` is given too)."""
    if split is not None:
        raise VitlabError("validation_data and validation_split both name the test split; accepted: one of them")
    if not is_arrays(data) or len(data) != 2 or all(is_arrays(part) for part in data) or not is_arrays(test):
        raise VitlabError("validation_data=(x_test, y_test) is the test split of arrays (x, y); accepted with it: data "
                          "(x, y), not ((x_train, y_train), (x_test, y_test)) nor a source")
    return data, test


def options_signature(function: Callable, names: Sequence[str], default: Callable[[str], Any]) -> introspect.Signature:
    """``function``'s own arguments, then the recipe fields ``names`` it takes as options, each a keyword with its
    default (``default``, from the one declaration in train/recipe.py): what ``help()`` and a notebook's completion
    show instead of ``**options``."""
    own = list(introspect.signature(function).parameters.values())[:-1]  # without **options
    taken = {p.name for p in own}
    fields = [introspect.Parameter(name, introspect.Parameter.KEYWORD_ONLY, default=default(name),
                                annotation=option_annotation(name)) for name in names if name not in taken]
    return introspect.Signature([*own, *fields], return_annotation=FitResult)


def option_default(name: str) -> Any:
    """The general default of a recipe or augmentation field (a data set may have its own: ``default_words``)."""
    if name == "augment":
        return None  # the augmentation fields by name, or a mapping of them
    return (FIELDS.get(name) or AUGMENT_FIELDS[name]).get_default(call_default_factory=True)


def pretrain_default(name: str) -> Any:
    """A field's default in pre-training (MAE's where it has its own; the lr follows the batch: None here)."""
    if name in ("augment", "lr"):
        return None
    return PRETRAIN_DEFAULTS[name] if name in PRETRAIN_DEFAULTS else field_default(name)


def pretrain_options() -> list[str]:
    """The recipe fields ``pretrain`` takes as options: all but the supervised-only (distill's teacher aside)."""
    return [n for n in [*FIELDS, *AUGMENT_FIELDS]
            if n not in ("pretrain", "auto") and (n not in SUPERVISED_ONLY or n == "teacher")]


def option_annotation(name: str) -> Any:
    info = FIELDS.get(name) or AUGMENT_FIELDS[name]
    return dict[str, Any] | None if name == "augment" else info.annotation


def options_doc(taken: Sequence[str] = (), title: str = "every recipe field") -> str:
    """The options section of a docstring: the recipe fields (but those in ``taken``) by section, each's default
    (with a data set's own and pre-training's) and what it does, from the declarations themselves."""
    lines = ["", f"    Options ({title}, by name; a data set's own defaults where it has them):", ""]
    for section, names in SECTIONS.items():
        names = [n for n in names if n not in ("data", "out", "augment", "auto", *taken)]
        if names:
            lines.append(f"    {section}:")
        for name in names:
            info = FIELDS.get(name) or AUGMENT_FIELDS[name]
            words = f"{name}: {info.description or ''} ({default_words(name)})"
            lines += textwrap.wrap(words, 116, initial_indent="        ", subsequent_indent="            ",
                                   break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def loaded(model: ModelLike) -> nn.Module:
    """A module as it is, or the model of a folder (an unfinished run's refused in one line, as by vitlab predict)."""
    if isinstance(model, nn.Module):
        return model
    check_model_written(model)
    return load(model)


def classifier(model: ModelLike) -> nn.Module:
    """A module, or the model of a folder, that has a classifier head (one line otherwise)."""
    module = loaded(model)
    if getattr(module, "num_classes", 0) == 0:
        raise VitlabError("the model has no classifier head (a pre-trained encoder): nothing to predict; accepted: a "
                          "classifier, e.g. one fine-tuned with vitlab.fit(ENCODER_RUN, data)")
    return module


def checked(options: dict[str, Any]) -> dict[str, Any]:
    """The options, each a recipe field (one line naming the unknown ones and listing the accepted)."""
    unknown = sorted(set(options) - set(FIELDS) - set(AUGMENT_FIELDS) | {"auto"} & set(options))
    if unknown:
        raise VitlabError(f"unknown option(s) {', '.join(unknown)}; accepted: {', '.join(accepted_options())}")
    return options


def accepted_options() -> list[str]:
    return [n for n in [*FIELDS, *AUGMENT_FIELDS] if n not in ("augment", "out", "auto")]


def new_recipe(model: ModelLike, data: Any, out: str | os.PathLike | None, names: Sequence[str] | None,
               options: dict[str, Any]) -> Recipe:
    """The recipe of a new run: the model as a name or as ``init``, the data as a source, the folder."""
    if {"model", "init", "data"} & {k for k, v in options.items() if v is not None}:
        raise VitlabError(f"{', '.join(sorted({'model', 'init', 'data'} & set(options)))}: given as fit's model and "
                          "data arguments, not as options")
    auto = model is None or (isinstance(model, str) and model == AUTO)
    folder = Path(out) if out is not None else new_run_folder("auto" if auto else run_name(model))
    start = folder.with_name(folder.name + ".init").absolute()  # where a module is saved to start from
    values = {**options, **({} if auto else model_values(model, start))}
    if names is not None and not is_arrays(data):
        raise VitlabError("class_names names the classes of arrays; a data source names its own")
    values["data"] = "arrays" if is_arrays(data) else os.fspath(data)
    # every option checked before anything is written
    checked_recipe = load_recipe(None, strict=not auto, out=str(folder), **values)
    check_new_folder(folder)
    if is_arrays(data):
        values["data"] = str(store_arrays(data, class_names=names, cache_dir=checked_recipe.cache_dir,
                                          val_fraction=checked_recipe.val_fraction, seed=checked_recipe.seed, log=say))
    if isinstance(model, nn.Module):
        save_start(model, start)
    if auto:  # the model, schedule and augmentation the rule table chooses for the data (train/auto.py)
        said: list[str] = []  # the choice's line, said once the options given are known to be used
        values = auto_values(recipe_values(None, out=None if out is None else str(folder), **values), said.append)
        if out is None:
            values["out"] = str(new_run_folder(values["model"]))
        recipe = make_recipe(values)
        check_given(recipe, None, options)  # an option given that the chosen recipe would not use
        for line in said:
            say(line)
        return recipe
    return load_recipe(None, out=str(folder), **values)


def model_values(model: ModelLike, start: Path) -> dict[str, str]:
    """The recipe values that name the model: a registered name, or ``init`` (a folder, an hf-hub: id, or the
    folder ``start`` where a module is saved)."""
    if isinstance(model, nn.Module):
        return {"init": str(start)}
    if str(model) in list_models():
        return {"model": str(model)}
    if str(model).startswith("hf-hub:") or Path(model).is_dir():
        return {"init": os.fspath(model)}
    raise VitlabError(f"model {str(model)!r} is neither a registered name (vitlab.list_models()) nor a run or model "
                      "folder; accepted: a name, a module from vitlab.create_model or vitlab.load, a folder or an "
                      "hf-hub: id")


def run_name(model: ModelLike) -> str:
    """What a run folder of the model is named after: its registered name, or its folder's name."""
    if isinstance(model, nn.Module):
        return getattr(model, "arch", None) or type(model).__name__
    return Path(str(model)).name


def check_new_folder(folder: Path) -> None:
    """Refuse, before anything is written for it, a folder a new run may not take: a finished or unfinished run, or
    files a run did not write (the trainer refuses them too, but only once the module to start from is saved)."""
    if not folder.is_dir():
        return
    check_out_dir(folder, resume=False)
    others = sorted(p.name for p in folder.iterdir() if p.name not in (*STARTED, LOCK))
    if others:
        raise VitlabError(f"{folder} holds files that vitlab train did not write ({', '.join(others[:3])}); accepted: "
                          "a new or empty out")


def save_start(model: nn.Module, folder: Path) -> Path:
    """Save a module to start a run from, as ``<out>.init`` beside the run folder (the run's ``init``)."""
    if folder.exists():
        raise VitlabError(f"{folder} exists: the module to train would be saved there; accepted: another out")
    return save(model, folder)


def resumed_recipe(folder: str | os.PathLike, given: dict[str, Any], refused: Sequence[str] = (),
                   named: Callable[[str], str] = str) -> Recipe:
    """The recipe that continues the unfinished run in ``folder``: its config.yaml, with the options ``given`` that
    a resume honours (another length: epochs, no fewer than those done; a time budget, shorter or longer, also for
    a run that had none: the rest of the schedule is laid over it); any other, and those ``refused``, are refused
    in one line that names them as the caller does (``named``: an option's name, e.g. its flag)."""
    folder = Path(folder)
    if not (folder / CONFIG_YAML).is_file():
        raise NotFoundError(f"{folder} is not a run folder: it has no {CONFIG_YAML}")
    read_config(folder)  # a config.yaml edited or damaged: one line naming it, before any option is weighed
    given = {k: v for k, v in given.items() if v is not None}
    changed = [named(n) for n in given if n not in ON_RESUME] + list(refused)
    if changed:
        raise VitlabError(f"{', '.join(changed)} cannot change on {named('resume')}; accepted with {named('resume')}: "
                          f"{', '.join(named(n) for n in ON_RESUME)}")
    done = len(read_history(folder)) if (folder / METRICS).is_file() else 0
    if given.get("epochs") is not None and not _number(given["epochs"]) >= max(done, 1):
        raise VitlabError(f"{named('epochs')} {given['epochs']!r} is not valid on {named('resume')}; accepted: a "
                          f"number >= {max(done, 1)} (the epochs done)")
    if given.get("time_budget") is not None and not _number(given["time_budget"]) > 0:
        raise VitlabError(f"{named('time_budget')} {given['time_budget']!r} is not valid on {named('resume')}; "
                          "accepted: minutes > 0 (fewer than trained: the run ends with its final evaluation)")
    return load_recipe(folder / CONFIG_YAML, strict=True, out=str(folder), **given)


def reopen(folder: Path, options: dict[str, Any]) -> None:
    """A finished run given more epochs (or a time budget) to go on: its summary.json, which marks it finished, is
    kept as ``summary-epoch<N>.json`` and the run continues from its last checkpoint (its model and summary are then
    the longer run's). A finished run given nothing more is left for the trainer to refuse."""
    if not is_finished(folder) or not (folder / CHECKPOINT).is_file():
        return
    done = len(read_history(folder))
    if not (options.get("epochs") is not None and int(options["epochs"]) > done or options.get("time_budget")):
        return
    kept = folder / f"summary-epoch{done}.json"
    if kept.exists():
        raise VitlabError(f"{kept} exists: the finished run's summary would be kept there; accepted: a run folder "
                          "without it")
    (folder / SUMMARY).rename(kept)
    say(f"{folder} was finished after {done} epochs: going on (its summary kept as {kept.name})")


def _number(value: Any) -> float:
    """The number a text is, NaN when it is none (which no bound accepts)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def say(line: str) -> None:
    """A line of a run's log, as the progress bar lets it through (looked up when called)."""
    progress.log_line(line)


def train_recipe(recipe: Recipe, resume: bool) -> FitResult:
    """Train the recipe (the command line's trainer) and read the run back; an interrupt leaves it resumable."""
    try:
        train(recipe, resume=resume, log=say)
    except KeyboardInterrupt:
        say(f"interrupted: {recipe.out} keeps its last finished epoch; continue it with "
            f"vitlab.fit(resume={recipe.out!r})")
        raise
    if recipe.pretrain != "none":
        from .probe.pretraining import judge_pretraining
        judge_pretraining(recipe.out, log=say)
    return FitResult.read(recipe.out)


fit.__signature__ = options_signature(fit, [n for n in [*FIELDS, *AUGMENT_FIELDS] if n != "auto"], option_default)
fit.__doc__ = (fit.__doc__ or "") + options_doc()
pretrain.__signature__ = options_signature(pretrain, pretrain_options(), pretrain_default)
pretrain.__doc__ = (pretrain.__doc__ or "") + options_doc(
    [n for n in [*FIELDS, *AUGMENT_FIELDS] if n not in pretrain_options()], "the recipe fields pre-training takes")
