"""Mean attention distance (ViT paper, Fig. 11) and ConViT's gates and positional attention.

The distance of one query is the attention-weighted mean of the distances, in pixels, from its
patch centre to every key's patch centre; it is averaged over queries and images, per head.
Like the paper, only patch-to-patch attention counts: prefix rows and columns are dropped and
the patch rows renormalised. Class-attention blocks (CaiT; one query, the class token) are
excluded. Talking-heads maps may hold small negative entries after their head mixing; they
are clipped at 0 before renormalising.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from ..models.convit import relative_indices
from ..progress import progress_bar
from .capture import ONE_QUERY, AttentionMap, attention_maps, attention_modules


def patch_distances(grid_size: tuple[int, int], patch_size: tuple[int, int]) -> torch.Tensor:
    """(N, N) distances in pixels between the centres of patches i and j of a row-major grid."""
    gh, gw = grid_size
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    ys = rows.flatten().double() * patch_size[0]  # (N,)
    xs = cols.flatten().double() * patch_size[1]
    return ((ys[:, None] - ys[None]) ** 2 + (xs[:, None] - xs[None]) ** 2).sqrt().float()


def attention_distance(attn: torch.Tensor, grid_size: tuple[int, int], patch_size: tuple[int, int],
                       num_prefix: int = 0) -> torch.Tensor:
    """Mean attention distance in pixels per head, (heads,), of a map (B, heads, prefix + N, prefix + N)."""
    N = grid_size[0] * grid_size[1]
    a = attn[..., num_prefix:, num_prefix:].float().clamp(min=0)  # (B, H, N, N) patch-to-patch only
    if a.shape[-2:] != (N, N):
        raise VitlabError(f"expected a map with {num_prefix} prefix tokens and {N} patch queries and keys "
                          f"({grid_size[0]}x{grid_size[1]} grid), got shape {tuple(attn.shape)}")
    a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    dist = patch_distances(grid_size, patch_size).to(a.device)
    return (a * dist).sum(dim=-1).mean(dim=(0, 2))  # weighted distance per query, then mean over images, queries


def map_distances(maps: list[AttentionMap]) -> torch.Tensor:
    """(layers, heads) mean attention distance of captured maps; one-query maps (class attention, the attention-pool
    head) excluded."""
    rows = [attention_distance(m.attn, m.grid_size, m.patch_size, m.num_prefix)
            for m in maps if m.kind not in ONE_QUERY]
    return torch.stack(rows)


def distance_layer_names(model: nn.Module) -> list[tuple[str, str]]:
    """(name, kind) of the blocks mean_attention_distance reports, in its row order."""
    return [(name, kind) for name, kind, _ in attention_modules(model) if kind not in ONE_QUERY]


def mean_attention_distance(model: nn.Module, images: torch.Tensor, batch_size: int = 64,
                            progress: bool | None = None) -> torch.Tensor:
    """(layers, heads) mean attention distance in pixels over normalised images (B, C, H, W).

    progress: a bar, with its time left; None shows one when there is more than one batch.
    """
    if batch_size < 1:
        raise VitlabError(f"batch_size must be at least 1, got {batch_size}")
    starts = range(0, len(images), batch_size)
    if not starts:
        raise VitlabError("mean_attention_distance needs at least one image")
    show = len(starts) > 1 if progress is None else progress
    total, count = None, 0
    with progress_bar(total=len(images), desc="attention distance", unit="img", disable=not show) as bar:
        for s in starts:
            batch = images[s:s + batch_size]
            d = map_distances(attention_maps(model, batch)) * len(batch)  # (layers, heads)
            total = d if total is None else total + d
            count += len(batch)
            bar.update(len(batch))
    return total / count


def _gpsa_modules(model: nn.Module, what: str) -> list[nn.Module]:
    gpsa = [m for _, kind, m in attention_modules(model) if kind == "gpsa"]
    if not gpsa:
        raise VitlabError(f"{what} needs a ConViT (gated positional self-attention blocks); "
                          f"{type(model).__name__} has none")
    return gpsa


def convit_gates(model: nn.Module) -> torch.Tensor:
    """(local_layers, heads) ConViT gates sigmoid(gating_param): the weight of each head's positional attention."""
    return torch.stack([torch.sigmoid(m.gating_param.detach().float()) for m in _gpsa_modules(model, "convit_gates")])


def gpsa_positional_attention(model: nn.Module) -> torch.Tensor:
    """(local_layers, heads, N, N) each GPSA head's positional attention alone, softmax(pos_proj(rel_indices))."""
    gh, gw = model.patch_embed.grid_size
    maps = []
    with torch.no_grad():
        for m in _gpsa_modules(model, "gpsa_positional_attention"):
            rel = relative_indices(gh, gw).to(m.pos_proj.weight)  # (1, N, N, 3)
            maps.append(m.pos_proj(rel).permute(0, 3, 1, 2).softmax(dim=-1)[0])  # (H, N, N)
    return torch.stack(maps).float()


def positional_attention_distance(model: nn.Module) -> torch.Tensor:
    """(local_layers, heads) mean distance in pixels of each GPSA head's positional branch alone."""
    grid, patch = tuple(model.patch_embed.grid_size), tuple(model.patch_embed.patch_size)
    return torch.stack([attention_distance(pos[None], grid, patch) for pos in gpsa_positional_attention(model)])
