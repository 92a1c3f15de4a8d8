"""The tasks a run can train for, each in its own file (``base.Task`` is the interface). The recipe chooses one:
the first in ``TASKS`` that wants it, supervised training last (it takes any recipe)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import EvalSplit, Task
from .distillation import Distillation
from .feature_distillation import FeatureDistillationPretraining
from .masked import MaskedPretraining
from .self_distillation import SelfDistillation
from .supervised import Supervised

if TYPE_CHECKING:
    from ..recipe import Recipe

TASKS: tuple[type[Task], ...] = (FeatureDistillationPretraining, MaskedPretraining, SelfDistillation, Distillation,
                                 Supervised)


def task_for(recipe: Recipe, log: Callable[[str], None]) -> Task:
    """The task the recipe asks for."""
    return next(cls for cls in TASKS if cls.wanted(recipe))(recipe, log)


__all__ = ["TASKS", "EvalSplit", "Task", "task_for"]
