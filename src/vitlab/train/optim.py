"""The speed-run optimisation pieces, for any model: Nesterov SGD with decoupled hyperparameters, a learning-rate
scale for BatchNorm biases, lookahead, and the hooks a model may offer (``init_from_data``, ``freeze_stem``).

Decoupled hyperparameters (airbench's definition). With momentum m, lr and weight_decay are given per 1,024
examples and per unit of Nesterov amplification, ``kilostep_scale = 1024 * (1 + 1 / (1 - m))``; a step of a
batch of B examples, on the gradient of the batch's mean loss, then moves the weights by

    lr_step = lr * B / kilostep_scale            (the learning rate torch's SGD is given)
    wd_step = weight_decay * B / kilostep_scale  (the share of each weight decayed: weight_decay = wd_step / lr_step)

which is airbench's SGD on the summed loss at ``lr / kilostep_scale``. Doubling the batch doubles both; changing
lr leaves the decay alone. The decay is scheduled with the learning rate, as there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from .layer_decay import param_groups_layer_decay
from .schedule import set_lr


def kilostep_scale(momentum: float) -> float:
    return 1024.0 * (1.0 + 1.0 / (1.0 - momentum))


def decoupled_sgd(lr: float, weight_decay: float, batch_size: int, momentum: float) -> tuple[float, float]:
    """(lr_step, wd_step): the step learning rate and the share of each weight decayed per step."""
    k = batch_size / kilostep_scale(momentum)
    return lr * k, weight_decay * k


def bn_bias_ids(model: nn.Module) -> set[int]:
    """The ids of the BatchNorm biases of a model."""
    return {id(m.bias) for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.bias is not None}


def scale_bn_biases(groups: list[dict], model: nn.Module, scale: float) -> list[dict]:
    """The groups with BatchNorm biases moved to groups of their own whose ``lr_scale`` is ``scale`` times theirs."""
    if scale == 1.0:
        return groups
    ids = bn_bias_ids(model)
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in ids]
        biases = [p for p in g["params"] if id(p) in ids]
        out += [dict(g, params=rest)] if rest else []
        out += [dict(g, params=biases, lr_scale=g.get("lr_scale", 1.0) * scale)] if biases else []
    return out


def build_optimizer(groups: list[dict], kind: str, lr: float, momentum: float, batch_size: int,
                    device: torch.device, betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW, or Nesterov SGD with decoupled hyperparameters, over groups carrying ``lr_scale`` and ``weight_decay``
    (the recipe's decay, or 0); the learning rate is then set with ``schedule.set_lr(optimizer, recipe_lr)``."""
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True if device.type == "cuda" else None)
    elif kind == "sgd":
        k = batch_size / kilostep_scale(momentum)
        for g in groups:
            scale = g.get("lr_scale", 1.0)
            g["lr_scale"] = scale * k  # set_lr(opt, lr) gives lr_step * scale
            g["weight_decay"] = g["weight_decay"] / (lr * scale)  # wd_step / lr_step (k cancels)
        opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True)
    else:
        raise ValueError(f"optimizer={kind!r} is not valid; accepted: adamw, sgd")
    set_lr(opt, lr)
    return opt


def lookahead_alpha(progress: float, every: int, decay: float) -> float:
    """airbench's lookahead weight of the slow weights: ``decay ** every * progress ** 3``."""
    return decay ** every * min(max(progress, 0.0), 1.0) ** 3


class Lookahead:
    """Every ``every`` steps, slow = alpha * slow + (1 - alpha) * fast, then fast = slow (airbench's lookahead,
    alpha from ``lookahead_alpha``); ``finish`` sets the fast weights to the slow ones. Every floating-point
    entry of the state dict takes part (BatchNorm statistics too). The slow weights are not checkpointed: a resumed
    run starts them from the weights it resumes with."""

    def __init__(self, model: nn.Module, every: int, decay: float):
        self.every, self.decay = every, decay
        self.slow = [t.detach().clone() for t in self._floats(model)]

    @staticmethod
    def _floats(model: nn.Module) -> list[torch.Tensor]:
        return [t for t in model.state_dict().values() if t.dtype.is_floating_point]

    @torch.no_grad()
    def update(self, model: nn.Module, alpha: float) -> None:
        fast = self._floats(model)
        torch._foreach_lerp_(self.slow, fast, 1.0 - alpha)
        torch._foreach_copy_(fast, self.slow)

    def step(self, model: nn.Module, step: int, progress: float) -> None:
        """After optimiser step number ``step`` (counted from 1), at ``progress`` in [0, 1] of the schedule."""
        if step % self.every == 0:
            self.update(model, lookahead_alpha(progress, self.every, self.decay))

    def finish(self, model: nn.Module) -> None:
        self.update(model, 1.0)


def prepare_model(model: nn.Module, train_images: torch.Tensor, mean, std, log: Callable[[str], None],
                  n: int = 5000) -> None:
    """A fresh run of a model that initialises from data (``init_from_data``): give it the first ``n`` training
    images, normalised."""
    from ..data.augment import normalize

    if hasattr(model, "init_from_data"):
        images = normalize(train_images[:n].to(next(model.parameters()).device), mean, std)
        if model.init_from_data(images):
            log(f"initialised {type(model).__name__} from {len(images)} training images")


def recipe_optimizer(model: nn.Module, r, batch_size: int, device: torch.device,
                     betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """The recipe's optimiser over the trainer's groups (weight decay or not, layer decay), BatchNorm biases scaled
    by ``bn_bias_lr_scale``."""
    groups = scale_bn_biases(param_groups_layer_decay(model, r.weight_decay, r.layer_decay), model,
                             r.bn_bias_lr_scale)
    return build_optimizer(groups, r.optimizer, r.lr, r.momentum, batch_size, device, betas)
