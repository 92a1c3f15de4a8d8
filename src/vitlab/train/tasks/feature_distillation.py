"""Pre-training by feature distillation (--pretrain distill --teacher MODEL): the masked pre-training task with a
frozen teacher attached to its objective (objectives/distill.py). The teacher is loaded from the recipe's folder on
every start and resume (the run's identity keeps the sha256 of its files, so a changed teacher is refused), and the
facts about it that build the objective are written beside the encoder."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from ... import checkpoint
from ...devices import auto_precision
from ...models.summary import matmul_macs
from ...objectives import FeatureDistillation
from .masked import MaskedPretraining

if TYPE_CHECKING:
    from ..recipe import Recipe


def teacher_bf16(precision: str, teacher: nn.Module) -> tuple[bool, str]:
    """Whether the teacher runs in bf16, and why: as the run asks, or with 'auto' the inference rule for the
    teacher's own multiply-adds an image (a teacher larger than its student may pay where the student does not)."""
    if precision != "auto":
        return precision == "bf16", f"the run's precision {precision}"
    device = next(teacher.parameters()).device
    chosen, why = auto_precision(device, matmul_macs(teacher), "inference")
    return chosen == "bf16", why


class FeatureDistillationPretraining(MaskedPretraining):
    """The objective's teacher loaded, checked against the student and attached before the first step."""

    name = "feature distillation"

    @classmethod
    def wanted(cls, recipe: Recipe) -> bool:
        return recipe.pretrain == "distill"

    def __init__(self, recipe: Recipe, log):
        super().__init__(recipe, log)
        self.facts: dict[str, Any] = {}

    def wrap(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> nn.Module:
        teacher = checkpoint.load(self.recipe.teacher).to(next(model.parameters()).device)
        self.facts = FeatureDistillation.teacher_facts(teacher)
        objective = super().wrap(model, mean, std)
        bf16, why = teacher_bf16(self.recipe.precision, teacher)
        objective.attach_teacher(teacher, bf16)
        size = "x".join(str(s) for s in self.facts["teacher_size"])
        self.log(f"teacher: {self.recipe.teacher} ({getattr(teacher, 'arch', type(teacher).__name__)}, frozen, at "
                 f"{size}, pooled features {self.facts['teacher_dim']} and patch features "
                 f"{self.facts['teacher_patch_dim']} wide), in {'bf16' if bf16 else 'float32'} ({why})")
        return objective

    def arguments(self, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
        return {**super().arguments(mean, std), **self.facts}

    def describe(self, classes: Sequence[str]) -> str:
        return f"pre-training distill from {self.recipe.teacher}"
