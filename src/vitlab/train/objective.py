"""Self-supervised pre-training through the training loop: the objective (pretrain/) wrapped around the model
is what the loop trains, its loss is the training loss, and its loss on the held-out images (masks drawn from a
fixed seed, the same at every evaluation) is what an evaluation reports in place of accuracy."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..data.augment import normalize
from ..devices import to_device
from ..pretrain import create_objective
from .recipe import Recipe
from .step import autocast

EVAL_SEED = 20_220_000  # the held-out masks of image i come from seed EVAL_SEED + i (MAE's year, for a number)


def pretraining(r: Recipe) -> bool:
    return r.pretrain != "none"


def optimizer_betas(r: Recipe) -> tuple[float, float]:
    """AdamW's betas: (0.9, 0.95) for pre-training, as MAE pre-trains; the usual (0.9, 0.999) otherwise."""
    return (0.9, 0.95) if pretraining(r) else (0.9, 0.999)


def objective_arguments(r: Recipe, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    """The objective's options: the recipe's pretrain_args, and for MPP the data's normalisation (its targets are
    the colours of the un-normalised pixels)."""
    extra = {"mean": list(mean), "std": list(std)} if r.pretrain == "mpp" else {}
    return {**r.pretrain_args, **extra}


def wrap_model(model: nn.Module, r: Recipe, mean: Sequence[float], std: Sequence[float],
               log: Callable[[str], None]) -> nn.Module:
    """The recipe's pre-training objective around ``model`` (on the model's device), said in one line."""
    objective = create_objective(r.pretrain, model, **objective_arguments(r, mean, std))
    objective.to(next(model.parameters()).device)
    n_rest = sum(p.numel() for n, p in objective.named_parameters() if not n.startswith("encoder."))
    log(f"pre-training objective {r.pretrain} ({type(objective).__name__}: {n_rest / 1e6:.2f}M parameters besides "
        f"the encoder{', ' + ', '.join(f'{k}={v}' for k, v in r.pretrain_args.items()) if r.pretrain_args else ''})"
        "; the labels are not used")
    return objective


class ObjectiveLoss(nn.Module):
    """The training loss of a pre-training run: the objective's own; the (augmented) targets are not used."""

    def forward(self, x: torch.Tensor, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return outputs.loss


@torch.no_grad()
def held_out_loss(objective: nn.Module, images: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                  first: int = 0, batch_size: int = 256, precision: str = "fp32",
                  view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(summed loss, images) over uint8 images, as a float64 pair on the objective's device; ``first`` is the index
    of images[0] in the split: batch masks come from EVAL_SEED + the index of the batch's first image."""
    was_training = objective.training
    objective.eval()
    device = next(objective.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(images), batch_size):
        n = min(batch_size, len(images) - i)
        batch = to_device(images.narrow(0, i, n), device)
        x = normalize(view(batch) if view is not None else batch, mean, std)
        g = torch.Generator().manual_seed(EVAL_SEED + first + i)  # on the CPU: the same masks on any device
        with autocast(device, precision):
            loss = objective(x, generator=g).loss
        total += torch.stack([loss.double() * n, loss.new_full((), n, dtype=torch.float64)])
    objective.train(was_training)
    return total


def loss_metrics(loss: float) -> dict[str, Any]:
    """An evaluation's metrics for a run without labels: the held-out loss; no accuracy or confusion matrix."""
    return {"loss": loss, "top1": None, "top5": None, "per_class": None, "confusion": None}
