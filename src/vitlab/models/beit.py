"""BEiT (Bao et al. 2022) and data2vec-vision: a ViT with a learned relative position bias in every attention.

Each block's attention adds a bias to its logits looked up by the relative offset of query and key on the
patch grid (``relative_position_bias_table``, one row per offset and per head, three more rows for the class
token's pairs), or one table shared by every block (``rel_pos_bias``); the absolute position embedding is
usually absent. Queries and values carry biases, keys do not (``q_bias``, ``v_bias``). LayerScale on both
branches; the class token or, by default, the mean patch token through ``fc_norm`` feeds the head.

timm's Beit takes one input size; with ``dynamic_img_size=True`` other sizes are taken as transformers' BEiT
takes them (the tables resampled bilinearly, the absolute position embedding bicubically).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec
from .layers import (
    Attention,
    Block,
    drop_path_rates,
    get_act_layer,
    init_weights_rescaled,
    resample_abs_pos_embed,
    to_2tuple,
)


def relative_position_index(grid: tuple[int, int]) -> torch.Tensor:
    """(N + 1, N + 1) row of the bias table for every (query, key) pair of [cls, h*w patches] (timm's order):
    patch pairs by their offset (dy, dx), then the rows for cls->patch, patch->cls and cls->cls."""
    h, w = grid
    coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")).flatten(1)  # (2, N)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # (N, N, 2)
    offsets = (2 * h - 1) * (2 * w - 1)
    index = torch.zeros(h * w + 1, h * w + 1, dtype=torch.long)
    index[1:, 1:] = (rel[..., 0] + h - 1) * (2 * w - 1) + rel[..., 1] + w - 1
    index[0, :], index[:, 0], index[0, 0] = offsets, offsets + 1, offsets + 2
    return index


def rel_pos_bias_table(grid: tuple[int, int], num_heads: int) -> nn.Parameter:
    """A zero (offsets + 3, heads) table for a patch grid: one row per (dy, dx) offset, three for the class token."""
    h, w = grid
    return nn.Parameter(torch.zeros((2 * h - 1) * (2 * w - 1) + 3, num_heads))


def resample_rel_pos_table(table: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> torch.Tensor:
    """A table for ``old_grid`` resampled to ``new_grid`` as transformers' BEiT does at another input size: the
    (2h - 1) x (2w - 1) offset rows bilinearly, as an image per head; the three class-token rows as they are."""
    if tuple(old_grid) == tuple(new_grid):
        return table
    (oh, ow), (nh, nw) = [(2 * g[0] - 1, 2 * g[1] - 1) for g in (old_grid, new_grid)]
    offsets = table[:oh * ow].reshape(1, oh, ow, -1).permute(0, 3, 1, 2)
    offsets = F.interpolate(offsets, size=(nh, nw), mode="bilinear", align_corners=False)
    return torch.cat([offsets.permute(0, 2, 3, 1).reshape(nh * nw, -1), table[oh * ow:]])


def _geometric_offsets(src: int, dst: int) -> torch.Tensor:
    """The ``src`` source offsets of one axis placed on the ``dst`` target axis (both 2g - 1 long) as BEiT's
    fine-tuning code places them (timm's checkpoint rule): spacing that grows by a factor q from the centre, q found
    by bisection on [1.01, 1.5] so that the outermost lands near dst // 2 (never below 1.01: when shrinking, the
    source spans more than the target)."""
    left, right, q = 1.01, 1.5, 1.01
    while right - left > 1e-6:
        q = (left + right) / 2.0
        if (1.0 - q ** (src // 2)) / (1.0 - q) > dst // 2:
            right = q
        else:
            left = q
    dis, cur = [], 1.0
    for i in range(src // 2):
        dis.append(cur)
        cur += q ** (i + 1)
    return torch.tensor([-d for d in reversed(dis)] + [0.0] + dis)


def _linear_weights(points: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For each x, its two neighbours on the sorted ``points`` and their linear weights; beyond the ends the end
    value (timm's RegularGridInterpolator in 'linear' mode)."""
    right = torch.bucketize(x, points).clamp(max=len(points) - 1)
    left = (right - 1).clamp(min=0)
    d_left, d_right = (x - points[left]).clamp(min=0), (points[right] - x).clamp(min=0)
    both = (d_left == 0) & (d_right == 0)
    d_left, d_right = torch.where(both, 1.0, d_left), torch.where(both, 1.0, d_right)
    total = d_left + d_right
    return left, right, d_right / total, d_left / total


def resize_rel_pos_table(table: torch.Tensor, new_grid: tuple[int, int]) -> torch.Tensor:
    """A checkpoint's table (a square source grid, three class-token rows last) for a model at another input size,
    as timm resizes it on load: each head's offsets as a (2g - 1)^2 image sampled at BEiT's geometric offsets,
    read bilinearly at the new grid's integer offsets; the class-token rows kept. One line when the source grid
    is not square and differs (the rows do not say its shape)."""
    nh, nw = 2 * new_grid[0] - 1, 2 * new_grid[1] - 1
    extra = 3
    n = table.shape[0] - extra
    side = int(round(n ** 0.5))
    if side * side != n:
        if n == nh * nw:
            return table
        raise VitlabError(f"a relative_position_bias_table of {table.shape[0]} rows comes from a grid that is not "
                          f"square; accepted: the checkpoint's own input size, or a square checkpoint")
    if (side, side) == (nh, nw):
        return table
    values = table[:n].float().reshape(side, side, -1)
    ys, xs = _geometric_offsets(side, nh), _geometric_offsets(side, nw)
    ty, tx = nh // 2, nw // 2
    ly, ry, wly, wry = _linear_weights(ys, torch.arange(-ty, ty + 1, dtype=torch.float32))
    lx, rx, wlx, wrx = _linear_weights(xs, torch.arange(-tx, tx + 1, dtype=torch.float32))
    rows = values[ly] * wly[:, None, None] + values[ry] * wry[:, None, None]  # (nh, side, heads)
    out = rows[:, lx] * wlx[None, :, None] + rows[:, rx] * wrx[None, :, None]  # (nh, nw, heads)
    return torch.cat([out.reshape(nh * nw, -1).to(table.dtype), table[n:]])


def gather_bias(table: torch.Tensor, index: torch.Tensor, window: tuple[int, int],
                grid: tuple[int, int] | None = None) -> torch.Tensor:
    """The (heads, N + 1, N + 1) bias of every (query, key) pair of ``grid`` from a table learned for ``window``
    (``index``: that window's relative_position_index)."""
    if grid is not None and tuple(grid) != tuple(window):
        index = relative_position_index(grid).to(table.device)
        table = resample_rel_pos_table(table, window, grid)
    n = index.shape[0]
    return table[index.view(-1)].view(n, n, -1).permute(2, 0, 1)


class RelativePositionBias(nn.Module):
    """One table for every block (``use_shared_rel_pos_bias``); called, the (heads, N + 1, N + 1) bias."""

    def __init__(self, grid_size, num_heads: int):
        super().__init__()
        self.window_size = to_2tuple(grid_size)
        self.relative_position_bias_table = rel_pos_bias_table(self.window_size, num_heads)
        self.register_buffer("relative_position_index", relative_position_index(self.window_size), persistent=False)

    def forward(self, grid: tuple[int, int] | None = None) -> torch.Tensor:
        return gather_bias(self.relative_position_bias_table, self.relative_position_index, self.window_size, grid)


class RelPosAttention(Attention):
    """Multi-head attention with BEiT's query and value biases and, given a grid, its own relative position bias.

    The bias enters the logits before the softmax on both paths, so the probabilities ``attn_map`` sees are
    the ones the fused kernel uses.
    """

    def __init__(self, dim, num_heads=8, qkv_bias=True, attn_drop=0.0, proj_drop=0.0, window_size=None):
        super().__init__(dim, num_heads, qkv_bias=False, attn_drop=attn_drop, proj_drop=proj_drop)
        self.q_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
        self.v_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
        self.window_size = to_2tuple(window_size) if window_size else None
        self.relative_position_bias_table = None
        if window_size:
            self.relative_position_bias_table = rel_pos_bias_table(self.window_size, num_heads)
            self.register_buffer("relative_position_index", relative_position_index(self.window_size),
                                 persistent=False)

    def forward(self, x: torch.Tensor, shared_bias: torch.Tensor | None = None,
                grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(B, 1 + h*w, D) -> (B, 1 + h*w, D); ``grid`` (h, w) where it is not the grid the table was learned for."""
        B, N, C = x.shape
        bias = None if self.q_bias is None else torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, hd) each
        rel = shared_bias
        if self.relative_position_bias_table is not None:
            own = gather_bias(self.relative_position_bias_table, self.relative_position_index, self.window_size, grid)
            rel = own if rel is None else own + rel
        return self.proj_drop(self.proj(self.attend(q, k, v, None if rel is None else rel.unsqueeze(0))))


class RelPosBlock(Block):
    """The shared pre-norm block, its attention given the shared relative position bias where the model has one."""

    def forward(self, x: torch.Tensor, shared_bias: torch.Tensor | None = None,
                grid: tuple[int, int] | None = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), shared_bias, grid)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


BEIT_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "qkv_bias", "mlp_ratio", "drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate",
             "drop_path_rate", "init_values", "use_abs_pos_emb", "use_rel_pos_bias", "use_shared_rel_pos_bias",
             "head_init_scale", "use_fc_norm")


class Beit(Model):
    """timm's Beit: BEiT, BEiT v2 and data2vec-vision (transformers' ``beit`` and ``data2vec-vision``)."""

    family = "BEiT (relative position bias)"
    timm_names = frozenset([f"beit_base_patch16_{i}" for i in (224, 384)]
                           + [f"beit_large_patch16_{i}" for i in (224, 384, 512)]
                           + ["beitv2_base_patch16_224", "beitv2_large_patch16_224"])
    timm_spec = TimmSpec("Beit", BEIT_ARGS, "beit_base_patch16_224",
                         fixed={"norm_eps": 1e-6, "act_layer": "gelu", "dynamic_img_size": False},
                         values={"init_values": {None: 0.0}},  # timm reads None as its name's default (0.1)
                         layer_scale_as_gamma=True)
    hf_model_type = "beit"
    no_pretrain = ("MAE and MPP drop or replace patch tokens of a ViT with an absolute position embedding; BEiT's "
                   "bias is per grid offset, and its own objective (visual-token prediction) is not implemented")
    no_weight_decay_names = ("pos_embed", "cls_token", "relative_position_bias_table")

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="avg", embed_dim=768,
                 depth=12, num_heads=12, qkv_bias=True, mlp_ratio=4.0, init_values=None, use_abs_pos_emb=True,
                 use_rel_pos_bias=False, use_shared_rel_pos_bias=False, use_fc_norm=None, head_init_scale=0.001,
                 act_layer="gelu", norm_eps=1e-6, dynamic_img_size=False, drop_rate=0.0, pos_drop_rate=0.0,
                 proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0):
        super().__init__()
        norm_layer = self.init_vit_input(img_size, patch_size, in_chans, num_classes, global_pool, embed_dim,
                                         dynamic_img_size, norm_eps)
        grid = self.patch_embed.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, grid[0] * grid[1] + 1, embed_dim)) if use_abs_pos_emb else None
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.rel_pos_bias = RelativePositionBias(grid, num_heads) if use_shared_rel_pos_bias else None
        dpr = drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList([
            RelPosBlock(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                        attn_drop=attn_drop_rate, init_values=init_values, drop_path=dpr[i],
                        act_layer=get_act_layer(act_layer), norm_layer=norm_layer,
                        attn_layer=partial(RelPosAttention, window_size=grid if use_rel_pos_bias else None))
            for i in range(depth)])
        use_fc_norm = global_pool == "avg" if use_fc_norm is None else use_fc_norm
        self.norm = nn.Identity() if use_fc_norm else norm_layer(embed_dim)
        self.fc_norm = norm_layer(embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(head_init_scale)

    def init_weights(self, head_init_scale: float) -> None:
        init_weights_rescaled(self, head_init_scale)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, 1 + N, D) tokens after the final norm."""
        x = self.patch_embed(x)  # (B, h, w, D)
        B, h, w, D = x.shape
        grid = None if (h, w) == self.patch_embed.grid_size else (h, w)  # another size: tables resampled
        x = torch.cat([self.cls_token.expand(B, -1, -1), x.reshape(B, h * w, D)], dim=1)
        if self.pos_embed is not None:
            pos_embed = self.pos_embed
            if grid is not None:  # as transformers' interpolate_pos_encoding: bicubic, no antialiasing
                pos_embed = resample_abs_pos_embed(pos_embed, grid, self.patch_embed.grid_size, antialias=False)
            x = x + pos_embed
        x = self.pos_drop(x)
        shared = self.rel_pos_bias(grid) if self.rel_pos_bias is not None else None
        for blk in self.blocks:
            x = blk(x, shared, grid)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> (B, D): the mean patch token or the class token, through fc_norm."""
        return self.fc_norm(super().pool(x))
