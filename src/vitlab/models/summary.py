"""Parameter and multiply-add counts of registered models, into the facts file ``vitlab models`` reads
(``catalog``), and the work of a forward pass."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..catalog import FACTS_FILE, read_facts
from ..progress import Progress
from .registry import create_model, get_spec, list_models


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Forward FLOPs (2 per multiply-add) of one image, counted on the meta device without computing."""
    model = model.to("meta").eval().requires_grad_(False)
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, *input_size, device="meta"))
    return counter.get_total_flops()


def matmul_flops(model: nn.Module, image: torch.Tensor) -> int:
    """Forward FLOPs (2 per multiply-add) of the linear and convolution layers on ``image`` (one, batched), run on
    the real weights in eval mode with no gradients (BatchNorm statistics and the random state are left as they
    are): the bulk of a model's work, counted in a fraction of one training step (FlopCounterMode's first use
    costs seconds of imports)."""
    total = 0

    def count(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Linear):
            total += 2 * inputs[0].numel() * module.out_features
        else:
            total += 2 * output.numel() * module.weight[0].numel()

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(image)
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    return total


def matmul_macs(model: nn.Module, input_size: tuple[int, ...] | None = None) -> int:
    """Multiply-adds of one image of ``input_size`` (C, H, W; default: the model's own) in the linear and
    convolution layers (``matmul_flops`` of a zero image on the model's device, halved)."""
    size = tuple(input_size or model.pretrained_cfg["input_size"])
    first = next(model.parameters(), None)
    image = torch.zeros(1, *size, device=first.device if first is not None else "cpu")
    return matmul_flops(model, image) // 2


def count_macs(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Forward multiply-adds of one image (every matrix product, attention's included), as timm's benchmark and
    the papers give them (DeiT-B: 17.6 G): ``count_flops`` halved."""
    return count_flops(model, input_size) // 2


PROGRESS_FROM = 20  # models counted from which counting them shows a progress bar (the whole list takes minutes)


def spec_key(name: str) -> str:
    """A digest of what a registered name builds (its class and arguments): a facts row is that name's while the
    digest matches, and is counted again once the registration changes."""
    spec = get_spec(name)
    text = json.dumps({"class": spec.cls.__name__, "args": spec.args}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def count_facts(name: str) -> dict[str, Any]:
    """A registered model's facts at its default resolution, counted on the meta device: class, input size,
    parameters, multiply-adds an image, and the ``spec_key`` they were counted for."""
    with torch.device("meta"):
        model = create_model(name)
    size = tuple(model.pretrained_cfg["input_size"])
    return {"class": get_spec(name).cls.__name__, "input": list(size), "params": count_params(model),
            "macs": count_macs(model, size), "spec": spec_key(name)}


def model_facts(names: list[str], progress_from: int = PROGRESS_FROM, file: Any = None,
                facts: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The facts of each of ``names``: read from the counted table where its row is for the name's registration
    as it is now, counted (seconds a model) where not; counting ``progress_from`` models or more shows a
    progress bar on ``file`` (default standard error)."""
    facts = read_facts() if facts is None else facts
    fresh = {n: facts[n] for n in names if n in facts and facts[n].get("spec") == spec_key(n)}
    missing = [n for n in names if n not in fresh]
    bar = Progress(missing, desc="counting parameters and multiply-adds", unit="model", file=file,
                   disable=len(missing) < progress_from)
    counted = {n: count_facts(n) for n in bar}
    return [{"name": n, **(fresh.get(n) or counted[n])} for n in names]


def write_facts(path: Path = FACTS_FILE, file: Any = None) -> int:
    """Count every registered model's facts into ``path`` (rows still fresh are kept); returns how many."""
    names = list_models("*")
    rows = model_facts(names, progress_from=1, file=file, facts=read_facts(path))
    body = {"about": "vitlab models' facts at their default input size: parameters and forward multiply-adds an "
                     "image (benchmarks/make_model_facts.py writes this file)",
            "models": {r.pop("name"): r for r in rows}}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return len(rows)

