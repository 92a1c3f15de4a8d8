"""ConViT (d'Ascoli et al. 2021): gated positional self-attention with a convolution-like init.

The first ``local_up_to_layer`` blocks use GPSA, a per-head gated mixture of content attention
and positional attention over relative patch offsets; the class token joins after them. As in
the paper and timm, ``embed_dim`` is the width per head.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec
from .layers import (
    Attention,
    Block,
    drop_path_rates,
    init_weights_vit,
    resample_abs_pos_embed,
)


def relative_indices(grid_h: int, grid_w: int) -> torch.Tensor:
    """(1, N, N, 3) offsets between patches i and j: (dx, dy, dx^2 + dy^2), with dx = col_j - col_i."""
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    rows, cols = rows.flatten().float(), cols.flatten().float()
    dx = cols[None, :] - cols[:, None]
    dy = rows[None, :] - rows[:, None]
    return torch.stack([dx, dy, dx ** 2 + dy ** 2], dim=-1)[None]


class GPSA(nn.Module):
    """Gated positional self-attention: (1 - sigmoid(gate)) * content + sigmoid(gate) * position, per head."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0, locality_strength=1.0):
        super().__init__()
        self.num_heads = num_heads
        self.dim = dim
        self.scale = (dim // num_heads) ** -0.5
        self.locality_strength = locality_strength
        self.grid_size: tuple[int, int] | None = None  # patch grid; square if unset
        self.qk = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.attn_map = nn.Identity()  # hook point: the gated attention (B, H, N, N)
        self.proj = nn.Linear(dim, dim)
        self.pos_proj = nn.Linear(3, num_heads)
        self.proj_drop = nn.Dropout(proj_drop)
        self.gating_param = nn.Parameter(torch.ones(num_heads))
        self.register_buffer("rel_indices", torch.zeros(1, 1, 1, 3), persistent=False)
        self._rel_hw: tuple[int, int] | None = None
        self.local_init()

    def local_init(self) -> None:
        """Heads start as the offsets of a sqrt(H) x sqrt(H) convolution kernel, sharpened by locality_strength."""
        with torch.no_grad():
            self.v.weight.copy_(torch.eye(self.dim))
            kernel = int(self.num_heads ** 0.5)
            center = (kernel - 1) / 2 if kernel % 2 == 0 else kernel // 2
            for h1 in range(kernel):
                for h2 in range(kernel):
                    head = h1 + kernel * h2
                    self.pos_proj.weight[head, 2] = -1
                    self.pos_proj.weight[head, 1] = 2 * (h1 - center)
                    self.pos_proj.weight[head, 0] = 2 * (h2 - center)
            self.pos_proj.weight.mul_(self.locality_strength)

    def _rel_indices(self, N: int) -> torch.Tensor:
        h, w = self.grid_size if self.grid_size and self.grid_size[0] * self.grid_size[1] == N else (int(N ** 0.5),) * 2
        if h * w != N:
            raise VitlabError(f"GPSA cannot place {N} tokens on a square patch grid; set grid_size")
        if self.rel_indices.shape[1] != N or self._rel_hw != (h, w):
            self.rel_indices = relative_indices(h, w).to(self.qk.weight)
            self._rel_hw = (h, w)
        return self.rel_indices

    def gated_attention(self, x: torch.Tensor) -> torch.Tensor:
        """The attention the block uses, (B, H, N, N); rows sum to 1."""
        B, N, C = x.shape
        qk = self.qk(x).reshape(B, N, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k = qk[0], qk[1]  # (B, H, N, hd)
        patch_score = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        pos_score = self.pos_proj(self._rel_indices(N)).permute(0, 3, 1, 2).softmax(dim=-1)  # (1, H, N, N)
        gate = torch.sigmoid(self.gating_param).view(1, -1, 1, 1)
        attn = (1.0 - gate) * patch_score + gate * pos_score
        return attn / attn.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        attn = self.attn_drop(self.attn_map(self.gated_attention(x)))
        v = self.v(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class ConVit(Model):
    family = "ConViT"
    timm_names = frozenset({"convit_tiny", "convit_small", "convit_base"})
    timm_spec = TimmSpec("ConVit", ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim",
                                    "depth", "num_heads", "mlp_ratio", "qkv_bias", "local_up_to_layer",
                                    "locality_strength", "use_pos_embed", "drop_rate", "pos_drop_rate",
                                    "proj_drop_rate", "attn_drop_rate", "drop_path_rate"),
                         "convit_tiny", fixed={"norm_eps": 1e-6, "dynamic_img_size": False})
    no_hf = "ConViT"
    no_pretrain = ("its GPSA layers attend over relative offsets on the full patch grid, which the visible "
                   "patches alone do not form, and its class token joins only after them")

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token",
                 embed_dim=48, depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=False, local_up_to_layer=3,
                 locality_strength=1.0, use_pos_embed=True, dynamic_img_size=False, norm_eps=1e-6,
                 drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0):
        super().__init__()
        if not 0 <= local_up_to_layer <= depth:
            raise VitlabError(f"local_up_to_layer {local_up_to_layer} must lie in [0, depth={depth}]")
        embed_dim *= num_heads  # embed_dim is per head
        norm_layer = self.init_vit_input(img_size, patch_size, in_chans, num_classes, global_pool, embed_dim,
                                         dynamic_img_size, norm_eps)
        self.local_up_to_layer = local_up_to_layer
        num_patches = self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim)) if use_pos_embed else None
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dpr = drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, drop_path=dpr[i], norm_layer=norm_layer,
                  **(dict(attn_layer=GPSA, locality_strength=locality_strength) if i < local_up_to_layer
                     else dict(attn_layer=Attention)))
            for i in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights_vit)
        for m in self.modules():
            if isinstance(m, GPSA):
                m.local_init()
                m.grid_size = self.patch_embed.grid_size

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # (B, h, w, D)
        B, h, w, D = x.shape
        x = x.reshape(B, h * w, D)
        if self.pos_embed is not None:
            pos_embed = self.pos_embed
            if (h, w) != self.patch_embed.grid_size:
                pos_embed = resample_abs_pos_embed(pos_embed, (h, w), self.patch_embed.grid_size, num_prefix_tokens=0)
            x = x + pos_embed
        x = self.pos_drop(x)
        for i, blk in enumerate(self.blocks):
            if i == self.local_up_to_layer:  # the class token joins after the local blocks
                x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
            if isinstance(blk.attn, GPSA):
                blk.attn.grid_size = (h, w)
            x = blk(x)
        # as in timm and the paper's code, with local_up_to_layer == depth the class token never joins
        return self.norm(x)  # (B, 1 + N, D)

