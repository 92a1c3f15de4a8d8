"""One line for a model whose outputs are not numbers (NaN or Inf): a score measured on them would be a lie."""
from __future__ import annotations

import torch

from .errors import VitlabError

BROKEN = ("its weights hold NaN or Inf, or its mean/std (pretrained_cfg in config.json) make the input so; accepted: "
          "a model whose outputs are finite")


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor:
    """How many rows of a (N, ...) tensor hold a NaN or an Inf, as a 0-d long tensor on its device (no host sync).

    A row's float64 sum is non-finite exactly when the row holds a NaN or an Inf (float32 values cannot overflow
    it); a sum and a select are ops every device runs, bool reductions are not (PyTorch's fake CUDA tensors)."""
    sums = values.double().reshape(len(values), -1).sum(1)
    return torch.where(torch.isfinite(sums), 0, 1).sum()


def check_finite(values: torch.Tensor | int, total: int, what: str, source: object) -> None:
    """Refuse in one line (ValueError) when any of ``total`` rows held a NaN or an Inf: ``values`` is either the
    outputs themselves or a count of bad rows from ``nonfinite_rows``."""
    if isinstance(values, torch.Tensor) and values.is_meta:
        return  # the meta device holds shapes only: there is nothing to read
    bad = int(values) if not isinstance(values, torch.Tensor) or values.dim() == 0 else int(nonfinite_rows(values))
    if bad:
        raise VitlabError(f"{source} gives non-finite {what} (NaN or Inf) for {bad} of {total} images: {BROKEN}")
