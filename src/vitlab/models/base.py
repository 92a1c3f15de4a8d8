"""What every vitlab model shares: timm's head API, its ``pretrained_cfg``, and the facts it carries.

The facts (a readable family, the classifier names, how timm and transformers name the model)
are class attributes, or properties where they depend on the instance (a distilled ViT is DeiT).
interop/ and the reports read them off the model; nothing outside models/ keys on class names.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import VitlabError
from .layers import PatchEmbed, to_2tuple

DEFAULT_MEAN, DEFAULT_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # timm's and transformers' ViT default


@dataclass(frozen=True)
class TimmSpec:
    """How timm holds a model: its class, the arguments both take, and what timm's class cannot vary."""

    cls: str  # timm's class name
    args: tuple[str, ...]  # arguments timm's class takes with the same name and meaning
    base_arch: str  # a timm name of the family; the exported model_args override all its defaults
    fixed: dict[str, Any] = field(default_factory=dict)  # vitlab arguments timm lacks: the one value it behaves as
    dropped: tuple[str, ...] = ()  # vitlab arguments timm needs not hear of (expressed by the class, or moot)
    values: dict[str, dict[Any, Any]] = field(default_factory=dict)  # argument values timm writes another way
    layer_scale_as_gamma: bool = False  # LayerScale saved as ``blocks.i.gamma_1`` (CaiT) not ``ls1.gamma``
    trunk_prefix: str = ""  # timm nests every tensor but the classifiers' under it (Qwen3's classifier: ``encoder.``)


