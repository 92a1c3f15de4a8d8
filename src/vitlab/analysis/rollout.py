"""Attention rollout (Abnar & Zuidema 2020) and gradient-weighted rollout, as in vit-explain.

Per layer: fuse the heads, drop the weakest entries of each row, add the identity for the
residual connection, renormalise the rows, and multiply the layers together. The chosen
token's row of the product, restricted to the patches, is the map.

Families: a distilled DeiT can be read from its distillation token (token='dist'); a model
without a class token is read as the mean over the patch queries; ConViT's early GPSA blocks
have no class token yet, so there it attends to itself only (an identity row and column);
CaiT's class-attention rows (the class token querying [cls, patches]) are composed with the
rollout of its patch-only self-attention blocks. Talking-heads maps can hold small negative
entries after their post-softmax head mixing; rollout clips them at 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .capture import AttentionMap, attention_maps, capture_attention

HEAD_FUSIONS = ("mean", "max", "min")
TOKENS = ("cls", "dist")


def fuse_heads(attn: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """(B, heads, Q, K) -> (B, Q, K) by the mean, max or min over heads."""
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    raise ValueError(f"head_fusion {head_fusion!r} is not one of {HEAD_FUSIONS}")


def discard_lowest(fused: torch.Tensor, ratio: float, protect: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """Zero the lowest ``ratio`` fraction of each row of (B, Q, K); the (query, key) entries in protect are kept."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"discard_ratio must lie in [0, 1), got {ratio}")
    K = fused.shape[-1]
    n = min(int(K * ratio), K - 1)
    if n == 0:
        return fused
    scores = fused.clone()
    for q, k in protect:
        if q < fused.shape[1]:
            scores[:, q, k] = float("inf")
    lowest = scores.topk(n, dim=-1, largest=False).indices  # (B, Q, n)
    return fused.scatter(-1, lowest, 0.0)


def _token_index(prefix: Sequence[str], token: str) -> int | None:
    """Index of the chosen token in the full sequence, or None to average over the patch queries."""
    if token not in TOKENS:
        raise ValueError(f"token {token!r} is not one of {TOKENS}")
    if token in prefix:
        return list(prefix).index(token)
    if token == "dist":
        raise ValueError("token='dist' needs a distilled model (DeiT with a distillation token); "
                         f"this model's prefix tokens are {tuple(prefix) or 'none'}")
    return None  # no class token: average over patch queries


def rollout_from_fused(maps: Sequence[AttentionMap], fused: Sequence[torch.Tensor], token: str = "cls",
                       discard_ratio: float = 0.0) -> torch.Tensor:
    """Rollout of per-layer head-fused maps (B, Q, K), described by ``maps``; returns (B, grid_h, grid_w)."""
    if not maps:
        raise ValueError("rollout needs at least one attention map")
    prefix = max((m.prefix_tokens for m in maps), key=len)  # the longest: the full prefix
    P = len(prefix)
    gh, gw = maps[-1].grid_size
    T = P + gh * gw  # tokens of the full sequence
    t = _token_index(prefix, token)
    B = fused[0].shape[0]
    result = torch.eye(T, device=fused[0].device).expand(B, T, T)
    for m, a in zip(maps, fused):
        a = a.float().clamp(min=0)  # (B, Q, K)
        Q, K = a.shape[-2:]
        protect = []
        if m.prefix_tokens[:1] == ("cls",):
            protect.append((0, 0))  # never drop the class token's attention to itself
        if t is not None and t < m.num_prefix:
            protect.append((t, t))
        a = discard_lowest(a, discard_ratio, protect)
        eye = torch.eye(K, device=a.device).expand(B, K, K)
        if Q == K:
            a = a + eye  # the residual connection
        elif Q == 1:  # class attention: only the class token (token 0) moves; the patches are copied through
            a = torch.cat([a + eye[:, :1], eye[:, 1:]], dim=1)
        else:
            raise ValueError(f"{m.name}: cannot roll out a map with {Q} queries and {K} keys")
        a = a / a.sum(dim=-1, keepdim=True)
        if K != T:  # prefix tokens not in this block yet (ConViT GPSA, CaiT self-attention): they keep themselves
            idx = torch.cat([torch.arange(m.num_prefix), torch.arange(P, T)]).to(a.device)
            full = torch.eye(T, device=a.device).repeat(B, 1, 1)
            full[:, idx[:, None], idx[None, :]] = a
            a = full
        result = a @ result  # (B, T, T)
    mask = result[:, t, P:] if t is not None else result[:, P:, P:].mean(dim=1)  # (B, N)
    mask = mask / mask.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return mask.reshape(B, gh, gw)


def rollout(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None = None,
            head_fusion: str = "mean", discard_ratio: float = 0.0, token: str = "cls") -> torch.Tensor:
    """Attention rollout of the chosen token ('cls' or 'dist') to the patches, (B, grid_h, grid_w), max 1.

    Takes captured maps, or a model and normalised images (B, C, H, W). A model without a class
    token (global average pooling) gives the mean over the patch queries instead.
    """
    if isinstance(maps_or_model, nn.Module):
        if images is None:
            raise ValueError("rollout(model, images): images are needed when a model is given")
        maps = attention_maps(maps_or_model, images)
    else:
        maps = list(maps_or_model)
    return rollout_from_fused(maps, [fuse_heads(m.attn, head_fusion) for m in maps], token, discard_ratio)


def grad_rollout(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
                 discard_ratio: float = 0.0, token: str = "cls") -> torch.Tensor:
    """Gradient-weighted rollout for target_class (one per image or one for all): (B, grid_h, grid_w), max 1.

    Each map is weighted by its gradient w.r.t. the class score (logit), the positive part kept,
    the heads averaged (vit-explain's original averages first and clips after); then the rollout
    as above. Gradients come from autograd.grad on the captured maps, so no parameter .grad is touched.
    """
    x = images.detach().clone().requires_grad_(True)  # the graph then exists even for frozen weights
    with torch.enable_grad(), capture_attention(model, keep_graph=True) as maps:
        logits = model(x)  # (B, classes)
        target = torch.as_tensor(target_class, device=logits.device).long().reshape(-1)
        if target.numel() == 1:
            target = target.expand(logits.shape[0])
        if target.numel() != logits.shape[0] or not (0 <= int(target.min()) and int(target.max()) < logits.shape[1]):
            raise ValueError(f"target_class must be one class index in [0, {logits.shape[1]}) or one per image, "
                             f"got {target_class}")
        score = logits.gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(score, [m.attn for m in maps], allow_unused=True)
    fused = [(m.attn.detach() * (g if g is not None else torch.zeros_like(m.attn))).clamp(min=0).mean(dim=1)
             for m, g in zip(maps, grads)]
    for m in maps:
        m.attn = m.attn.detach()
    return rollout_from_fused(maps, fused, token, discard_ratio)
