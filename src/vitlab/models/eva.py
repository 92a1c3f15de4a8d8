"""EVA02 (Fang et al. 2023) and the RoPE ViTs (Heo et al. 2024): ViTs whose attention rotates queries and keys.

timm holds both in one class, ``Eva``, and so does vitlab. EVA02: axial rotary position embedding rescaled to
its pre-training grid, a SwiGLU MLP with a LayerNorm inside (``mlp.norm``, the sub-LayerNorm of the larger
sizes), query and value biases, mean pooling through ``fc_norm``. The RoPE ViTs (``vit_*_patch16_rope_*``):
a DeiT-III-like ViT (LayerScale, class token) whose attention has axial RoPE at temperature 100 or learned
mixed-axis frequencies (``rope.freqs``), optionally with an absolute position embedding as well (``_ape``).
The class and register tokens are never rotated. Other input sizes (``dynamic_img_size``) rebuild the rotary
embedding for the new grid and resample the absolute one, as timm does. The same class holds EVA-CLIP-E (residual
post-norm blocks, ``use_post_norm``), LingBot (DINOv3's layout) and Sapiens2 (grouped-query attention,
``num_kv_heads``; RMSNorm, ``norm_layer='rmsnorm'``; LayerScale on attention only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
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
    get_norm_layer,
    init_weights_rescaled,
    mlp_hidden,
    resample_abs_pos_embed,
    to_2tuple,
)
from .rope import AxialRope, CenteredRope, CoordAugment, MixedRope, apply_rope
from .vit_presets import VIT_SIZES


class RopeAttention(Attention):
    """Self-attention with rotary position embedding on the patch tokens (timm's EvaAttention / AttentionRope).

    Biases as EVA holds them (``bias_layout='qv'``: ``q_bias``, ``v_bias``, none on keys) or as a plain
    ``qkv.bias`` (``'qkv'``, the RoPE ViTs); ``qkv_fused=False`` keeps separate ``q_proj``/``k_proj``/``v_proj``.
    ``scale_norm`` is EVA's LayerNorm on the attention output before ``proj``. The rotation is applied before
    the dot product on both paths, so ``attn_map`` sees the probabilities the fused kernel uses. ``num_kv_heads``
    below ``num_heads`` is grouped-query attention (Sapiens2): fewer key and value heads, each read by
    num_heads / num_kv_heads query heads in turn (separate projections only, as timm's AttentionRope).
    """

    def __init__(self, dim, num_heads=8, qkv_bias=True, attn_drop=0.0, proj_drop=0.0, qkv_fused=True,
                 bias_layout="qv", num_prefix_tokens=1, qk_norm=False, scale_norm=False, norm_layer=nn.LayerNorm,
                 rotate_half=False, num_kv_heads=None):
        plain_bias = qkv_bias and qkv_fused and bias_layout == "qkv"
        super().__init__(dim, num_heads, qkv_bias=plain_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                         qk_norm=qk_norm, norm_layer=norm_layer)
        self.num_prefix_tokens, self.rotate_half = num_prefix_tokens, rotate_half
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads or (qkv_fused and self.num_kv_heads != num_heads):
            raise VitlabError(f"num_kv_heads {self.num_kv_heads} does not fit {num_heads} heads; accepted: a divisor "
                              "of num_heads, below it only with qkv_fused=False")
        kv_dim = self.num_kv_heads * self.head_dim
        eva_bias = qkv_bias and bias_layout == "qv"
        self.q_bias = self.v_bias = None
        if qkv_fused and eva_bias:
            self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        if not qkv_fused:
            self.qkv = None
            self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, kv_dim, bias=qkv_bias and not eva_bias)
            self.v_proj = nn.Linear(dim, kv_dim, bias=qkv_bias)
        self.norm = norm_layer(dim) if scale_norm else nn.Identity()

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, D) -> queries (B, H, N, hd), keys and values (B, num_kv_heads, N, hd)."""
        B, N, _ = x.shape
        if self.qkv is None:
            return tuple(p(x).reshape(B, N, -1, self.head_dim).transpose(1, 2)
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
            n, half = self.num_prefix_tokens, self.rotate_half
            q = torch.cat([q[:, :, :n], apply_rope(q[:, :, n:], rope, half)], dim=2)
            k = torch.cat([k[:, :, :n], apply_rope(k[:, :, n:], rope, half)], dim=2)
        if self.num_kv_heads != self.num_heads:  # query head h reads key and value head h // group
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.proj_drop(self.proj(self.norm(self.attend(q, k, v))))


class EvaBlock(nn.Module):
    """Pre-norm block: x + ls1(attn(norm1(x), rope)), then x + ls2(mlp(norm2(x))); LayerScale where init_values
    is given (0.0 included, as timm), on the attention branch only with ``attn_only_layer_scale`` (Sapiens2)."""

    def __init__(self, dim, num_heads, mlp, attn_kwargs, init_values=None, drop_path=0.0, norm_layer=nn.LayerNorm,
                 attn_only_layer_scale=False):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = RopeAttention(dim, num_heads, norm_layer=norm_layer, **attn_kwargs)
        self.ls1 = LayerScale(dim, init_values) if init_values is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp
        mlp_scale = init_values is not None and not attn_only_layer_scale
        self.ls2 = LayerScale(dim, init_values) if mlp_scale else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), rope)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class EvaBlockPostNorm(EvaBlock):
    """Residual post-norm block (EVA-CLIP-E, timm's EvaBlockPostNorm): x + norm1(attn(x, rope)), then
    x + norm2(mlp(x)); no LayerScale (timm ignores init_values here)."""

    def __init__(self, dim, num_heads, mlp, attn_kwargs, init_values=None, drop_path=0.0, norm_layer=nn.LayerNorm,
                 attn_only_layer_scale=False):
        super().__init__(dim, num_heads, mlp, attn_kwargs, None, drop_path, norm_layer)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path1(self.norm1(self.attn(x, rope)))
        return x + self.drop_path2(self.norm2(self.mlp(x)))


def make_mlp(dim, mlp_ratio, swiglu_mlp, scale_mlp, act_layer, drop, norm_layer, align_to=0, bias=True) -> nn.Module:
    """timm's choice: SwiGLU (split fc1) with a sub-LayerNorm or a hidden width rounded up to a multiple of
    ``align_to`` (DINOv3's plus sizes), its packed GluMlp without either, or the plain MLP; ``bias``: the MLP's."""
    hidden, norm = mlp_hidden(dim, mlp_ratio), norm_layer if scale_mlp else None
    if swiglu_mlp:
        hidden += -hidden % align_to if align_to else 0
        return SwiGLU(dim, hidden, drop=drop, norm_layer=norm, packed=not (scale_mlp or align_to), bias=bias)
    return Mlp(dim, hidden, act_layer=get_act_layer(act_layer), drop=drop, norm_layer=norm, bias=bias)


EVA_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
            "qkv_bias", "qkv_fused", "qk_norm", "mlp_ratio", "swiglu_mlp", "scale_mlp", "scale_attn_inner",
            "attn_type", "drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate",
            "init_values", "class_token", "num_reg_tokens", "no_embed_class", "use_abs_pos_emb", "use_rot_pos_emb",
            "rope_type", "rope_grid_offset", "rope_grid_indexing", "rope_temperature", "use_pre_transformer_norm",
            "use_post_transformer_norm", "use_fc_norm", "dynamic_img_size", "ref_feat_shape", "head_init_scale",
            "swiglu_align_to", "rope_rotate_half", "rope_shift_coords", "rope_jitter_coords", "rope_rescale_coords",
            "num_kv_heads", "attn_only_layer_scale", "use_post_norm")
