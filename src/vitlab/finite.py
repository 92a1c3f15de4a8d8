"""One line for a model whose outputs are not numbers (NaN or Inf): a score measured on them would be a lie."""
from __future__ import annotations

import torch

BROKEN = ("its weights hold NaN or Inf, or its mean/std (pretrained_cfg in config.json) make the input so; accepted: "
          "a model whose outputs are finite")


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor:
    """How many rows of a (N, ...) tensor hold a NaN or an Inf, as a 0-d tensor on its device (no host sync)."""
    return (~torch.isfinite(values.float())).reshape(len(values), -1).any(1).sum()


def check_finite(values: torch.Tensor | int, total: int, what: str, source: object) -> None:
    """Refuse in one line (ValueError) when any of ``total`` rows held a NaN or an Inf: ``values`` is either the
    outputs themselves or a count of bad rows from ``nonfinite_rows``."""
    bad = int(values) if not isinstance(values, torch.Tensor) or values.dim() == 0 else int(nonfinite_rows(values))
    if bad:
        raise ValueError(f"{source} gives non-finite {what} (NaN or Inf) for {bad} of {total} images: {BROKEN}")
