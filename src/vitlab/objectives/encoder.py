"""What the pre-training objectives share: the families they apply to, the encoder's unused parts set aside,
and the split of an objective into its encoder (a plain model) and the rest (the decoder state)."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from ..models.vit import VisionTransformer


def check_encoder(model: nn.Module | type, method: str) -> None:
    """Raise a one-line ValueError unless ``method`` ('mae' or 'mpp') applies to the model's family (a model or its
    class)."""
    cls = model if isinstance(model, type) else type(model)
    reason = getattr(cls, "no_pretrain", "") or (
        "" if issubclass(cls, VisionTransformer) else "pre-training runs ViT and DeiT encoders only")
    if reason:
        raise VitlabError(f"{method.upper()} pre-training does not apply to {cls.__name__}: {reason}")


def set_aside_head(encoder: VisionTransformer) -> None:
    """Freeze what pre-training never reaches (classifier heads, fc_norm), so DDP sees no unused parameters.

    They stay in the encoder's state dict, which is therefore exactly the plain model's.
    """
    for name in ("head", "head_dist", "fc_norm"):
        module = getattr(encoder, name, None)
        if module is not None:
            module.requires_grad_(False)


def no_weight_decay(objective: nn.Module) -> set[str]:
    """Parameter names an objective keeps out of weight decay: its encoder's (position embedding, tokens), as in
    supervised training, and its own mask token."""
    return {*objective.encoder.no_weight_decay(), "mask_token"}


def run_blocks(encoder: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """(B, T, D) embedded tokens -> the encoder's output tokens: norm_pre (where the model has one), blocks, norm."""
    norm_pre = getattr(encoder, "norm_pre", None)
    if norm_pre is not None:
        x = norm_pre(x)
    return encoder.norm(encoder.blocks(x))


def output_norm(encoder: VisionTransformer) -> nn.Module:
    """A LayerNorm for the token outputs of a model whose final norm is fc_norm on the pooled vector (GAP)."""
    return nn.LayerNorm(encoder.embed_dim, eps=1e-6) if isinstance(encoder.norm, nn.Identity) else nn.Identity()


def split_pretrained(objective: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(encoder, decoder_state): the plain model (for vitlab.save) and every other tensor of the objective."""
    state = {k: v.detach().cpu().contiguous() for k, v in objective.state_dict().items()
             if not k.startswith("encoder.")}
    return objective.encoder, state


def load_decoder_state(objective: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a decoder_state from split_pretrained back into an objective; every tensor must find its place."""
    result = objective.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith("encoder.")]
    if missing or result.unexpected_keys:
        raise VitlabError(f"decoder state does not fit this {type(objective).__name__}: "
                          f"missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
