"""The optimiser, built in one place, one way: parameter groups (weight decay or not), layer-wise learning-rate
decay, a learning-rate scale for BatchNorm biases, AdamW or Nesterov SGD with decoupled hyperparameters, and
lookahead. ``recipe_optimizer`` is the one entry point; each group carries ``lr_scale``, which the run's schedule
(``schedule.LrSchedule``, through ``schedule.set_lr``) applies at every step as timm's schedulers do
(``lr * lr_scale``): nothing here sets a learning rate.

Weight decay: none on norms, biases, LayerScale, position embeddings and tokens (a model's ``no_weight_decay``).

Layer-wise learning-rate decay (BEiT, MAE, DeiT III fine-tuning): deeper layers learn faster.
Every parameter gets a layer id from the model (``models.groups.layer_ids``): the embeddings are layer 0,
the blocks (or stages) 1..depth, everything after the last block depth + 1. A parameter in layer i learns at
``lr * decay ** (depth + 1 - i)``: the heads at the full rate, the last block at ``lr * decay``, the embeddings at
``lr * decay ** (depth + 1)``. As in BEiT and MAE, the final norm counts with the heads (timm's ViT puts it with the
last block instead).

Decoupled SGD hyperparameters (airbench's definition). With momentum m, lr and weight_decay are given per 1,024
examples and per unit of Nesterov amplification, ``kilostep_scale = 1024 * (1 + 1 / (1 - m))``; a step of a
batch of B examples, on the gradient of the batch's mean loss, then moves the weights by

    lr_step = lr * B / kilostep_scale            (the learning rate torch's SGD is given)
    wd_step = weight_decay * B / kilostep_scale  (the share of each weight decayed: weight_decay = wd_step / lr_step)

which is airbench's SGD on the summed loss at ``lr / kilostep_scale``. Doubling the batch doubles both; changing
lr leaves the decay alone. The decay is scheduled with the learning rate, as there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..errors import VitlabError
from ..models.groups import layer_ids

if TYPE_CHECKING:
    from .recipe import Recipe

def layer_scales(depth: int, decay: float) -> list[float]:
    """The lr scale of layers 0..depth + 1: ``decay ** (depth + 1 - i)``."""
    return [decay ** (depth + 1 - i) for i in range(depth + 2)]


def check_layer_decay(decay: float) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
        raise VitlabError(f"layer decay must be a number in (0, 1] (1: no decay; BEiT and MAE use 0.65-0.75), "
                          f"got {decay!r}")
    return float(decay)


def param_groups_layer_decay(model: nn.Module, weight_decay: float, layer_decay: float) -> list[dict]:
    """Groups by (layer, weight decay or not), each with ``lr_scale``; trainable parameters only.

    ``layer_decay`` 1 gives the trainer's two groups unchanged (``lr_scale`` 1), so a run without
    layer decay keeps its optimizer state layout.
    """
    decay = check_layer_decay(layer_decay)
    base = param_groups(model, weight_decay)
    if decay == 1.0:
        return [dict(g, lr_scale=1.0) for g in base]
    ids, depth = layer_ids(model)
    scales = layer_scales(depth, decay)
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups: dict[tuple[int, int], dict] = {}
    for kind, group in enumerate(base):
        for p in group["params"]:
            layer = ids[name_of[id(p)]]
            g = groups.setdefault((layer, kind), {"params": [], "weight_decay": group["weight_decay"],
                                                  "lr_scale": scales[layer], "layer": layer})
            g["params"].append(p)
    return [groups[key] for key in sorted(groups)]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on norms, biases, LayerScale, position embeddings and tokens."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip or name.split(".")[-1] in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def kilostep_scale(momentum: float) -> float:
    return 1024.0 * (1.0 + 1.0 / (1.0 - momentum))


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
    (the recipe's decay, or 0). SGD's groups get the decoupling here, the one place it is computed: ``lr_scale``
    times ``B / kilostep_scale`` (so that ``set_lr(optimizer, lr)`` gives lr_step) and ``weight_decay`` wd_step /
    lr_step at the peak ``lr`` (so that the decay follows the schedule). The schedule sets the learning rate."""
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
        raise VitlabError(f"optimizer={kind!r} is not valid; accepted: adamw, sgd")
    return opt


def describe_groups(optimizer: torch.optim.Optimizer, layer_decay: float) -> str:
    """The line that says how layer decay grouped the parameters: layers, groups and the range of lr scales."""
    groups = [g for g in optimizer.param_groups if g["params"]]
    scales = [g.get("lr_scale", 1.0) for g in groups]
    layers = {g.get("layer") for g in groups}
    return (f"layer decay {layer_decay:g}: {len(layers)} layers in {len(groups)} parameter groups, "
            f"lr scale {min(scales):.3g}..{max(scales):.3g}")


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


def recipe_optimizer(model: nn.Module, recipe: Recipe, batch_size: int, device: torch.device,
                     betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """The recipe's optimiser (``optimizer``: adamw or sgd, ``lr``, ``momentum``) over the groups of ``weight_decay``
    and ``layer_decay``, BatchNorm biases scaled by ``bn_bias_lr_scale``; ``betas`` are AdamW's (the task's)."""
    groups = scale_bn_biases(param_groups_layer_decay(model, recipe.weight_decay, recipe.layer_decay), model,
                             recipe.bn_bias_lr_scale)
    return build_optimizer(groups, recipe.optimizer, recipe.lr, recipe.momentum, batch_size, device, betas)
