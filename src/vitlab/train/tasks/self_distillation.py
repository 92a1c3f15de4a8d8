"""Self-distillation from an EMA teacher (``--distill self``, no --teacher): the teacher is a copy of the student
whose weights follow the student's as an exponential moving average (decay ``TEACHER_DECAY`` per step, as the
mean teachers of Tarvainen and Valpola 2017 and the EMA teachers of DINO and data2vec); the student learns from the
targets and from the teacher's softened predictions on the same augmented batch, the soft loss of DeiT
distillation (``--tau``, ``--alpha``), through its distillation head where it has one.

Early on the teacher is the student of a few steps before and teaches little; as training settles it becomes an
average over the recent steps, smoother than any of them, which is what the student is pulled towards.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ...errors import VitlabError
from ..step import ema_update
from .distillation import TrainLoss
from .supervised import Supervised

if TYPE_CHECKING:
    from ..recipe import Recipe

TEACHER_DECAY = 0.99  # the teacher's share of itself at each step: it averages over the last ~100 steps


class SelfDistillation(Supervised):
    name = "self-distillation"

    @classmethod
    def wanted(cls, recipe: Recipe) -> bool:
        return recipe.distill == "self"

    def wrap(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> nn.Module:
        """The model trains as it is; its teacher starts as a frozen copy of it, on its device."""
        self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        return model

    def make_loss(self, device: torch.device, classes: Sequence[str], mean: tuple, std: tuple) -> nn.Module:
        self.log(f"teacher: an EMA copy of the student (decay {TEACHER_DECAY} per step), soft distillation")
        self.loss = TrainLoss(self.teacher, "soft", self.recipe.tau, self.recipe.alpha)
        return self.loss

    def after_step(self, model: nn.Module) -> None:
        ema_update(self.teacher, model, TEACHER_DECAY)

    def state_dict(self) -> dict[str, Any]:
        """The EMA teacher's weights: a resumed run goes on with the teacher it had, not a copy of the student."""
        return {"teacher": self.teacher.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "teacher" not in state:
            raise VitlabError("the checkpoint holds no EMA teacher (it was written by an earlier vitlab): resumed, the "
                              "run would go on with another teacher than its own; accepted: a new run (vitlab train "
                              "--out NEW_FOLDER)")
        self.teacher.load_state_dict(state["teacher"])
