"""Masked pre-training (MAE, masked patch prediction), labels unused: the objective (pretrain/) wrapped around the
model is what the loop trains, its loss is the training loss, and its loss on the held-out images (masks drawn from
a fixed seed, the same at every evaluation) is what an evaluation reports in place of accuracy. The run folder
holds the encoder as its model and the rest of the objective beside it."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ...data.augment import normalize
from ...devices import autocast, to_device
from ...objectives import OBJECTIVES, check_encoder, create_objective, save_objective
from ...objectives.guidance import guidance
from ...runs.figures import LOSS_NAMES, plot_curves
from ...runs.format import CURVES_PNG, EpochRow
from .base import EvalSplit, Task

if TYPE_CHECKING:
    from ...data.sources import ImageSet
    from ..recipe import Recipe

EVAL_SEED = 20_220_000  # the held-out masks of image i come from seed EVAL_SEED + i (MAE's year, for a number)


def objective_arguments(recipe: Recipe, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    """The objective's options: the recipe's pretrain_args, and for the objectives that read pixels (MPP's colour
    targets, a distillation teacher's view) the data's normalisation."""
    takes = inspect.signature(OBJECTIVES[recipe.pretrain].__init__).parameters
    extra = {"mean": list(mean), "std": list(std)} if "mean" in takes else {}
    return {**recipe.pretrain_args, **extra}


class ObjectiveLoss(nn.Module):
    """The training loss of a pre-training run: the objective's own; the (augmented) targets are not used."""

    def forward(self, x: torch.Tensor, outputs: Any, targets: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
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




class MaskedPretraining(Task):
    """--pretrain mae|mpp|dino|ibot|distill: the objective around an encoder without a head; AdamW's betas
    (0.9, 0.95), as MAE pre-trains."""

    name = "masked"
    labels = False
    betas = (0.9, 0.95)

    @classmethod
    def wanted(cls, recipe: Recipe) -> bool:
        return recipe.pretrain != "none"

    def check_model(self, model: nn.Module | type) -> None:
        check_encoder(model, self.recipe.pretrain)

    def num_classes(self, classes: Sequence[str]) -> int:
        return 0  # an encoder: no head

    def label_names(self, classes: Sequence[str]) -> list[str] | None:
        return None

    def fit_init_head(self, model: nn.Module, classes: Sequence[str]) -> None:
        model.reset_classifier(0)  # an encoder to pre-train further

    def wrap(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> nn.Module:
        """The recipe's pre-training objective around ``model`` (on the model's device), said in one line."""
        recipe = self.recipe
        objective = create_objective(recipe.pretrain, model, **self.arguments(mean, std))
        objective.to(next(model.parameters()).device)
        n_rest = sum(p.numel() for n, p in objective.named_parameters() if not n.startswith("encoder."))
        options = ", ".join(f"{k}={v}" for k, v in recipe.pretrain_args.items())
        self.log(f"pre-training objective {recipe.pretrain} ({type(objective).__name__}: {n_rest / 1e6:.2f}M "
                 f"parameters besides the encoder{', ' + options if options else ''}); the labels are not used")
        return objective

    def arguments(self, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
        """The options that build the objective (and rebuild it from the run folder)."""
        return objective_arguments(self.recipe, mean, std)

    def make_loss(self, device: torch.device, classes: Sequence[str], mean: tuple, std: tuple) -> nn.Module:
        self.loss = ObjectiveLoss()
        return self.loss

    def prepare(self, train: ImageSet, view: Callable | None, batch_size: int,
                now: Callable[[], float]) -> float:
        """Say, from vitlab's measurements, about how long this data size needs before the encoder beats an untrained
        one (nothing is computed: no seconds)."""
        recipe, n = self.recipe, len(train.images)
        planned = None if recipe.time_budget else (recipe.steps * recipe.batch_size if recipe.steps
                                                   else recipe.epochs * n)
        self.log(guidance(recipe.pretrain, n, planned))
        return 0.0

    def evaluate(self, model: nn.Module, split: EvalSplit) -> dict[str, dict]:
        """The objective's loss on the held-out images, over every rank."""
        total = held_out_loss(model, split.images, split.mean, split.std, split.first, split.batch_size,
                              split.precision, split.view)
        loss_sum, count = split.reduce(total).tolist()
        return {"logits": loss_metrics(loss_sum / max(count, 1.0))}

    def describe(self, classes: Sequence[str]) -> str:
        return f"pre-training {self.recipe.pretrain}"

    def save(self, model: nn.Module, out: Path, mean: tuple, std: tuple) -> None:
        """The encoder as the run's model, the rest of the objective beside it."""
        save_objective(model, out, self.recipe.pretrain, self.arguments(mean, std))

    def draw(self, out: Path, history: list[EpochRow], m: dict, title: str, classes: Sequence[str]) -> list[str]:
        plot_curves(history, out / CURVES_PNG, title=f"{self.recipe.pretrain.upper()} pre-training of {title}",
                    loss_name=LOSS_NAMES[self.recipe.pretrain])
        return [CURVES_PNG]