ROPE_TYPES = ("cat", "mixed", "dinov3")
DINOV3_SIZES = {"small": (*VIT_SIZES["small"], False), "small_plus": (*VIT_SIZES["small"], True),
                "base": (*VIT_SIZES["base"], False), "large": (*VIT_SIZES["large"], False),
                "huge_plus": (1280, 32, 20, True)}  # width, depth, heads (huge_plus: 20, not huge's 16), SwiGLU
# timm's DINOv3 names outside that pattern: a tiny one with q and v biases (EUPE's), and the 7B (SwiGLU at ratio 2,
# its width rounded to 64)
DINOV3_OTHERS = {"vit_tiny_patch16_dinov3_qkvb": dict(embed_dim=192, depth=12, num_heads=3, qkv_bias=True),
                 "vit_7b_patch16_dinov3": dict(embed_dim=4096, depth=40, num_heads=32, mlp_ratio=2.0, swiglu_mlp=True,
                                               swiglu_align_to=64)}
DINOV3_NORM_EPS = 1e-5  # timm's DINOv3 names build their LayerNorms with eps 1e-5, its other Eva names 1e-6
LINGBOT_SIZES = {size: VIT_SIZES[size] for size in ("small", "base", "large")}  # width, depth, heads
SAPIENS2_SIZES = {"base": (*VIT_SIZES["base"], 6), "large": (*VIT_SIZES["large"], 8), "huge": (*VIT_SIZES["huge"], 8),
                  "giant": (*VIT_SIZES["giant2"], 12), "5b": (2432, 56, 32, 16)}  # width, depth, heads, kv heads


