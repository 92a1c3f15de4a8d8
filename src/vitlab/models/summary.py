"""Parameter and FLOP counts of registered models, for ``vitlab models``."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

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


def _gflops(flops: int) -> str:
    g = flops / 1e9
    return f"{g:.2f}" if g >= 0.1 else f"{g:.4f}"


PROGRESS_FROM = 20  # models listed from which counting them shows a progress bar (the whole list takes a minute)


def model_table(pattern: str = "*", progress_from: int = PROGRESS_FROM, file: Any = None) -> str:
    """A text table: name, family, input size, parameters (M), GFLOPs at the default resolution. Counting
    ``progress_from`` models or more shows a progress bar on ``file`` (default standard error)."""
    names = list_models(pattern)
    if not names:
        return f"no model matches {pattern!r}"
    rows = []
    bar = Progress(names, desc="counting parameters and FLOPs", unit="model", file=file,
                   disable=len(names) < progress_from)
    for name in bar:
        with torch.device("meta"):
            model = create_model(name)
        size = model.pretrained_cfg["input_size"]
        rows.append((name, get_spec(name).cls.__name__, "x".join(map(str, size[1:])),
                     f"{count_params(model) / 1e6:.2f}", _gflops(count_flops(model, size))))
    header = ("model", "class", "input", "params (M)", "GFLOPs")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])
