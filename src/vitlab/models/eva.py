"""EVA02 (Fang et al. 2023) and the RoPE ViTs (Heo et al. 2024): ViTs whose attention rotates queries and keys.

timm holds both in one class, ``Eva``, and so does vitlab. EVA02: axial rotary position embedding rescaled to
its pre-training grid, a SwiGLU MLP with a LayerNorm inside (``mlp.norm``, the sub-LayerNorm of the larger
sizes), query and value biases, mean pooling through ``fc_norm``. The RoPE ViTs (``vit_*_patch16_rope_*``):
a DeiT-III-like ViT (LayerScale, class token) whose attention has axial RoPE at temperature 100 or learned
mixed-axis frequencies (``rope.freqs``), optionally with an absolute position embedding as well (``_ape``).
The class and register tokens are never rotated. Other input sizes (``dynamic_img_size``) rebuild the rotary
embedding for the new grid and resample the absolute one, as timm does.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .base import Model, TimmSpec
from .layers import (
    Attention,
    DropPath,
    LayerScale,
    Mlp,
    PatchEmbed,
    SwiGLU,
    drop_path_rates,
    get_act_layer,
    init_weights_rescaled,
    mlp_hidden,
    resample_abs_pos_embed,
    to_2tuple,
)
from .rope import AxialRope, MixedRope, apply_rope


class RopeAttention(Attention):
    """Self-attention with rotary position embedding on the patch tokens (timm's EvaAttention / AttentionRope).

    Biases as EVA holds them (``bias_layout='qv'``: ``q_bias``, ``v_bias``, none on keys) or as a plain
    ``qkv.bias`` (``'qkv'``, the RoPE ViTs); ``qkv_fused=False`` keeps separate ``q_proj``/``k_proj``/``v_proj``.
    ``scale_norm`` is EVA's LayerNorm on the attention output before ``proj``. The rotation is applied before
    the dot product on both paths, so ``attn_map`` sees the probabilities the fused kernel uses.
    """

    def __init__(self, dim, num_heads=8, qkv_bias=True, attn_drop=0.0, proj_drop=0.0, qkv_fused=True,
                 bias_layout="qv", num_prefix_tokens=1, qk_norm=False, scale_norm=False, norm_layer=nn.LayerNorm):
        plain_bias = qkv_bias and qkv_fused and bias_layout == "qkv"
        super().__init__(dim, num_heads, qkv_bias=plain_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                         qk_norm=qk_norm, norm_layer=norm_layer)
        self.num_prefix_tokens = num_prefix_tokens
        eva_bias = qkv_bias and bias_layout == "qv"
        self.q_bias = self.v_bias = None
        if qkv_fused and eva_bias:
            self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        if not qkv_fused:
            self.qkv = None
            self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, dim, bias=qkv_bias and not eva_bias)
            self.v_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.norm = norm_layer(dim) if scale_norm else nn.Identity()

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, D) -> queries, keys, values (B, H, N, hd) each."""
        B, N, _ = x.shape
        if self.qkv is None:
            return tuple(p(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
                         for p in (self.q_proj, self.k_proj, self.v_proj))
        bias = self.qkv.bias
        if self.q_bias is not None:
            bias = torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).reshape(B, N, 3, self.num_heads, self.head_dim)
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_heads(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # the prefix tokens (class, registers) keep their queries and keys
            n = self.num_prefix_tokens
            q = torch.cat([q[:, :, :n], apply_rope(q[:, :, n:], rope)], dim=2)
            k = torch.cat([k[:, :, :n], apply_rope(k[:, :, n:], rope)], dim=2)
        return self.proj_drop(self.proj(self.norm(self.attend(q, k, v))))


class EvaBlock(nn.Module):
    """Pre-norm block: x + ls1(attn(norm1(x), rope)), then x + ls2(mlp(norm2(x))); LayerScale where init_values
    is given (0.0 included, as timm)."""

    def __init__(self, dim, num_heads, mlp, attn_kwargs, init_values=None, drop_path=0.0, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = RopeAttention(dim, num_heads, norm_layer=norm_layer, **attn_kwargs)
        self.ls1 = LayerScale(dim, init_values) if init_values is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp
        self.ls2 = LayerScale(dim, init_values) if init_values is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), rope)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def make_mlp(dim, mlp_ratio, swiglu_mlp, scale_mlp, act_layer, drop, norm_layer) -> nn.Module:
    """timm's choice: SwiGLU (split fc1) with a sub-LayerNorm, its packed GluMlp without, or the plain MLP."""
    hidden, norm = mlp_hidden(dim, mlp_ratio), norm_layer if scale_mlp else None
    if swiglu_mlp:
        return SwiGLU(dim, hidden, drop=drop, norm_layer=norm, packed=not scale_mlp)
    return Mlp(dim, hidden, act_layer=get_act_layer(act_layer), drop=drop, norm_layer=norm)


EVA_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
            "qkv_bias", "qkv_fused", "qk_norm", "mlp_ratio", "swiglu_mlp", "scale_mlp", "scale_attn_inner",
            "attn_type", "drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate",
            "init_values", "class_token", "num_reg_tokens", "no_embed_class", "use_abs_pos_emb", "use_rot_pos_emb",
            "rope_type", "rope_grid_offset", "rope_grid_indexing", "rope_temperature", "use_pre_transformer_norm",
            "use_post_transformer_norm", "use_fc_norm", "dynamic_img_size", "ref_feat_shape", "head_init_scale")
