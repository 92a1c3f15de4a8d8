"""The objectives by name, and a pre-training run's objective written to and read back from its run folder.

A finished pre-training run holds its encoder as the run's model (config.json + model.safetensors, a
model ``vitlab.load`` reads, without a classifier head) and every other tensor of the objective (the
MAE decoder, the MPP mask embedding and colour head) in pretrain.safetensors, with the method and
the options that rebuild the objective around the encoder.
"""
from __future__ import annotations

import inspect
import json
import os
import typing
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .. import checkpoint
from ..atomic import atomic_path
from ..errors import NotFoundError, VitlabError
from ..runs.format import PRETRAIN_WEIGHTS
from ..settings import describe
from .dino import DINO
from .distill import FeatureDistillation
from .encoder import load_decoder_state, split_pretrained
from .ibot import IBOT
from .mae import MaskedAutoencoder
from .mpp import MaskedPatchPrediction

OBJECTIVES: dict[str, type[nn.Module]] = {"mae": MaskedAutoencoder, "mpp": MaskedPatchPrediction, "dino": DINO,
                                          "ibot": IBOT, "distill": FeatureDistillation}


DATA_OPTIONS = ("mean", "std")  # set from the data by the trainer, not by the user


def objective_options(method: str) -> tuple[str, ...]:
    """The options a user may give the objective ``method`` (its keywords, less the encoder, the data's and those the
    run sets from its teacher)."""
    cls = OBJECTIVES[method]
    params = inspect.signature(cls.__init__).parameters
    return tuple(n for n in params if n not in ("self", "encoder", *DATA_OPTIONS, *getattr(cls, "run_options", ())))


def check_options(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options coerced to their declared types (text '0.5' is 0.5); one line naming an unknown key (and the
    accepted ones) or a value of the wrong kind."""
    accepted = objective_options(method)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise VitlabError(f"unknown {method} option(s) {', '.join(unknown)} in pretrain_args; accepted: "
                          f"{', '.join(accepted)}")
    hints = typing.get_type_hints(OBJECTIVES[method].__init__)
    out = {}
    for key, value in options.items():
        try:
            out[key] = TypeAdapter(hints[key]).validate_python(value)
        except ValidationError:
            raise VitlabError(f"pretrain_args {key}={value!r} is not valid; accepted: "
                              f"{describe(hints[key])}") from None
    return out


def create_objective(method: str, encoder: nn.Module, **options: Any) -> nn.Module:
    """The pre-training objective ``method`` ('mae', 'mpp', 'dino', 'ibot' or 'distill') wrapped around ``encoder``."""
    if method not in OBJECTIVES:
        raise VitlabError(f"unknown pre-training method {method!r}; accepted: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[method](encoder, **options)


def write_pretrain(out: Path, method: str, options: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """pretrain.safetensors: the objective's tensors besides the encoder (the encoder is the run's model), with
    the method and the options that rebuild the objective (JSON, in the file's metadata)."""
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with atomic_path(out / PRETRAIN_WEIGHTS) as tmp:
        save_file(state, tmp, metadata={"format": "pt", "method": method, "options": json.dumps(options)})


def read_pretrain(folder: str | os.PathLike) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """(method, options, tensors) of a pre-training run's pretrain.safetensors; one line when it is missing or
    unreadable."""
    path = Path(folder) / PRETRAIN_WEIGHTS
    if not path.is_file():
        raise NotFoundError(f"{folder} is not a finished pre-training run: it has no {PRETRAIN_WEIGHTS} "
                            "(written by `vitlab pretrain` at its end)")
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        method, options = meta["method"], json.loads(meta["options"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise VitlabError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(options, dict):
        raise VitlabError(f"{path}: its options must be a JSON object, not {type(options).__name__}")
    return method, options, tensors


def save_objective(objective: nn.Module, folder: str | os.PathLike, method: str, options: dict[str, Any]) -> None:
    """Write the encoder as the folder's model and the objective's other tensors as pretrain.safetensors;
    ``options`` are the keywords (JSON values) that ``create_objective(method, encoder, **options)`` took."""
    encoder, rest = split_pretrained(objective)
    checkpoint.save(encoder, folder)
    write_pretrain(Path(folder), method, options, rest)


def load_objective(folder: str | os.PathLike) -> nn.Module:
    """A finished pre-training run's objective (encoder and decoder), in eval mode on the CPU.

    It is a MaskedAutoencoder or a MaskedPatchPrediction (``.method`` says which, ``.encoder`` is the run's
    model); called on normalised images (the encoder's pretrained_cfg mean and std) it returns their loss and
    predictions. Every tensor of the folder must find its place.
    """
    method, options, rest = read_pretrain(folder)
    encoder = checkpoint.load(folder)
    try:
        objective = create_objective(method, encoder, **options)
    except TypeError as e:  # an option this version does not take
        raise VitlabError(f"{Path(folder)}: the {method} options {options} do not build an objective ({e})") from None
    load_decoder_state(objective, rest)
    return objective.eval()
