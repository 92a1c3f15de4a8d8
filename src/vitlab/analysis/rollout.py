"""Attention rollout (Abnar & Zuidema 2020), gradient-weighted rollout as in vit-explain, the
gradient-weighted relevance of Chefer, Gur & Wolf (ICCV 2021), and raw last-block attention.

Per layer: fuse the heads, drop the weakest entries of each row, add the identity for the
residual connection, renormalise the rows, and multiply the layers together. The chosen
token's row of the product, restricted to the patches, is the map.

Families: a distilled DeiT can be read from its distillation token (token='dist'); a model
without a class token is read as the mean over the patch queries; ConViT's early GPSA blocks
have no class token yet, so there it attends to itself only (an identity row and column);
CaiT's class-attention rows (the class token querying [cls, patches]) are composed with the
rollout of its patch-only self-attention blocks. Talking-heads maps can hold small negative
entries after their post-softmax head mixing; rollout clips them at 0.

Relevance keeps the same token bookkeeping but neither drops entries nor renormalises rows:
``R = I; R += mean_heads((dA * A)^+) @ R`` per block, dA the gradient of the target logit.
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


def _maps(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None,
          caller: str) -> list[AttentionMap]:
    """Captured maps as given, or captured from a model on normalised images."""
    if isinstance(maps_or_model, nn.Module):
        if images is None:
            raise ValueError(f"{caller}(model, images): images are needed when a model is given")
        return attention_maps(maps_or_model, images)
    return list(maps_or_model)


def rollout(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None = None,
            head_fusion: str = "mean", discard_ratio: float = 0.0, token: str = "cls") -> torch.Tensor:
    """Attention rollout of the chosen token ('cls' or 'dist') to the patches, (B, grid_h, grid_w), max 1.

    Takes captured maps, or a model and normalised images (B, C, H, W). A model without a class
    token (global average pooling) gives the mean over the patch queries instead.
    """
    maps = _maps(maps_or_model, images, "rollout")
    return rollout_from_fused(maps, [fuse_heads(m.attn, head_fusion) for m in maps], token, discard_ratio)


def _targets(target_class: int | Sequence[int] | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """One class index per image, (B,), from one index for all or one per image; ValueError if out of range."""
    target = torch.as_tensor(target_class, device=logits.device).long().reshape(-1)
    if target.numel() == 1:
        target = target.expand(logits.shape[0])
    if target.numel() != logits.shape[0] or not (0 <= int(target.min()) and int(target.max()) < logits.shape[1]):
        raise ValueError(f"target_class must be one class index in [0, {logits.shape[1]}) or one per image, "
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
        target = _targets(target_class, logits)
        score = logits.gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(score, [m.attn for m in maps], allow_unused=True)
    grads = [g.detach() if g is not None else torch.zeros_like(m.attn) for m, g in zip(maps, grads)]
    for m in maps:
        m.attn = m.attn.detach()
    return maps, grads


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
    only. The map is the chosen token's row over the patch columns (prefix columns dropped), or
    the mean over patch rows without a class token, scaled to [0, 1] by its minimum and maximum
    as in the authors' code.
    """
    if not maps:
        raise ValueError("relevance needs at least one attention map")
    prefix = max((m.prefix_tokens for m in maps), key=len)
    P = len(prefix)
    gh, gw = maps[-1].grid_size
    T = P + gh * gw
    t = _token_index(prefix, token)
    B = maps[0].attn.shape[0]
    device = maps[0].attn.device
    R = torch.eye(T, device=device).repeat(B, 1, 1)  # (B, T, T)
    for m, g in zip(maps, grads):
        cam = (g.float() * m.attn.float()).clamp(min=0).mean(dim=1)  # (B, Q, K)
        Q, K = cam.shape[-2:]
        keys = torch.cat([torch.arange(m.num_prefix), torch.arange(P, T)]).to(device)  # this block's tokens
        if keys.numel() != K:
            raise ValueError(f"{m.name}: {K} keys do not fit prefix {m.prefix_tokens} and a {gh}x{gw} grid")
        full = torch.zeros(B, T, T, device=device)
        if Q == K:
            full[:, keys[:, None], keys[None, :]] = cam
        elif Q == 1:  # class attention: only the class token (token 0) queries
            full[:, :1, keys] = cam
        else:
            raise ValueError(f"{m.name}: cannot propagate relevance through {Q} queries and {K} keys")
        R = R + full @ R
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


def raw_attention(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None = None,
                  token: str = "cls") -> torch.Tensor:
    """The last block's attention from the chosen token to the patches, heads averaged: (B, grid_h, grid_w), max 1.

    The baseline of Chefer et al.: no propagation through depth. Without a class token, the mean
    over the patch queries.
    """
    maps = _maps(maps_or_model, images, "raw_attention")
    if not maps:
        raise ValueError("raw_attention needs at least one attention map")
    m = maps[-1]
    prefix = max((x.prefix_tokens for x in maps), key=len)
    t = _token_index(prefix, token)
    a = m.attn.float().clamp(min=0).mean(dim=1)  # (B, Q, K)
    P = m.num_prefix
    if t is not None and t >= P:
        raise ValueError(f"{m.name} holds no {token!r} token")
    if a.shape[1] == 1:  # class attention: its one query is the class token
        row = a[:, 0, P:]
    else:
        row = a[:, t, P:] if t is not None else a[:, P:, P:].mean(dim=1)  # (B, N)
    row = row / row.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return row.reshape(-1, *m.grid_size)


METHODS = ("raw_attention", "rollout", "grad_rollout", "relevance")
METHOD_LABELS = {"raw_attention": "raw attention (last block)", "rollout": "rollout", "grad_rollout": "grad rollout",
                 "relevance": "relevance (Chefer et al.)"}


def explanation_methods(model: nn.Module) -> list[tuple[str, str]]:
    """(method, token) pairs that apply to the model: every method from 'cls', and from 'dist' for a distilled one."""
    from .capture import prefix_token_names

    tokens = ["cls"] + (["dist"] if "dist" in prefix_token_names(model) else [])
    return [(method, token) for token in tokens for method in METHODS]


def explain(model: nn.Module, images: torch.Tensor, method: str, target_class: int | Sequence[int] | torch.Tensor,
            token: str = "cls", head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
    """One explanation method's map of normalised images (B, C, H, W): (B, grid_h, grid_w), high = relevant.

    method: one of METHODS; rollout and raw attention ignore target_class (they are class-agnostic).
    """
    if method == "raw_attention":
        return raw_attention(model, images, token=token)
    if method == "rollout":
        return rollout(model, images, head_fusion=head_fusion, discard_ratio=discard_ratio, token=token)
    if method == "grad_rollout":
        return grad_rollout(model, images, target_class, discard_ratio=discard_ratio, token=token)
    if method == "relevance":
        return relevance(model, images, target_class, token=token)
    raise ValueError(f"method {method!r} is not one of {METHODS}")
