"""Attention rollout (Abnar & Zuidema 2020), gradient-weighted rollout as in vit-explain, and raw last-block
attention: attention read through depth, or at the last block only.

Per layer: fuse the heads, drop the weakest entries of each row, add the identity for the
residual connection, renormalise the rows, and multiply the layers together. The chosen
token's row of the product, restricted to the patches, is the map.

Families: a distilled DeiT can be read from its distillation token (token='dist'); a model
without a class token is read as the mean over the patch queries; ConViT's early GPSA blocks
have no class token yet, so there it attends to itself only (an identity row and column);
CaiT's class-attention rows (the class token querying [cls, patches]) are composed with the
rollout of its patch-only self-attention blocks. A model with an attention-pool head (SigLIP's ``map``)
is read from the head's learned query: its attention over every token, composed with the rollout of the
blocks, as the class token's row is read in a ViT. Talking-heads maps can hold small negative
entries after their post-softmax head mixing; rollout clips them at 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import VitlabError
from .capture import AttentionMap, maps_of, token_index
from .gradients import attention_gradients

HEAD_FUSIONS = ("mean", "max", "min")


def fuse_heads(attn: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """(B, heads, Q, K) -> (B, Q, K) by the mean, max or min over heads."""
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    raise VitlabError(f"head_fusion {head_fusion!r} is not one of {HEAD_FUSIONS}")


def discard_lowest(fused: torch.Tensor, ratio: float, protect: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """Zero the lowest ``ratio`` fraction of each row of (B, Q, K); the (query, key) entries in protect are kept."""
    if not 0.0 <= ratio < 1.0:
        raise VitlabError(f"discard_ratio must lie in [0, 1), got {ratio}")
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


def rollout_from_fused(maps: Sequence[AttentionMap], fused: Sequence[torch.Tensor], token: str = "cls",
                       discard_ratio: float = 0.0) -> torch.Tensor:
    """Rollout of per-layer head-fused maps (B, Q, K), described by ``maps``; returns (B, grid_h, grid_w)."""
    if not maps:
        raise VitlabError("rollout needs at least one attention map")
    prefix = max((m.prefix_tokens for m in maps), key=len)  # the longest: the full prefix
    P = len(prefix)
    gh, gw = maps[-1].grid_size
    T = P + gh * gw  # tokens of the full sequence
    t = token_index(prefix, token)
    B = fused[0].shape[0]
    result = torch.eye(T, device=fused[0].device).expand(B, T, T)
    pool = None
    for m, a in zip(maps, fused):
        a = a.float().clamp(min=0)  # (B, Q, K)
        Q, K = a.shape[-2:]
        if m.kind == "attn_pool":  # the head's learned query over every token: no residual, it is not a token
            pool = discard_lowest(a, discard_ratio)
            pool = pool / pool.sum(dim=-1, keepdim=True).clamp_min(1e-12)  # (B, 1, T)
            continue
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
            raise VitlabError(f"{m.name}: cannot roll out a map with {Q} queries and {K} keys")
        a = a / a.sum(dim=-1, keepdim=True)
        if K != T:  # prefix tokens not in this block yet (ConViT GPSA, CaiT self-attention): they keep themselves
            idx = torch.cat([torch.arange(m.num_prefix), torch.arange(P, T)]).to(a.device)
            full = torch.eye(T, device=a.device).repeat(B, 1, 1)
            full[:, idx[:, None], idx[None, :]] = a
            a = full
        result = a @ result  # (B, T, T)
    if pool is not None and token == "cls":
        mask = (pool @ result)[:, 0, P:]  # (B, N)
    else:
        mask = result[:, t, P:] if t is not None else result[:, P:, P:].mean(dim=1)  # (B, N)
    mask = mask / mask.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return mask.reshape(B, gh, gw)


def rollout(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None = None,
            head_fusion: str = "mean", discard_ratio: float = 0.0, token: str = "cls") -> torch.Tensor:
    """Attention rollout of the chosen token ('cls' or 'dist') to the patches, (B, grid_h, grid_w), max 1.

    Takes captured maps, or a model and normalised images (B, C, H, W). A model with an attention-pool head
    is read from its learned query; one without a class token (global average pooling) gives the mean over
    the patch queries instead.
    """
    maps = maps_of(maps_or_model, images, "rollout")
    return rollout_from_fused(maps, [fuse_heads(m.attn, head_fusion) for m in maps], token, discard_ratio)


def grad_rollout(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
                 discard_ratio: float = 0.0, token: str = "cls") -> torch.Tensor:
    """Gradient-weighted rollout for target_class (one per image or one for all): (B, grid_h, grid_w), max 1.

    Each map is weighted by its gradient w.r.t. the class score (logit), the positive part kept,
    the heads averaged (vit-explain's original averages first and clips after); then the rollout
    as above. Gradients come from autograd.grad on the captured maps, so no parameter .grad is touched.
    """
    maps, grads = attention_gradients(model, images, target_class)
    fused = [(m.attn * g).clamp(min=0).mean(dim=1) for m, g in zip(maps, grads)]
    return rollout_from_fused(maps, fused, token, discard_ratio)


def raw_attention(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None = None,
                  token: str = "cls") -> torch.Tensor:
    """The last block's attention from the chosen token to the patches, heads averaged: (B, grid_h, grid_w), max 1.

    The baseline of Chefer et al.: no propagation through depth. Without a class token, the mean
    over the patch queries; with an attention-pool head (the last attention), its learned query's row.
    """
    maps = maps_of(maps_or_model, images, "raw_attention")
    if not maps:
        raise VitlabError("raw_attention needs at least one attention map")
    m = maps[-1]
    prefix = max((x.prefix_tokens for x in maps), key=len)
    t = token_index(prefix, token)
    a = m.attn.float().clamp(min=0).mean(dim=1)  # (B, Q, K)
    P = m.num_prefix
    if t is not None and t >= P:
        raise VitlabError(f"{m.name} holds no {token!r} token")
    if a.shape[1] == 1:  # class attention: its one query is the class token
        row = a[:, 0, P:]
    else:
        row = a[:, t, P:] if t is not None else a[:, P:, P:].mean(dim=1)  # (B, N)
    row = row / row.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return row.reshape(-1, *m.grid_size)