class Model(nn.Module):
    """Base of every vitlab model: timm's head API over ``forward_features``, and the model's facts.

    A subclass builds ``head_drop`` and its classifier(s) named in ``classifier_names``, sets
    ``num_classes``, ``num_features``, ``global_pool`` and ``num_prefix_tokens`` (or writes its own
    ``pool``), and writes ``forward_features``.
    """

    family: str = ""  # a readable label, e.g. "ViT", "ResNet (CNN)"
    classifier_names: tuple[str, ...] = ("head",)  # the Linear layer(s) reset_classifier replaces
    global_pools: tuple[str, ...] = ("token", "avg", "")
    parent_args_fixed: tuple[str, ...] = ()  # a subclass passing **kwargs on: the parent's arguments it sets itself
    no_weight_decay_names: tuple[str, ...] = ("pos_embed", "cls_token")
    timm_names: frozenset[str] = frozenset()  # registered names that are timm's names for the same model
    timm_spec: TimmSpec | None = None
    no_timm: str = ""  # why timm cannot hold this model, where timm_spec is None
    hf_model_type: str | None = None  # transformers' model_type
    no_hf: str = ""  # what transformers cannot express, where hf_model_type is None
    no_pretrain: str = ""  # why masked pre-training (MAE, MPP) does not apply, where it does not
    # the arguments that must be > 0 (the other numbers >= 0, rates ``*_rate`` in [0, 1)); the type of each argument
    # is its default's (registry.check_args)
    positive_args: tuple[str, ...] = ("img_size", "patch_size", "in_chans", "embed_dim", "num_heads", "mlp_ratio",
                                      "norm_eps", "widths", "width_mult", "whiten_eps", "stem_widths",
                                      "tokenizer_kernel", "tokenizer_width", "backbone_widths", "layers",
                                      "backbone_layers", "mlp_ratio_token_only", "scale")
    pair_args: tuple[str, ...] = ("img_size", "patch_size")  # an int, or (height, width)
    no_attention: str = ""  # why a token model has no attention to analyse (MLP-Mixer), where it has none
    fixed_size: str = ""  # why the model takes its own input size only (MLP-Mixer), where it does
    block_lists: tuple[str, ...] = ("blocks",)  # the module lists whose blocks gradient checkpointing recomputes

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's gradient checkpointing: in training, each block's activations are recomputed in the backward pass
        instead of kept (torch.utils.checkpoint), which trades compute for memory; outputs and gradients unchanged."""
        blocks = [b for name in self.block_lists for b in getattr(self, name, None) or ()]
        if not blocks:
            raise VitlabError(f"{type(self).__name__} has no transformer blocks to checkpoint; accepted: a model with "
                              f"{' or '.join(self.block_lists)}")
        for blk in blocks:
            if enable:
                blk.forward = functools.partial(_checkpointed, blk)  # an instance attribute: nn.Module calls it
            else:
                blk.__dict__.pop("forward", None)
        self.grad_checkpointing = enable

    def init_vit_input(self, img_size: int | tuple[int, int], patch_size: int | tuple[int, int], in_chans: int,
                       num_classes: int, global_pool: str, embed_dim: int, dynamic_img_size: bool,
                       norm_eps: float) -> Callable[[int], nn.LayerNorm]:
        """The opening of a ViT-like constructor with one class token (BEiT, CaiT, ConViT): ``global_pool`` checked
        against ``global_pools``, the head's facts, the patch embedding ``patch_embed`` and the class token
        ``cls_token`` (zeros until the model's init); returns the model's LayerNorm (``norm_eps``)."""
        if global_pool not in self.global_pools:
            raise VitlabError(f"global_pool {global_pool!r} is not one of {self.global_pools}")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.dynamic_img_size = dynamic_img_size
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size=dynamic_img_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        return functools.partial(nn.LayerNorm, eps=norm_eps)

    def no_weight_decay(self) -> set[str]:
        return set(self.no_weight_decay_names)

    def rotary_embedding(self) -> torch.Tensor | None:
        """The rotary position embedding of each patch of the model's grid, (N, ...); None without RoPE."""
        return None

    def get_classifier(self) -> nn.Module:
        return getattr(self, self.classifier_names[0])

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """New untrained classifier(s) for num_classes (0: none, forward returns pooled features)."""
        if global_pool is not None:
            if global_pool not in self.global_pools or (global_pool == "token" and
                                                        getattr(self, "cls_token", None) is None):
                raise VitlabError(f"global_pool {global_pool!r} is not valid for this model; "
                                  f"accepted: {', '.join(map(repr, self.global_pools))}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        device = next(self.parameters()).device
        for name in self.classifier_names:
            setattr(self, name, nn.Linear(self.num_features, num_classes, device=device)
                    if num_classes > 0 else nn.Identity())

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, prefix + N, D) tokens -> (B, D): the class token, the mean patch token, or x as it is."""
        if self.global_pool == "avg":
            return x[:, self.num_prefix_tokens:].mean(dim=1)
        return x[:, 0] if self.global_pool == "token" else x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """forward_features' output -> logits (or, with pre_logits, the pooled features)."""
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.get_classifier()(x)

    def forward_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """forward_features' output -> each classifier's logits, in classifier_names' order, in any mode."""
        return (self.forward_head(x),)

    def forward(self, x: torch.Tensor):
        return self.forward_head(self.forward_features(x))


def _checkpointed(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's forward, through torch.utils.checkpoint where a training step will take gradients."""
    forward = type(block).forward
    if block.training and torch.is_grad_enabled():
        return checkpoint(forward, block, *args, use_reentrant=False, **kwargs)
    return forward(block, *args, **kwargs)


def make_pretrained_cfg(model: nn.Module, in_chans: int, mean=DEFAULT_MEAN, std=DEFAULT_STD) -> dict[str, Any]:
    """timm's preprocessing dict for a new model; a mean and std of another channel count are averaged."""
    if len(mean) != in_chans:
        mean, std = (sum(mean) / len(mean),) * in_chans, (sum(std) / len(std),) * in_chans
    img = to_2tuple(getattr(model, "patch_embed", model).img_size)
    return {"input_size": (in_chans, *img), "mean": tuple(mean), "std": tuple(std),
            "interpolation": "bicubic", "label_names": None}
