"""Positional-aware LRP (PA-LRP; Bakish, Zimerman, Chefer & Wolf, NeurIPS 2025, "Revisiting LRP: Positional
Attribution as the Missing Ingredient for Transformer Explainability").

AttnLRP treats position encodings as constants: the relevance that reaches them is absorbed and lost, and the map
shows only what the pixels hold. PA-LRP reads the input as position-token pairs and propagates relevance into the
positions too; a patch's relevance is then its pixels' plus its position's. On top of AttnLRP's rules
(``attnlrp.lrp_rules``):

- an additive position embedding (learned, fixed sin-cos or 2D; ``pos_embed``, ``t = e + p``): the addition's
  epsilon rule splits the token's relevance in proportion, ``R_p = p * g`` with g the gradient at the token; the
  position of patch i keeps ``sum_channels p_i g_i`` instead of losing it. g is read where the patch embedding's
  output enters the sum, per image. A table of another grid than the image's (resampled by the model) is
  resampled the same way, bilinearly, for the read-out.
- rotary embeddings (RoPE: EVA02, the RoPE ViTs, DINOv3): the rotation ``q cos + rot(q) sin`` is bilinear in the
  query (or key) and the position's sines and cosines, so the uniform rule gives half of the rotated query's
  relevance to the query and half to the position; the position's half of every rotated query and key in every
  block goes to that patch.

Input-independent relative biases (BEiT) and ConViT's positional attention act inside the softmax, whose rule
leaves them nothing to pass on: the map is then AttnLRP's plus the additive table's share, where there is one.
The map is min-max scaled to [0, 1] per image, as AttnLRP's.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..models import eva
from .attnlrp import EPSILON, _scaled, explained_logit, lrp_rules
from .capture import attention_modules
from .libragrad import scaled_map


@contextmanager
def _rope_rule(leaves: list[torch.Tensor]) -> Iterator[None]:
    """Within the block every rotary embedding is applied by the uniform rule: half of the rotated query's (or key's)
    relevance to the query, half to a per-image copy of the embedding, which is appended to ``leaves``
    (B, ..., N, 2 head_dim).

    The gradient arriving here is not yet halved for q k^T (``lrp_rules`` halves it at the attention's input, which
    is the same wherever the path is linear), so the embedding's copy gets a quarter of it (half of the product's
    half) and the query half, which the attention's input then halves again."""
    plain = eva.apply_rope

    def uniform(x: torch.Tensor, emb: torch.Tensor, half: bool = False) -> torch.Tensor:
        leaf = emb.detach().expand(*x.shape[:-1], emb.shape[-1]).clone().requires_grad_(True)
        leaves.append(leaf)
        return plain(_scaled(x, 0.5), _scaled(leaf, 0.25), half)

    eva.apply_rope = uniform
    try:
        yield
    finally:
        eva.apply_rope = plain


def _position_table(model: nn.Module, grid: tuple[int, int]) -> torch.Tensor | None:
    """The additive position embedding of the patches, (N, D) on ``grid``, or None without one."""
    table = getattr(model, "pos_embed", None)
    if not isinstance(table, torch.Tensor):
        return None
    table = table.detach()
    D = table.shape[-1]
    if table.dim() == 4:  # (1, gh, gw, D): a NaFlex table on its own grid
        own = tuple(table.shape[1:3])
        patches = table.reshape(-1, D)
    else:
        own = tuple(model.patch_embed.grid_size)
        n = own[0] * own[1]
        if table.shape[1] < n:
            return None
        patches = table[0, -n:]
    if own != tuple(grid):
        img = patches.reshape(1, *own, D).permute(0, 3, 1, 2)
        patches = F.interpolate(img, size=grid, mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
    return patches.reshape(-1, D)


def pa_lrp_cells(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
                 token: str = "cls", epsilon: float = EPSILON) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PA-LRP's relevance per patch (B, N): (the pixels' summed per cell, the position's), and the logits (B,)."""
    attention_modules(model)  # refuses a model without attention in one line
    gh, gw = model.patch_embed.grid_size
    N = gh * gw
    leaves: list[torch.Tensor] = []
    embedded: list[torch.Tensor] = []
    handle = model.patch_embed.register_forward_hook(lambda m, i, out: embedded.append(out))
    x = images.detach().clone().requires_grad_(True)
    try:
        with torch.enable_grad(), lrp_rules(model, epsilon), _rope_rule(leaves):
            logit = explained_logit(model, x, target_class, token)
            grads = torch.autograd.grad(logit.sum(), [x, *embedded, *leaves], allow_unused=True)
    finally:
        handle.remove()
    g_x, g_emb, g_rope = grads[0], grads[1:1 + len(embedded)], grads[1 + len(embedded):]
    B = len(images)
    pixels = F.adaptive_avg_pool2d((x * g_x).detach().float().sum(dim=1, keepdim=True), (gh, gw)) * (
        (images.shape[-2] * images.shape[-1]) / N)  # the sum over each cell's pixels (equal cells)
    position = torch.zeros(B, N, dtype=torch.float32, device=images.device)
    table = _position_table(model, (gh, gw))
    if table is not None and embedded and g_emb[0] is not None and g_emb[0].shape[-1] == table.shape[-1]:
        g = g_emb[0].reshape(B, -1, table.shape[-1])[:, -N:]  # the gradient at the sum e + p, per image
        position += (table.to(g.dtype) * g).sum(-1).detach().float()
    for leaf, g in zip(leaves, g_rope):
        if g is not None:  # (B, ..., N, 2 head_dim): every axis but the patches summed
            position += (leaf * g).detach().float().sum(-1).reshape(B, -1, N).sum(1)
    return pixels.flatten(1), position, logit.detach()


def pa_lrp(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
           token: str = "cls") -> torch.Tensor:
    """PA-LRP per cell of the token grid for target_class: the pixels' and the position's relevance of each patch,
    (B, grid_h, grid_w) min-max scaled to [0, 1]."""
    pixels, position, _ = pa_lrp_cells(model, images, target_class, token)
    return scaled_map(model, pixels + position)
