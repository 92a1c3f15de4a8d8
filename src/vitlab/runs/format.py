"""The run folder, declared once: its file names, the typed rows of metrics.jsonl and the typed summary.json,
each with its writer and its reader side by side.

A run folder holds::

    config.yaml        the recipe as run (a `--resume` reads it back)
    run.json           the run's id, the identity and split of its data, its thread count (runs/identity.py)
    checkpoint.pt      everything needed to continue (train/state.py)
    metrics.jsonl      one EpochRow per line, rewritten after every epoch
    config.json, model.safetensors   the trained model (vitlab.checkpoint); of a pre-training run, its encoder
    pretrain.safetensors             a pre-training run's other tensors (the decoder), with the method and options
                                     (written and read in objectives/objective.py)
    curves.png, confusion.png        figures (runs/figures.py)
    summary.json       a Summary, written last: a folder without it is an unfinished run

A key that one part of vitlab writes and another reads is a field here, so a reader cannot ask for a
key that no writer sets: ``from_dict`` refuses a record that lacks a required field.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

from ..atomic import atomic_write_bytes, atomic_write_json, read_json_object
from ..checkpoint import CONFIG as MODEL_CONFIG
from ..checkpoint import WEIGHTS as MODEL_WEIGHTS
from ..checkpoint import load_plain
from ..errors import VitlabError

SUMMARY, METRICS, CONFIG_YAML, RUN_JSON = "summary.json", "metrics.jsonl", "config.yaml", "run.json"
CHECKPOINT = "checkpoint.pt"
ADAPTER_DIR = "adapter"  # a LoRA run's adapter (peft's files); the model folder holds it merged
CURVES_PNG, CONFUSION_PNG = "curves.png", "confusion.png"
PRETRAIN_WEIGHTS = "pretrain.safetensors"
CHECKPOINT_SHARDS = "checkpoint-shards-"  # + step and id: a sharded run's (--shard fsdp) model and optimizer parts
FILES = (CONFIG_YAML, RUN_JSON, CHECKPOINT, METRICS, MODEL_CONFIG, MODEL_WEIGHTS, PRETRAIN_WEIGHTS, CURVES_PNG,
         CONFUSION_PNG, SUMMARY)

T = TypeVar("T")


class RecipeValues(Protocol):
    """What the run folder reads of a recipe (train.recipe.Recipe): its values, and the model it names."""

    model: str | None

    def to_dict(self) -> dict[str, Any]: ...
OMIT = {"omit_if_none": True}  # a field left out of the file when it has no value (not written as null)


def _to_dict(record: Any) -> dict[str, Any]:
    """The record as the JSON object written to disk, in field order."""
    out = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.metadata.get("omit_if_none"):
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _from_dict(cls: type[T], data: dict[str, Any], where: str) -> T:
    """A record from its JSON object; a missing required field is an error, keys it does not know are ignored."""
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise VitlabError(f"{where} lacks {', '.join(missing)}: it was not written by this vitlab version")
    return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class EpochRow:
    """One line of metrics.jsonl: an epoch's training figures, and its test figures when it was evaluated."""

    epoch: int                    # epochs completed, from 1
    step: int                     # optimiser steps taken so far
    train_loss: float
    train_acc: float | None       # on the augmented training batches (None: pre-training, which has no labels)
    lr: float                     # the learning rate of the epoch's last step
    images_per_second: float      # training throughput of this epoch, all ranks together
    input_size: list[int] | None = field(default=None, metadata=OMIT)  # progressive resizing: the last size
    test_loss: float | None = field(default=None, metadata=OMIT)  # pre-training: the objective's held-out loss
    test_top1: float | None = field(default=None, metadata=OMIT)
    test_top5: float | None = field(default=None, metadata=OMIT)
    test_top1_cls: float | None = field(default=None, metadata=OMIT)   # distilled models: the class head
    test_top1_dist: float | None = field(default=None, metadata=OMIT)  # and the distillation head
    ema_test_top1: float | None = field(default=None, metadata=OMIT)   # the EMA weights' top-1
    elapsed_seconds: float = 0.0  # training time so far on the run's clock (from the first step)

    @property
    def evaluated(self) -> bool:
        return self.test_loss is not None

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochRow:
        return _from_dict(cls, data, METRICS)

    def line(self) -> str:
        """The one-line report of an epoch."""
        return (f"epoch {self.epoch}: loss {self.train_loss:.4f}"
                + (f" train acc {self.train_acc:.3f}" if self.train_acc is not None else "")
                + (f" test top-1 {self.test_top1:.4f}" if self.test_top1 is not None else
                   f" test loss {self.test_loss:.4f}" if self.test_loss is not None else "")
                + (f" (EMA {self.ema_test_top1:.4f})" if self.ema_test_top1 is not None else "")
                + f" lr {self.lr:.2e} {self.images_per_second:.0f} img/s")