ROPE_TYPES = ("cat", "mixed")


class Eva(Model):
    """timm's Eva: EVA02 and the RoPE ViTs (axial or mixed RoPE, optional absolute position embedding)."""

    global_pools = ("avg", "token", "")
    timm_names = frozenset([f"eva02_{s}_patch14_{i}" for s, i in (("tiny", 224), ("tiny", 336), ("small", 224),
                                                                  ("small", 336), ("base", 224), ("base", 448),
                                                                  ("large", 224), ("large", 448))]
                           + [f"vit_{s}_patch16_rope{k}_224" for s in ("small", "base", "large")
                              for k in ("", "_ape", "_mixed", "_mixed_ape")]
                           + [f"vit_{s}_patch16_rope_reg1_gap_256" for s in ("medium", "mediumd", "base")]
                           + ["vit_betwixt_patch16_rope_reg4_gap_256"]
                           + [f"eva_giant_patch14_{i}" for i in (224, 336, 560)])
    # the base name's defaults of the arguments vitlab may leave None (ref_feat_shape, init_values) are None too
    timm_spec = TimmSpec("Eva", EVA_ARGS, "eva_giant_patch14_224", fixed={"norm_eps": 1e-6, "act_layer": "gelu"},
                         layer_scale_as_gamma=True)
    no_hf = "EVA02's and the RoPE ViTs' rotary attention (transformers has no such ViT class)"
    no_pretrain = ("MAE and MPP run the ViT encoder's forward with an absolute position embedding; the rotary "
                   "models' objectives (EVA02's CLIP-feature regression) are not implemented")
    no_weight_decay_names = ("pos_embed", "cls_token", "reg_token", "freqs")

    @property
    def family(self) -> str:
        if self.rope is None:
            return "EVA (no rotary embedding)"
        return "RoPE ViT (mixed)" if isinstance(self.rope, MixedRope) else "EVA02 / RoPE ViT (axial RoPE)"

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="avg", embed_dim=768,
                 depth=12, num_heads=12, qkv_bias=True, qkv_fused=True, qk_norm=False, mlp_ratio=4.0,
                 swiglu_mlp=False, scale_mlp=False, scale_attn_inner=False, attn_type="eva", init_values=None,
                 class_token=True, num_reg_tokens=0, no_embed_class=False, use_abs_pos_emb=True,
                 use_rot_pos_emb=False, rope_type="cat", rope_grid_offset=0.0, rope_grid_indexing="ij",
                 rope_temperature=10000.0, use_pre_transformer_norm=False, use_post_transformer_norm=None,
                 use_fc_norm=None, dynamic_img_size=False, ref_feat_shape=None, head_init_scale=0.001,
                 act_layer="gelu", norm_eps=1e-6, drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0,
                 attn_drop_rate=0.0, drop_path_rate=0.0):
        super().__init__()
        for name, value, accepted in (("global_pool", global_pool, self.global_pools), ("rope_type", rope_type,
                                      ROPE_TYPES), ("attn_type", attn_type, ("eva", "rope")),
                                      ("rope_grid_indexing", rope_grid_indexing, ("ij", "xy"))):
            if value not in accepted:
                raise ValueError(f"{name} {value!r} is not one vitlab implements; accepted: {', '.join(accepted)}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs a class token; use global_pool='avg' with class_token=False")
        norm_layer = partial(nn.LayerNorm, eps=norm_eps)
        self.num_classes, self.global_pool = num_classes, global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = int(class_token) + num_reg_tokens
        self.no_embed_class, self.dynamic_img_size = no_embed_class, dynamic_img_size
        fc_norm = global_pool == "avg" if use_fc_norm is None else use_fc_norm
        post_norm = not fc_norm if use_post_transformer_norm is None else use_post_transformer_norm

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, bias=not use_pre_transformer_norm,
                                      dynamic_img_size=dynamic_img_size)
        grid = self.patch_embed.grid_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, num_reg_tokens, embed_dim)) if num_reg_tokens else None
        n_pos = grid[0] * grid[1] + (0 if no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, n_pos, embed_dim)) if use_abs_pos_emb else None
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.rope = None
        if use_rot_pos_emb and rope_type == "mixed":
            self.rope = MixedRope(embed_dim // num_heads, depth, num_heads, rope_temperature, rope_grid_indexing)
        elif use_rot_pos_emb:
            self.rope = AxialRope(embed_dim // num_heads, rope_temperature, rope_grid_indexing, rope_grid_offset,
                                  to_2tuple(ref_feat_shape) if ref_feat_shape is not None else None)
        self.norm_pre = norm_layer(embed_dim) if use_pre_transformer_norm else nn.Identity()
        attn_kwargs = dict(qkv_bias=qkv_bias, qkv_fused=qkv_fused, bias_layout="qv" if attn_type == "eva" else "qkv",
                           num_prefix_tokens=self.num_prefix_tokens, qk_norm=qk_norm, scale_norm=scale_attn_inner,
                           attn_drop=attn_drop_rate, proj_drop=proj_drop_rate)
        self.blocks = nn.ModuleList([
            EvaBlock(embed_dim, num_heads, make_mlp(embed_dim, mlp_ratio, swiglu_mlp, scale_mlp, act_layer,
                                                    proj_drop_rate, norm_layer),
                     attn_kwargs, init_values=init_values, drop_path=dpr, norm_layer=norm_layer)
            for dpr in drop_path_rates(drop_path_rate, depth)])
        self.norm = norm_layer(embed_dim) if post_norm else nn.Identity()
        self.fc_norm = norm_layer(embed_dim) if fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(head_init_scale)

    def init_weights(self, head_init_scale: float) -> None:
        init_weights_rescaled(self, head_init_scale)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, w, D) grid -> (B, prefix + h*w, D): prefix tokens and the absolute position embedding."""
        B, h, w, D = x.shape
        x = x.reshape(B, h * w, D)
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        pos_embed = self.pos_embed
        if pos_embed is not None and (h, w) != self.patch_embed.grid_size:
            pos_embed = resample_abs_pos_embed(pos_embed, (h, w), self.patch_embed.grid_size,
                                               num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens)
        if pos_embed is not None and self.no_embed_class:
            x = x + pos_embed
        x = torch.cat(prefix + [x], dim=1)
        if pos_embed is not None and not self.no_embed_class:
            x = x + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, prefix + N, D) tokens after the final norm."""
        x = self.patch_embed(x)  # (B, h, w, D)
        grid = tuple(x.shape[1:3])
        x = self.norm_pre(self._pos_embed(x))
        rope = self.rope(grid).to(x.device) if self.rope is not None else None
        for i, blk in enumerate(self.blocks):
            x = blk(x, rope[i] if isinstance(self.rope, MixedRope) else rope)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> (B, D): the mean patch token or the class token, through fc_norm."""
        return self.fc_norm(super().pool(x))
