"""CaiT (Touvron et al. 2021): LayerScale blocks with talking-heads attention, then class attention.

The patch tokens go through ``depth`` self-attention blocks; only then does the class token
enter, through ``depth_token_only`` class-attention blocks in which it alone is updated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Model, TimmSpec
from .layers import (
    Block,
    DropPath,
    LayerScale,
    Mlp,
    get_act_layer,
    init_weights_vit,
    mlp_hidden,
    resample_abs_pos_embed,
)


class TalkingHeadAttn(nn.Module):
    """Self-attention whose heads exchange information before (proj_l) and after (proj_w) the softmax."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.attn_map = nn.Identity()  # hook point: attention after the post-softmax mixing (B, H, N, N)
        self.proj = nn.Linear(dim, dim)
        self.proj_l = nn.Linear(num_heads, num_heads)
        self.proj_w = nn.Linear(num_heads, num_heads)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]  # (B, H, N, hd)
        attn = q @ k.transpose(-2, -1)  # (B, H, N, N)
        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).softmax(dim=-1)
        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        attn = self.attn_drop(self.attn_map(attn))
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class ClassAttn(nn.Module):
    """Attention in which only the class token (token 0) queries: returns its update, (B, 1, D)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = True
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.attn_map = nn.Identity()  # hook point: (B, H, 1, N) on the slow path
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(x[:, :1]).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, 1, hd)
        k = self.k(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, hd)
        v = self.v(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        if self.fused_attn:
            x_cls = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = self.attn_map(((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1))  # (B, H, 1, N)
            x_cls = self.attn_drop(attn) @ v
        x_cls = x_cls.transpose(1, 2).reshape(B, 1, C)
        return self.proj_drop(self.proj(x_cls))


class ClassAttentionBlock(nn.Module):
    """x_cls + ls1(attn(norm1([x_cls, x]))), then x_cls + ls2(mlp(norm2(x_cls))); patch tokens stay as they are."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, init_values=1e-4, drop_path=0.0,
                 act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = ClassAttn(dim, num_heads=num_heads, qkv_bias=qkv_bias)
        self.ls1 = LayerScale(dim, init_values)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, mlp_hidden(dim, mlp_ratio), act_layer=act_layer)
        self.ls2 = LayerScale(dim, init_values)

    def forward(self, x: torch.Tensor, x_cls: torch.Tensor) -> torch.Tensor:
        u = torch.cat([x_cls, x], dim=1)  # (B, 1 + N, D)
        x_cls = x_cls + self.drop_path(self.ls1(self.attn(self.norm1(u))))
        x_cls = x_cls + self.drop_path(self.ls2(self.mlp(self.norm2(x_cls))))
        return x_cls


class Cait(Model):
    family = "CaiT"
    block_lists = ("blocks", "blocks_token_only")
    timm_names = frozenset(f"cait_{n}" for n in ("s24_224", "s24_384", "s36_384", "xs24_384", "xxs24_224", "xxs24_384",
                                                 "xxs36_224", "xxs36_384"))
    timm_spec = TimmSpec("Cait", ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim",
                                  "depth", "num_heads", "mlp_ratio", "qkv_bias", "init_values", "depth_token_only",
                                  "mlp_ratio_token_only", "drop_rate", "pos_drop_rate", "proj_drop_rate",
                                  "attn_drop_rate", "drop_path_rate"),
                         "cait_xxs24_224", fixed={"norm_eps": 1e-6, "act_layer": "gelu", "dynamic_img_size": False},
                         layer_scale_as_gamma=True)
    no_hf = "CaiT"
    no_pretrain = ("the objectives run the ViT/DeiT forward (prefix tokens, one stack of blocks), "
                   "not CaiT's self-attention then class-attention stages")

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token",
                 embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, init_values=1e-4,
                 depth_token_only=2, mlp_ratio_token_only=4.0, dynamic_img_size=False, act_layer="gelu",
                 norm_eps=1e-6, drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0,
                 drop_path_rate=0.0):
        super().__init__()
        norm_layer = self.init_vit_input(img_size, patch_size, in_chans, num_classes, global_pool, embed_dim,
                                         dynamic_img_size, norm_eps)
        act = get_act_layer(act_layer)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.blocks = nn.Sequential(*[  # CaiT keeps the drop-path rate constant over depth
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, init_values=init_values, drop_path=drop_path_rate,
                  act_layer=act, norm_layer=norm_layer, attn_layer=TalkingHeadAttn)
            for _ in range(depth)])
        self.blocks_token_only = nn.ModuleList([
            ClassAttentionBlock(embed_dim, num_heads, mlp_ratio_token_only, qkv_bias=qkv_bias,
                                init_values=init_values, act_layer=act, norm_layer=norm_layer)
            for _ in range(depth_token_only)])
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights_vit)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # (B, h, w, D)
        B, h, w, D = x.shape
        pos_embed = self.pos_embed
        if (h, w) != self.patch_embed.grid_size:
            pos_embed = resample_abs_pos_embed(pos_embed, (h, w), self.patch_embed.grid_size, num_prefix_tokens=0)
        x = self.pos_drop(x.reshape(B, h * w, D) + pos_embed)
        x = self.blocks(x)  # (B, N, D)
        x_cls = self.cls_token.expand(B, -1, -1)
        for blk in self.blocks_token_only:
            x_cls = blk(x, x_cls)  # (B, 1, D)
        return self.norm(torch.cat([x_cls, x], dim=1))  # (B, 1 + N, D)

