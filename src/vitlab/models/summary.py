"""Parameter and FLOP counts of registered models, for ``vitlab models``."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .registry import create_model, get_spec, list_models


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Forward FLOPs (2 per multiply-add) of one image, counted on the meta device without computing."""
    model = model.to("meta").eval().requires_grad_(False)
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, *input_size, device="meta"))
    return counter.get_total_flops()


def _gflops(flops: int) -> str:
    g = flops / 1e9
    return f"{g:.2f}" if g >= 0.1 else f"{g:.4f}"


def model_table(pattern: str = "*") -> str:
    """A text table: name, family, input size, parameters (M), GFLOPs at the default resolution."""
    names = list_models(pattern)
    if not names:
        return f"no model matches {pattern!r}"
    rows = []
    for name in names:
        with torch.device("meta"):
            model = create_model(name)
        size = model.pretrained_cfg["input_size"]
        rows.append((name, get_spec(name).cls.__name__, "x".join(map(str, size[1:])),
                     f"{count_params(model) / 1e6:.2f}", _gflops(count_flops(model, size))))
    header = ("model", "class", "input", "params (M)", "GFLOPs")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])