def run_images_per_second(history: Sequence[EpochRow]) -> float | None:
    """A run's training throughput from its epochs: each epoch's rate weighted by its training time (its steps over
    its rate; the steps of a run are of one batch size), so that short fast epochs (progressive resizing's small
    inputs) count for the time they took, not as much as the slow ones. None for a run without epochs."""
    seconds, steps, before = 0.0, 0, 0
    for h in history:
        n = h.step - before
        before = h.step
        if n > 0 and h.images_per_second > 0:
            seconds, steps = seconds + n / h.images_per_second, steps + n
    return steps / seconds if steps else None


@dataclass
class Summary:
    """summary.json: the finished run's final test metrics, what it ran on and how long it took.

    A pre-training run (``pretrain`` names its method) has no labels to score: its top1, top5 and per_class are
    None and its test_loss is the objective's loss on the held-out images (masks drawn from a fixed seed).
    """

    top1: float | None
    top5: float | None
    test_loss: float
    per_class: dict[str, float] | None  # test top-1 of each class, by class name
    images_per_second: float      # over the run: the epochs' rates weighted by their time
    train_seconds: float          # training time on the run's clock (from the first step; a time budget counts it)
    epochs: int
    steps: int
    stopped_early: bool
    model: str
    parameters: int
    precision: str                # fp32, bf16 or fp16
    device: str
    data: str
    num_train: int
    num_test: int
    classes: list[str]
    ema: bool                     # the final model is the EMA copy
    tta: bool
    processes: int
    replicas_in_sync: bool
    nonfinite_steps: int
    distill: str
    teacher: str | None
    time_budget_minutes: float | None
    heads: dict[str, float] | None = field(default=None, metadata=OMIT)  # distilled models: cls, dist and mean top-1
    pretrain: str = "none"        # a pre-training run's method (mae, mpp, dino, ibot, distill); none: supervised
    wall_seconds: float = 0.0     # the whole call, set-up and the final save included
    unreadable: list[str] = field(default_factory=list)  # the data's files that could not be read, left out
    images: int | None = field(default=None, metadata=OMIT)  # training images its steps took (an image twice: twice)
    steps_budget: int | None = None  # the steps the recipe asked for (--steps); null without, as time_budget_minutes
    auto: dict[str, Any] | None = field(default=None, metadata=OMIT)  # the automatic choice: row, reason, rates
    # pre-training on data with a labelled test split: the encoder's weighted k-NN top-1 (of knn_test test images among
    # knn_train labelled training images) beside an untrained encoder's of the same architecture and seed
    knn_top1: float | None = field(default=None, metadata=OMIT)
    knn_untrained_top1: float | None = field(default=None, metadata=OMIT)
    knn_train: int | None = field(default=None, metadata=OMIT)
    knn_test: int | None = field(default=None, metadata=OMIT)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        return _from_dict(cls, data, SUMMARY)


@dataclass
class EvalSummary:
    """summary.json of `vitlab eval --out`: a saved model's metrics on a data set's test split."""

    model: str                    # the model folder evaluated
    data: str
    tta: bool
    heads: dict[str, dict]        # the metrics of every head (logits, and cls and dist for a distilled model)
    top1: float
    top5: float
    per_class: dict[str, float]
    tta_translate: int = 0        # with tta: also shifted by this many pixels (airbench's mirror + translate)
    precision: str = "fp32"       # what the model ran in: fp32, bf16 or fp16

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalSummary:
        return _from_dict(cls, data, SUMMARY)


# --- writers ---

def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse to overwrite a finished run or to silently restart an unfinished one."""
    if is_finished(out) and resume:
        raise VitlabError(f"{out} holds a finished run ({SUMMARY} exists): there is nothing to resume; a longer run is "
                          f"a new run ({run_command(out)} --out NEW_FOLDER)")
    if is_finished(out):
        raise VitlabError(f"{out} holds a finished run ({SUMMARY} exists); choose another --out")
    if not resume and (out / CHECKPOINT).exists():
        raise VitlabError(f"{out} holds an unfinished run: continue it with `{run_command(out)} --resume {out}` "
                          "or choose another --out")


def run_command(out: Path) -> str:
    """The command that trains the run in ``out``: vitlab pretrain for a pre-training run, else vitlab train."""
    try:
        pretrain = read_config(out).get("pretrain", "none")
    except (OSError, ValueError):
        pretrain = "none"
    return "vitlab train" if pretrain in ("none", None) else "vitlab pretrain"


def config_values(recipe: RecipeValues, model_name: str | None) -> dict[str, Any]:
    """config.yaml's values: the recipe as run, with the model's name."""
    return {**recipe.to_dict(), "model": model_name or recipe.model}


def write_config(out: Path, recipe: RecipeValues, model_name: str | None) -> None:
    """config.yaml: the recipe as run, with the model's name (a `--resume` reads it back)."""
    write_config_values(out, config_values(recipe, model_name))


