"""The precision a model runs in for inference: the one asked for, a run's own, or what 'auto' picks for it."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..devices import auto_precision
from ..errors import VitlabError
from ..models.summary import matmul_macs
from ..progress import log_line
from ..runs.format import SUMMARY, read_summary

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
NAMES = {"fp32": "float32", "bf16": "bf16", "fp16": "fp16"}


def run_precision(folder: str | os.PathLike | None, device: torch.device) -> str | None:
    """The precision a finished run folder trained and evaluated in, where this device can take it: a run on the
    same kind of device (a CPU run's bf16 on a CPU, a GPU run's on a GPU); None for another folder."""
    if folder is None or not (Path(folder) / SUMMARY).is_file():
        return None
    try:
        summary = read_summary(Path(folder))
    except ValueError:  # an eval folder's summary, or none a run wrote: not a run's own precision
        return None
    same_kind = summary.device.split(":")[0] == device.type
    return summary.precision if same_kind and summary.precision in NAMES else None


def inference_precision(model: nn.Module, asked: str, device: torch.device, folder: str | os.PathLike | None = None,
                        log: Callable[[str], None] = log_line) -> str:
    """'fp32', 'bf16' or 'fp16' to run ``model`` in on ``device``: ``asked`` unless it is 'auto'. 'auto' is the
    precision the run in ``folder`` trained and evaluated in, so that `vitlab eval` of its weights gives the figures
    its summary gives; for any other model, the rule training's 'auto' follows (devices.auto_precision on the
    model's multiply-adds an image). A choice of bf16 or fp16 is said in one line on ``log`` (float32, what
    inference ran in before 'auto' existed, goes without a word)."""
    if asked not in PRECISIONS:
        raise VitlabError(f"precision {asked!r} is not valid; accepted: {', '.join(PRECISIONS)}")
    if asked != "auto":
        return asked
    own = run_precision(folder, device)
    if own is not None:
        if own != "fp32":
            log(f"precision auto: {NAMES[own]} (the run's own: it trained and evaluated in {NAMES[own]})")
        return own
    precision, why = auto_precision(device, matmul_macs(model), "inference")
    if precision != "fp32":
        log(f"precision auto: {NAMES[precision]} ({why})")
    return precision


def cast_for_inference(model: nn.Module, precision: str) -> nn.Module:
    """``model`` ready to run in ``precision`` under autocast (changed in place: a model this command loaded): for
    bf16, the weights of its linear and convolution layers cast to bf16 once, where autocast would cast them again
    on every forward pass. Autocast rounds them the same way, so the outputs are autocast's own; what it keeps in
    float32 (norms, softmax, position tables, the residual stream) stays float32. Subclasses of those layers (a
    weight-standardised convolution, say) may compute with their weights and are left as they are."""
    if precision == "bf16":
        for module in model.modules():
            if type(module) in (nn.Linear, nn.Conv2d):
                module.to(torch.bfloat16)
    return model