def sapiens2_kv_heads(depth: int, num_heads: int, num_kv_heads: int, full: int = 8) -> tuple[int, ...]:
    """Sapiens2's key/value heads per block: full attention in the first and last ``full`` blocks, grouped-query
    in between."""
    return tuple(num_heads if i < full or i >= depth - full else num_kv_heads for i in range(depth))


def make_rope(rope_type: str, head_dim: int, depth: int, num_heads: int, grid_offset: float, indexing: str,
              temperature: float, rotate_half: bool, ref_feat_shape, augment: CoordAugment) -> nn.Module:
    """timm's create_rope_embed for the Eva class: axial ('cat'), mixed or DINOv3's centred RoPE."""
    if rope_type == "mixed":
        if rotate_half:
            raise VitlabError("rope_type='mixed' takes rope_rotate_half=False only (timm's rule)")
        return MixedRope(head_dim, depth, num_heads, temperature, indexing, augment)
    if rope_type == "dinov3":  # ref_feat_shape does not apply: the coordinates span [-1, 1] at every size
        return CenteredRope(head_dim, temperature, indexing, grid_offset, rotate_half, augment)
    return AxialRope(head_dim, temperature, indexing, grid_offset,
                     to_2tuple(ref_feat_shape) if ref_feat_shape is not None else None, rotate_half, augment)