def write_config_values(out: Path, values: dict[str, Any]) -> None:
    """config.yaml from ``config_values``, through an atomic rename (a full disk leaves the previous file, never an
    empty one)."""
    atomic_write_bytes(out / CONFIG_YAML, yaml.safe_dump(values, sort_keys=False).encode())


def write_metrics(out: Path, history: Sequence[EpochRow]) -> None:
    """metrics.jsonl, the whole history at once through an atomic rename."""
    atomic_write_bytes(out / METRICS, "".join(json.dumps(h.to_dict()) + "\n" for h in history).encode())


def write_summary(out: Path, summary: Summary | EvalSummary) -> None:
    """summary.json; in a run folder it is written last: a folder without it is an unfinished run."""
    atomic_write_json(out / SUMMARY, summary.to_dict())


# --- readers ---

def is_finished(folder: Path) -> bool:
    return (Path(folder) / SUMMARY).is_file()


def has_config(folder: Path) -> bool:
    return (Path(folder) / CONFIG_YAML).is_file()


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The checkpoint in folder (tensors and plain values only; nothing unpickled runs), or None."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return None
    try:
        return load_plain(path)
    except ValueError as e:
        raise VitlabError(f"{e}; delete it to restart the run") from None


def read_config(folder: Path) -> dict[str, Any]:
    """config.yaml as a dict ({} when there is none); one that is empty, not YAML or not a mapping is refused in
    one line (read as no recipe, it would run the defaults)."""
    path = Path(folder) / CONFIG_YAML
    if not path.is_file():
        return {}
    try:
        values = yaml.safe_load(path.read_bytes())
    except yaml.YAMLError as e:
        raise VitlabError(f"{path} is not valid YAML ({str(e).splitlines()[0]}): it was edited or damaged; "
                          "accepted: the recipe as vitlab train wrote it") from None
    if not isinstance(values, dict) or not values:
        raise VitlabError(f"{path} holds no recipe ({'it is empty' if values is None else type(values).__name__}): "
                          "it was edited or damaged; accepted: the recipe as vitlab train wrote it")
    return values


def read_split(folder: str | os.PathLike) -> dict[str, Any]:
    """How a run folder's data was split: its ``data``, ``seed``, ``val_fraction`` and ``test_data`` (shards) from
    config.yaml, as ``load_data`` keywords (``data`` aside); {} for a folder that is not a run (a model folder)."""
    folder = Path(folder)
    cfg = read_config(folder) if folder.is_dir() else {}
    split = {k: cfg[k] for k in ("data", "seed", "val_fraction", "test_data") if cfg.get(k) is not None}
    trained_in = _trained_in(folder) if cfg else None
    for key in ("data", "test_data"):
        if trained_in and isinstance(split.get(key), str):
            split[key] = from_where_trained(split[key], trained_in)
    return split


def _trained_in(folder: Path) -> str | None:
    """The working folder a run was trained from (run.json's ``cwd``), where it recorded one."""
    try:
        cwd = json.loads((folder / "run.json").read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):
        return None
    return cwd if isinstance(cwd, str) else None


def from_where_trained(source: str, trained_in: str) -> str:
    """A run's relative data path as the run read it: relative to the folder it was trained from, where it is not
    found from the current folder (a run evaluated from elsewhere); built-in names, URLs and absolute paths as
    they are."""
    prefix = "wds:" if source.startswith("wds:") else ""
    path = source[len(prefix):]
    if not path or os.path.isabs(path) or path.startswith("~") or "://" in path or path.startswith("pipe:"):
        return source
    probe = Path(path.split("{")[0]).parent if "{" in path else Path(path)  # a brace pattern: its folder
    if os.path.lexists(probe) or not os.path.lexists(Path(trained_in) / probe):
        return source
    return prefix + str(Path(trained_in) / path)


def read_summary(folder: Path) -> Summary:
    """The finished run's summary.json."""
    path = Path(folder) / SUMMARY
    try:
        return Summary.from_dict(read_json_object(path))
    except ValueError as e:
        raise VitlabError(f"{folder}: {e}") from None


def read_eval_summary(folder: Path) -> EvalSummary:
    """The summary.json of a `vitlab eval --out` folder."""
    try:
        return EvalSummary.from_dict(read_json_object(Path(folder) / SUMMARY))
    except ValueError as e:
        raise VitlabError(f"{folder}: {e}") from None


def read_history(folder: Path) -> list[EpochRow]:
    """The rows of a run's metrics.jsonl (a torn last line, from a run killed mid-write, is left out)."""
    path = Path(folder) / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(EpochRow.from_dict(json.loads(line)))
        except (json.JSONDecodeError, ValueError, TypeError):
            continue
    return rows
