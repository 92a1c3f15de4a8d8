"""Vision Transformer (Dosovitskiy et al. 2020) and DeiT (Touvron et al. 2020).

DeiT is the same model with a second prefix token, the distillation token, read by its own
head ``head_dist``: in training ``forward`` returns both heads' logits, in eval their mean.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .base import Model, TimmSpec
from .layers import (
    Block,
    PatchEmbed,
    drop_path_rates,
    get_act_layer,
    init_weights_vit,
    resample_abs_pos_embed,
    sincos_2d_pos_embed,
)

POS_EMBEDS = ("learn", "sincos", "none")
GLOBAL_POOLS = ("token", "avg", "")
# the arguments timm's VisionTransformer takes with vitlab's names and meaning
TIMM_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "mlp_ratio", "qkv_bias", "init_values", "class_token", "pos_embed", "no_embed_class", "reg_tokens",
             "fc_norm", "dynamic_img_size", "act_layer", "drop_rate", "pos_drop_rate", "proj_drop_rate",
             "attn_drop_rate", "drop_path_rate")


class VisionTransformer(Model):
    no_weight_decay_names = ("pos_embed", "cls_token", "dist_token", "reg_token")
    timm_names = frozenset(
        [f"deit_{s}{d}_patch16_224" for s in ("tiny", "small", "base") for d in ("", "_distilled")]
        + [f"vit_{s}_patch{p}_{i}" for s in ("small", "base", "large") for p in (16, 32) for i in (224, 384)]
        + ["vit_tiny_patch16_224", "vit_tiny_patch16_384"])

    @property
    def family(self) -> str:
        if self.dist_token is not None:
            return "DeiT (distilled: class + distillation token)"
        return "ViT" if self.cls_token is not None else "ViT (no class token, average pooling)"

    @property
    def classifier_names(self) -> tuple[str, ...]:
        return ("head", "head_dist") if self.dist_token is not None else ("head",)

    @property
    def timm_spec(self) -> TimmSpec:
        distilled = self.dist_token is not None
        return TimmSpec("VisionTransformerDistilled" if distilled else "VisionTransformer", TIMM_ARGS,
                        "deit_tiny_distilled_patch16_224" if distilled else "vit_tiny_patch16_224",
                        fixed={"norm_eps": 1e-6}, dropped=("distilled",),
                        values={"pos_embed": {"sincos": "learn"}})  # the fixed table exported as a learned one

    @property
    def hf_model_type(self) -> str:
        return "deit" if self.dist_token is not None else "vit"

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token",
                 embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, init_values=None,
                 class_token=True, reg_tokens=0, distilled=False, no_embed_class=False, pos_embed="learn",
                 dynamic_img_size=False, fc_norm=None, act_layer="gelu", norm_eps=1e-6,
                 drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0):
        super().__init__()
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool {global_pool!r} is not one of {GLOBAL_POOLS}")
        if pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed {pos_embed!r} is not one of {POS_EMBEDS}")
        if distilled and (not class_token or global_pool != "token"):
            raise ValueError("a distilled model reads the class and distillation tokens: "
                             "it needs class_token=True and global_pool='token'")
        if distilled and reg_tokens:
            raise ValueError("a model has either a distillation token or register tokens, not both")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs a class token; use global_pool='avg' with class_token=False")
        norm_layer = partial(nn.LayerNorm, eps=norm_eps)
        use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = int(class_token) + int(distilled) + reg_tokens
        self.no_embed_class = no_embed_class
        self.dynamic_img_size = dynamic_img_size

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size=dynamic_img_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        embed_len = self.patch_embed.num_patches + (0 if no_embed_class else self.num_prefix_tokens)
        if pos_embed == "none":
            self.pos_embed = None
        else:
            self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim), requires_grad=pos_embed == "learn")
        self.pos_embed_type = pos_embed
        self.pos_drop = nn.Dropout(pos_drop_rate)

        dpr = drop_path_rates(drop_path_rate, depth)  # stochastic depth grows with depth
        act = get_act_layer(act_layer)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, init_values=init_values, drop_path=dpr[i],
                  act_layer=act, norm_layer=norm_layer)
            for i in range(depth)])
        self.norm = nn.Identity() if use_fc_norm else norm_layer(embed_dim)
        self.fc_norm = norm_layer(embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = None
        if distilled:
            self.head_dist = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's init; a fixed sin-cos table when pos_embed='sincos'."""
        if self.pos_embed is not None:
            if self.pos_embed_type == "sincos":
                table = sincos_2d_pos_embed(self.patch_embed.grid_size, self.embed_dim)
                prefix = torch.zeros(1, self.pos_embed.shape[1] - table.shape[0], self.embed_dim)
                with torch.no_grad():
                    self.pos_embed.copy_(torch.cat([prefix, table[None]], dim=1))
            else:
                nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for token in (self.dist_token, self.reg_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        self.apply(init_weights_vit)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, w, D) grid -> (B, prefix + h*w, D) with prefix tokens and position embedding."""
        B, h, w, D = x.shape
        x = x.reshape(B, h * w, D)
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.pos_embed is None:
            return torch.cat(prefix + [x], dim=1)
        pos_embed = self.pos_embed
        if (h, w) != self.patch_embed.grid_size:
            pos_embed = resample_abs_pos_embed(pos_embed, (h, w), self.patch_embed.grid_size,
                                               num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens)
        if self.no_embed_class:
            x = torch.cat(prefix + [x + pos_embed], dim=1)
        else:
            x = torch.cat(prefix + [x], dim=1) + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, prefix + N, D) tokens after the final norm."""
        x = self.patch_embed(x)  # (B, h, w, D)
        x = self._pos_embed(x)  # (B, prefix + N, D)
        x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> (B, D): the pooled token, through fc_norm (an identity unless pooling by average)."""
        return self.fc_norm(super().pool(x))

    def forward_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tokens -> (logits,), or a distilled model's (class logits, distillation logits) in any mode."""
        if self.dist_token is None:
            return super().forward_heads(x)
        return self.head(self.head_drop(x[:, 0])), self.head_dist(self.head_drop(x[:, 1]))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        """Tokens -> logits; a distilled model in training returns (class logits, distillation logits)."""
        if self.dist_token is None:
            return super().forward_head(x, pre_logits)
        if pre_logits:
            return (self.head_drop(x[:, 0]) + self.head_drop(x[:, 1])) / 2
        x, x_dist = self.forward_heads(x)
        return (x, x_dist) if self.training else (x + x_dist) / 2
