"""What the class-specific methods share: the target class's logit and its gradients, taken with autograd.grad so
that no parameter's .grad is touched. And the plainest gradient method, saliency (Simonyan, Vedaldi & Zisserman
2014), pooled to the model's patch grid so that it ranks the same patches as the attention methods.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .capture import AttentionMap, capture_attention


def class_targets(target_class: int | Sequence[int] | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """One class index per image, (B,), from one index for all or one per image; ValueError if out of range."""
    target = torch.as_tensor(target_class, device=logits.device).long().reshape(-1)
    if target.numel() == 1:
        target = target.expand(logits.shape[0])
    if target.numel() != logits.shape[0] or not (0 <= int(target.min()) and int(target.max()) < logits.shape[1]):
        raise VitlabError(f"target_class must be one class index in [0, {logits.shape[1]}) or one per image, "
                         f"got {target_class}")
    return target


def attention_gradients(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor
                        ) -> tuple[list[AttentionMap], list[torch.Tensor]]:
    """Every attention map and its gradient w.r.t. the target class's logit (one class per image or one for all).

    Gradients come from autograd.grad on the captured maps, so no parameter .grad is touched; a map
    the logit does not depend on gets a zero gradient. The returned maps are detached.
    """
    x = images.detach().clone().requires_grad_(True)  # the graph then exists even for frozen weights
    with torch.enable_grad(), capture_attention(model, keep_graph=True) as maps:
        logits = model(x)  # (B, classes)
        target = class_targets(target_class, logits)
        score = logits.gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(score, [m.attn for m in maps], allow_unused=True)
    grads = [g.detach() if g is not None else torch.zeros_like(m.attn) for m, g in zip(maps, grads)]
    for m in maps:
        m.attn = m.attn.detach()
    return maps, grads


def gradient_saliency(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor
                      ) -> torch.Tensor:
    """Saliency (Simonyan et al. 2014) per patch for target_class: (B, grid_h, grid_w), max 1.

    Per pixel the largest absolute gradient of the target logit over the channels, then the mean
    over each cell of the model's token grid (``patch_embed.grid_size``: a patch, a hybrid's stride, or the
    overlapping windows of an unpadded CNN stem).
    Reads no attention: a baseline the attention methods should beat. The model runs in eval
    mode and is put back as it was; no parameter .grad is touched.
    """
    x = images.detach().clone().requires_grad_(True)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.enable_grad():
            logits = model(x)  # (B, classes)
            target = class_targets(target_class, logits)
            (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), [x])
    finally:
        for m, training in modes.items():
            m.training = training
    pixels = grad.float().abs().amax(dim=1, keepdim=True)  # (B, 1, H, W)
    cells = F.adaptive_avg_pool2d(pixels, model.patch_embed.grid_size)[:, 0]  # (B, grid_h, grid_w)
    return cells / cells.amax(dim=(1, 2), keepdim=True).clamp_min(1e-12)
