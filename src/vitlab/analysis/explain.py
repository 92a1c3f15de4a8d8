"""The explanation methods, in one registry that everything listing methods reads: ``explain``, the report's
figures and caption, faithfulness.json, the sanity check and the interactive explorer.

A method is a function ``f(model, images, ...) -> (B, grid_h, grid_w)`` (high = relevant, on the model's patch
grid) plus one entry in ``REGISTRY``. ``explain`` passes it those of ``target_class``, ``token``, ``head_fusion``
and ``discard_ratio`` that it declares as parameters: one that takes ``target_class`` explains a class (it is
class-specific), one that takes ``token`` is also read from a distilled DeiT's distillation token.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import VitlabError
from .attnlrp import attnlrp
from .capture import prefix_token_names
from .gradients import gradient_saliency
from .libragrad import libragrad, libragrad_fullgrad, libragrad_ig
from .palrp import pa_lrp
from .relevance import relevance
from .rollout import grad_rollout, raw_attention, rollout

OPTIONS = ("target_class", "token", "head_fusion", "discard_ratio")  # what explain can pass on


@dataclass(frozen=True)
class Method:
    """One explanation method: its function, a short label for figures and tables, and one phrase for the report's
    caption (a str.format template that may use {head_fusion} and {discard_ratio})."""

    function: Callable[..., torch.Tensor]
    label: str
    about: str
    options: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        params = inspect.signature(self.function).parameters
        object.__setattr__(self, "options", frozenset(o for o in OPTIONS if o in params))

    @property
    def class_specific(self) -> bool:
        """Whether the map depends on the class it explains."""
        return "target_class" in self.options

    @property
    def tokens(self) -> tuple[str, ...]:
        """The tokens it can be read from."""
        return ("cls", "dist") if "token" in self.options else ("cls",)


REGISTRY: dict[str, Method] = {
    "raw_attention": Method(raw_attention, "raw attention (last block)",
                            "the last block's attention (heads averaged; the baseline)"),
    "rollout": Method(rollout, "rollout",
                      "attention rollout (Abnar & Zuidema 2020: per block the heads are fused by their {head_fusion}, "
                      "the lowest {discard_ratio:.0%} of each row dropped (never the class token's attention to "
                      "itself), the identity added for the residual connection and the blocks' matrices multiplied)"),
    "grad_rollout": Method(grad_rollout, "grad rollout",
                           "gradient rollout (each map weighted by its gradient with respect to the predicted class's "
                           "logit, positive part, then rolled out)"),
    "relevance": Method(relevance, "relevance (Chefer et al.)",
                        "the relevance of Chefer, Gur & Wolf (ICCV 2021: R = I, then per block R += mean over heads "
                        "of (gradient x attention)^+ @ R, no renormalisation)"),
    "attnlrp": Method(attnlrp, "AttnLRP",
                      "AttnLRP (Achtibat et al. 2024: layer-wise relevance propagation in one backward pass, the "
                      "epsilon rule for linear layers, the uniform rule for q k and A v, the softmax's Taylor rule, "
                      "LayerNorm with its standard deviation held constant; pixels' relevance summed per patch)"),
    "pa_lrp": Method(pa_lrp, "PA-LRP",
                     "positional-aware LRP (Bakish et al. 2025: AttnLRP's rules, and the relevance of the position "
                     "encodings kept: an additive table's share of each token, half of each rotary query and key; a "
                     "patch's relevance is its pixels' plus its position's)"),
    "libragrad": Method(libragrad, "LibraGrad input x gradient",
                        "LibraGrad input x gradient (Mehri et al. 2025: gradients with the attention, the norms' "
                        "standard deviation and the activations' gates held constant, self-gating halved, so that "
                        "input x gradient is complete; pixels' relevance summed per patch)"),
    "libragrad_ig": Method(libragrad_ig, "LibraGrad integrated gradients",
                           "LibraGrad integrated gradients (the balanced gradients averaged over 16 points of the "
                           "path from the mean-colour image, times the image; summed per patch)"),
    "libragrad_fullgrad": Method(libragrad_fullgrad, "LibraGrad FullGrad+",
                                 "LibraGrad FullGrad+ (input x balanced gradient of every block's input tokens, "
                                 "summed over the channels and averaged over the blocks, read on the patch tokens)"),
    "saliency": Method(gradient_saliency, "gradient saliency",
                       "gradient saliency (Simonyan et al. 2014: the largest absolute gradient of the predicted "
                       "class's logit over the channels, averaged over each patch; it reads no attention)"),
}
METHODS = tuple(REGISTRY)  # the names, in the order figures and tables show them (e.g. for a CLI's choices)


def method_key(method: str, token: str = "cls") -> str:
    """The name a (method, token) pair has in faithfulness.json: e.g. 'relevance', 'relevance_dist'."""
    return method if token == "cls" else f"{method}_{token}"


def split_key(key: str) -> tuple[str, str]:
    """method_key's inverse: 'relevance_dist' -> ('relevance', 'dist'), 'relevance' -> ('relevance', 'cls')."""
    method = key.removesuffix("_dist")
    return method, "cls" if method == key else "dist"


def method_label(key: str) -> str:
    """A readable name for a key of method_key (or a floor baseline: 'random', 'edge')."""
    if key == "random":
        return "random map"
    if key == "edge":
        return "edge detector (Sobel)"
    method, token = split_key(key)
    label = REGISTRY[method].label if method in REGISTRY else method
    return label + (" (distillation token)" if token == "dist" else "")


def explanation_methods(model: nn.Module) -> list[tuple[str, str]]:
    """(method, token) pairs that apply to the model: every method from 'cls', and from 'dist' for a distilled one
    (the methods that read a token)."""
    tokens = ["cls"] + (["dist"] if "dist" in prefix_token_names(model) else [])
    return [(name, token) for token in tokens for name, m in REGISTRY.items() if token in m.tokens]


def explain(model: nn.Module, images: torch.Tensor, method: str, target_class: int | Sequence[int] | torch.Tensor,
            token: str = "cls", head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
    """One explanation method's map of normalised images (B, C, H, W): (B, grid_h, grid_w), high = relevant.

    method: one of METHODS (a hyphen may stand for an underscore: 'pa-lrp'); the class-agnostic ones (rollout,
    raw attention) ignore target_class.
    """
    method = method.replace("-", "_") if isinstance(method, str) else method
    if method not in REGISTRY:
        raise VitlabError(f"method {method!r} is not one of {tuple(REGISTRY)}")
    m = REGISTRY[method]
    if token not in m.tokens:
        raise VitlabError(f"method {method!r} is read from the token(s) {m.tokens}, not {token!r}")
    given = dict(target_class=target_class, token=token, head_fusion=head_fusion, discard_ratio=discard_ratio)
    return m.function(model, images, **{k: v for k, v in given.items() if k in m.options})
