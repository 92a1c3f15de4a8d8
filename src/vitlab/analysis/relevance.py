"""The gradient-weighted attention relevance of Chefer, Gur & Wolf (ICCV 2021).

It keeps rollout's token bookkeeping but neither drops entries nor renormalises rows:
``R = I; R += mean_heads((dA * A)^+) @ R`` per block, dA the gradient of the target logit.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import VitlabError
from .capture import AttentionMap, token_index
from .gradients import attention_gradients


def _min_max(x: torch.Tensor) -> torch.Tensor:
    """(B, N) -> each row scaled to [0, 1] by its minimum and maximum; a constant row becomes 0."""
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    return (x - lo) / (hi - lo).clamp_min(1e-12)


def relevance_from_maps(maps: Sequence[AttentionMap], grads: Sequence[torch.Tensor], token: str = "cls"
                        ) -> torch.Tensor:
    """Chefer, Gur & Wolf (ICCV 2021) relevance from maps and their gradients; (B, grid_h, grid_w) in [0, 1].

    R starts as the identity over all T tokens; per block, in forward order,
    ``R += mean_heads((grad * A).clamp(min=0)) @ R``. Tokens a block does not hold (the class token
    before ConViT's first MHSA block or CaiT's class attention) get zero rows and columns there, so
    they keep their relevance; a class-attention block (one query) updates the class token's row
    only. The map is the chosen token's row over the patch columns (prefix columns dropped), the
    attention-pool head's learned query (``cam @ R``: it is no token, so it has no identity) for a
    model that pools so, or the mean over patch rows without a class token, scaled to [0, 1] by its
    minimum and maximum as in the authors' code.
    """
    if not maps:
        raise VitlabError("relevance needs at least one attention map")
    prefix = max((m.prefix_tokens for m in maps), key=len)
    P = len(prefix)
    gh, gw = maps[-1].grid_size
    T = P + gh * gw
    t = token_index(prefix, token)
    B = maps[0].attn.shape[0]
    device = maps[0].attn.device
    R = torch.eye(T, device=device).repeat(B, 1, 1)  # (B, T, T)
    pool = None
    for m, g in zip(maps, grads):
        cam = (g.float() * m.attn.float()).clamp(min=0).mean(dim=1)  # (B, Q, K)
        Q, K = cam.shape[-2:]
        if m.kind == "attn_pool":  # the head's learned query over every token
            pool = cam @ R  # (B, 1, T)
            continue
        keys = torch.cat([torch.arange(m.num_prefix), torch.arange(P, T)]).to(device)  # this block's tokens
        if keys.numel() != K:
            raise VitlabError(f"{m.name}: {K} keys do not fit prefix {m.prefix_tokens} and a {gh}x{gw} grid")
        full = torch.zeros(B, T, T, device=device)
        if Q == K:
            full[:, keys[:, None], keys[None, :]] = cam
        elif Q == 1:  # class attention: only the class token (token 0) queries
            full[:, :1, keys] = cam
        else:
            raise VitlabError(f"{m.name}: cannot propagate relevance through {Q} queries and {K} keys")
        R = R + full @ R
    if pool is not None and token == "cls":
        rel = pool[:, 0, P:]
    else:
        rel = R[:, t, P:] if t is not None else R[:, P:, P:].mean(dim=1)  # (B, N)
    return _min_max(rel).reshape(B, gh, gw)


def relevance(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
              token: str = "cls") -> torch.Tensor:
    """Gradient-weighted attention relevance (Chefer, Gur & Wolf 2021) for target_class: (B, grid_h, grid_w) in [0, 1].

    target_class is one class per image or one for all; token 'cls' or 'dist' picks the row
    read out (a model without a class token gives the mean over the patch rows).
    """
    maps, grads = attention_gradients(model, images, target_class)
    return relevance_from_maps(maps, grads, token)