class Eva(Model):
    """timm's Eva: EVA02 and EVA-CLIP (E: post-norm), the RoPE ViTs (axial or mixed RoPE, optional absolute position
    embedding), DINOv3 (RoPE on patch centres in [-1, 1], class + 4 register tokens, LayerScale, SwiGLU in the plus
    sizes), LingBot and Sapiens2."""

    global_pools = ("avg", "token", "")
    timm_names = frozenset([f"eva02_{s}_patch14_{i}" for s, i in (("tiny", 224), ("tiny", 336), ("small", 224),
                                                                  ("small", 336), ("base", 224), ("base", 448),
                                                                  ("large", 224), ("large", 448))]
                           + [f"vit_{s}_patch16_rope{k}_224" for s in ("small", "base", "large")
                              for k in ("", "_ape", "_mixed", "_mixed_ape")]
                           + [f"vit_{s}_patch16_rope_reg1_gap_256" for s in ("medium", "mediumd", "base")]
                           + ["vit_betwixt_patch16_rope_reg4_gap_256"]
                           + [f"eva_giant_patch14_{i}" for i in (224, 336, 560)]
                           + ["eva02_base_patch16_clip_224", "eva02_large_patch14_clip_224",
                              "eva02_large_patch14_clip_336", "eva_giant_patch14_clip_224"]
                           + [f"vit_{s}_patch16_dinov3{b}" for s in DINOV3_SIZES for b in ("", "_qkvb")]
                           + list(DINOV3_OTHERS) + ["eva02_enormous_patch14_clip_224"]
                           + [f"vit_{s}_patch16_lingbot" for s in (*LINGBOT_SIZES, "giant")]
                           + [f"vit_{s}_patch16_sapiens2" for s in SAPIENS2_SIZES])
    no_weight_decay_names = ("pos_embed", "cls_token", "reg_token", "freqs")
    mlp_bias = True  # timm's Eva has MLP biases always (DeepSeek's tower, a subclass, has none)
    no_pretrain = ("MAE and MPP run the ViT encoder's forward with an absolute position embedding; the rotary "
                   "models' objectives (EVA02's CLIP-feature regression, DINOv3's self-distillation) are not "
                   "implemented")

    @property
    def timm_spec(self) -> TimmSpec:
        """timm's Eva class; the base name is a DINOv3 one where the LayerNorm eps is DINOv3's, a Sapiens2 one for
        RMSNorm (timm sets the norm by name). Every argument is exported, None ones included, so the base name's
        defaults never apply."""
        dino, rms = self.norm_eps == DINOV3_NORM_EPS, self.norm_layer == "rmsnorm"
        base = "vit_base_patch16_sapiens2" if rms else "vit_small_patch16_dinov3" if dino else "eva_giant_patch14_224"
        return TimmSpec("Eva", EVA_ARGS, base, fixed={"norm_eps": DINOV3_NORM_EPS if dino and not rms else 1e-6,
                                                      "act_layer": "gelu", "norm_layer": self.norm_layer},
                        layer_scale_as_gamma=True)

    @property
    def hf_model_type(self) -> str | None:
        return "dinov3_vit" if self.hf_missing() == [] else None

    @property
    def no_hf(self) -> str:
        missing = self.hf_missing()
        return ("EVA02's and the RoPE ViTs' rotary attention (transformers has no such ViT class)" if missing is None
                else f"DINOv3 with {', '.join(missing)}")

    def hf_missing(self) -> list[str] | None:
        """What of this model transformers' DINOv3ViTModel cannot express (None: not a DINOv3 at all)."""
        if not isinstance(self.rope, CenteredRope):
            return None
        blk = self.blocks[0]
        checks = (("no class token", self.cls_token is None),
                  ("an absolute position embedding", self.pos_embed is not None),
                  ("no LayerScale", isinstance(blk.ls1, nn.Identity)), ("rope_rotate_half=False", not self.rope.half),
                  ("a rope grid offset", self.rope.offset != 0), ("'xy' rope indexing", self.rope.indexing != "ij"),
                  ("fc_norm", not isinstance(self.fc_norm, nn.Identity)),
                  ("no final norm", isinstance(self.norm, nn.Identity)),
                  ("qk_norm or a LayerNorm inside attention or MLP", not isinstance(blk.attn.q_norm, nn.Identity)
                   or not isinstance(blk.attn.norm, nn.Identity) or not isinstance(blk.mlp.norm, nn.Identity)),
                  ("a pre-transformer norm", not isinstance(self.norm_pre, nn.Identity)),
                  ("RMSNorm", self.norm_layer != "layernorm"),
                  ("grouped-query attention", any(b.attn.num_kv_heads != b.attn.num_heads for b in self.blocks)),
                  ("LayerScale on attention only",
                   isinstance(blk.ls2, nn.Identity) != isinstance(blk.ls1, nn.Identity)))
        return [what for what, present in checks if present]

    @property
    def family(self) -> str:
        if self.rope is None:
            post = isinstance(self.blocks[0], EvaBlockPostNorm) if len(self.blocks) else False
            return "EVA (residual post-norm, no rotary embedding)" if post else "EVA (no rotary embedding)"
        if isinstance(self.rope, CenteredRope):
            return "DINOv3 (RoPE on patch centres in [-1, 1])"
        return "RoPE ViT (mixed)" if isinstance(self.rope, MixedRope) else "EVA02 / RoPE ViT (axial RoPE)"

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="avg", embed_dim=768,
                 depth=12, num_heads=12, qkv_bias=True, qkv_fused=True, qk_norm=False, mlp_ratio=4.0,
                 swiglu_mlp=False, scale_mlp=False, scale_attn_inner=False, attn_type="eva", init_values=None,
                 class_token=True, num_reg_tokens=0, no_embed_class=False, use_abs_pos_emb=True,
                 use_rot_pos_emb=False, rope_type="cat", rope_grid_offset=0.0, rope_grid_indexing="ij",
                 rope_temperature=10000.0, use_pre_transformer_norm=False, use_post_transformer_norm=None,
                 use_fc_norm=None, dynamic_img_size=False, ref_feat_shape=None, head_init_scale=0.001,
                 act_layer="gelu", norm_eps=1e-6, drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0,
                 attn_drop_rate=0.0, drop_path_rate=0.0, swiglu_align_to=0, rope_rotate_half=False,
                 rope_shift_coords=None, rope_jitter_coords=None, rope_rescale_coords=None, num_kv_heads=None,
                 attn_only_layer_scale=False, use_post_norm=False, norm_layer="layernorm"):
        super().__init__()
        for name, value, accepted in (("global_pool", global_pool, self.global_pools), ("rope_type", rope_type,
                                      ROPE_TYPES), ("attn_type", attn_type, ("eva", "rope")),
                                      ("rope_grid_indexing", rope_grid_indexing, ("ij", "xy"))):
            if value not in accepted:
                raise VitlabError(f"{name} {value!r} is not one vitlab implements; accepted: {', '.join(accepted)}")
        if global_pool == "token" and not class_token:
            raise VitlabError("global_pool='token' needs a class token; use global_pool='avg' with class_token=False")
        kv_heads = self.kv_heads(num_kv_heads, depth)
        if use_post_norm and (qk_norm or attn_only_layer_scale or any(h is not None for h in kv_heads)):
            raise VitlabError("use_post_norm=True takes none of qk_norm, attn_only_layer_scale, num_kv_heads "
                              "(timm's rule); accepted: use_post_norm=False with them")
        self.norm_eps, self.norm_layer = norm_eps, norm_layer
        norm_layer = get_norm_layer(norm_layer, norm_eps)
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
        augment = CoordAugment(rope_shift_coords, rope_jitter_coords, rope_rescale_coords)
        self.rope = make_rope(rope_type, embed_dim // num_heads, depth, num_heads, rope_grid_offset,
                              rope_grid_indexing, rope_temperature, rope_rotate_half, ref_feat_shape,
                              augment) if use_rot_pos_emb else None
        self.norm_pre = norm_layer(embed_dim) if use_pre_transformer_norm else nn.Identity()
        attn_kwargs = dict(qkv_bias=qkv_bias, qkv_fused=qkv_fused, bias_layout="qv" if attn_type == "eva" else "qkv",
                           num_prefix_tokens=self.num_prefix_tokens, qk_norm=qk_norm, scale_norm=scale_attn_inner,
                           attn_drop=attn_drop_rate, proj_drop=proj_drop_rate, rotate_half=rope_rotate_half)
        block = EvaBlockPostNorm if use_post_norm else EvaBlock
        self.blocks = nn.ModuleList([
            block(embed_dim, num_heads, make_mlp(embed_dim, mlp_ratio, swiglu_mlp, scale_mlp, act_layer,
                                                 proj_drop_rate, norm_layer, swiglu_align_to, self.mlp_bias),
                  {**attn_kwargs, "num_kv_heads": kv}, init_values=init_values, drop_path=dpr, norm_layer=norm_layer,
                  attn_only_layer_scale=attn_only_layer_scale)
            for dpr, kv in zip(drop_path_rates(drop_path_rate, depth), kv_heads)])
        self.norm = norm_layer(embed_dim) if post_norm else nn.Identity()
        self.fc_norm = norm_layer(embed_dim) if fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(head_init_scale)

    @staticmethod
    def kv_heads(num_kv_heads: int | tuple[int, ...] | None, depth: int) -> tuple[int | None, ...]:
        """Each block's key/value heads (None: as many as query heads) from one number or one per block."""
        if num_kv_heads is None or isinstance(num_kv_heads, int):
            return (num_kv_heads,) * depth
        if len(num_kv_heads) != depth:
            raise VitlabError(f"num_kv_heads has {len(num_kv_heads)} entries for {depth} blocks; accepted: one "
                              "number, or one per block")
        return tuple(num_kv_heads)

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

    def rotary_embedding(self) -> torch.Tensor | None:
        """Each patch's rotation at the model's grid (eval mode): (N, sines and cosines), every block's and head's
        side by side for mixed RoPE; None without RoPE."""
        if self.rope is None:
            return None
        training = self.rope.training
        with torch.no_grad():
            emb = self.rope.eval()(self.patch_embed.grid_size)  # (N, 2 hd) or (depth, heads, N, 2 hd)
        self.rope.train(training)
        return emb.movedim(-2, 0).reshape(emb.shape[-2], -1)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> (B, D): the mean patch token or the class token, through fc_norm."""
        return self.fc_norm(super().pool(x))
