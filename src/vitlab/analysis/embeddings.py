"""What the embedding layers learned (ViT paper, Fig. 7): position-embedding similarity and filter components."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from ..models.layers import PatchEmbed


def position_similarity(model: nn.Module) -> torch.Tensor:
    """(grid_h, grid_w, grid_h, grid_w) cosine similarity of each patch's position embedding with every other's."""
    if not hasattr(model, "pos_embed"):
        raise VitlabError(f"{type(model).__name__} has no position embedding: position similarity needs a "
                          "Vision Transformer with a learned or sin-cos position embedding")
    if model.pos_embed is None:
        raise VitlabError(f"this {type(model).__name__} has no position embedding (built with pos_embed='none' or "
                          "use_pos_embed=False): position similarity needs a learned or sin-cos one")
    gh, gw = model.patch_embed.grid_size
    pos = model.pos_embed.detach().float()[0]  # (prefix + N, D) or (N, D)
    if pos.ndim == 3:  # a table on its own (gh, gw) grid, resized to each input's (NaFlex ViT)
        (gh, gw), pos = pos.shape[:2], pos.flatten(0, 1)
    N = gh * gw
    if pos.shape[0] < N:
        raise VitlabError(f"the position embedding has {pos.shape[0]} entries, fewer than the {gh}x{gw} patches")
    pos = F.normalize(pos[-N:], dim=-1)  # patch entries come after any prefix entries
    return (pos @ pos.T).reshape(gh, gw, gh, gw)


def rotary_similarity(model: nn.Module) -> torch.Tensor:
    """(grid_h, grid_w, grid_h, grid_w) cosine similarity of each patch's rotary embedding (its sines and cosines)
    with every other's: the mean cos of their angle differences, what position alone adds to the score of a query
    and key that are otherwise alike."""
    emb = model.rotary_embedding() if hasattr(model, "rotary_embedding") else None
    if emb is None:
        raise VitlabError(f"this {type(model).__name__} has no rotary position embedding (RoPE)")
    gh, gw = model.patch_embed.grid_size
    emb = F.normalize(emb.detach().float(), dim=-1)
    return (emb @ emb.T).reshape(gh, gw, gh, gw)


def filter_components(weight: torch.Tensor, k: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k principal components (k, C, ph, pw) of filters (D, C, ph, pw), and their explained variance ratios (k,)."""
    if k < 1:
        raise VitlabError(f"k must be at least 1, got {k}")
    D = weight.shape[0]
    x = weight.detach().float().reshape(D, -1)  # (D, C*ph*pw)
    x = x - x.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)  # vh: (min(D, C*ph*pw), C*ph*pw)
    k = min(k, vh.shape[0])
    var = s ** 2
    ratio = var / var.sum().clamp_min(1e-12)
    return vh[:k].reshape(k, *weight.shape[1:]), ratio[:k]


def embedding_filters(model: nn.Module, k: int = 28) -> torch.Tensor:
    """(k, C, ph, pw) top-k principal components of the patch-embedding filters patch_embed.proj.weight."""
    embed = getattr(model, "patch_embed", None)
    if not isinstance(embed, PatchEmbed):
        what = ("a hybrid: its patch embedding is a ResNet followed by a 1x1 projection, not filters over pixels"
                if embed is not None else "a CNN without a patch embedding")
        raise VitlabError(f"{type(model).__name__} is {what}; embedding_filters needs a ViT, DeiT, ConVit or Cait "
                          "with a strided-convolution patch embedding")
    return filter_components(embed.proj.weight, k)[0]
