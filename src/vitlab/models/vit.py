"""Vision Transformer (Dosovitskiy et al. 2020) and DeiT (Touvron et al. 2020).

DeiT is the same model with a second prefix token, the distillation token, read by its own
head ``head_dist``: in training ``forward`` returns both heads' logits, in eval their mean.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec
from .layers import (
    Attention,
    AttentionPoolLatent,
    Block,
    ParallelScalingBlock,
    ParallelThingsBlock,
    PatchEmbed,
    drop_path_rates,
    get_act_layer,
    get_norm_layer,
    init_weights_vit,
    packed_swiglu,
    resample_abs_pos_embed,
    sincos_2d_pos_embed,
    split_swiglu,
)
from .vit_presets import MORE_TIMM_PRESETS, vit_size

# sincos_xy: no parameter, the sin-cos table of each input's own grid, columns' channels first (AIMv2-native)
POS_EMBEDS = ("learn", "sincos", "none", "sincos_xy")
# timm's Mlp, SwiGLUPacked (fc1's width int(embed_dim * mlp_ratio)) and SwiGLU (fc1_g and fc1_x each that wide)
MLP_LAYERS = ("mlp", "swiglu_packed", "swiglu")
MLP_BUILDERS = {"mlp": None, "swiglu_packed": packed_swiglu, "swiglu": split_swiglu}
AIMV2_NORM_EPS = 1e-5  # timm's AIMv2 names build their RMSNorms with eps 1e-5
# token_avg: the class token and the mean patch token side by side (transformers' Dinov2ForImageClassification)
GLOBAL_POOLS = ("token", "avg", "map", "token_avg", "")
# the arguments timm's VisionTransformer takes with vitlab's names and meaning
TIMM_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "mlp_ratio", "qkv_bias", "qk_norm", "proj_bias", "init_values", "class_token", "pos_embed",
             "no_embed_class", "reg_tokens", "pre_norm", "final_norm", "fc_norm", "dynamic_img_size", "act_layer",
             "drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "norm_layer")

def _size(size: str, patch: int, img: int, **options) -> dict:
    return {"img_size": img, "patch_size": patch, **vit_size(size), **options}


def timm_presets() -> dict[str, dict]:
    """timm's names for the modern ViTs (DeiT III, DINOv2, register and GAP ViTs, CLIP and SigLIP towers), with
    the arguments timm's registered functions give them (CLIP's LayerNorm eps 1e-5 as norm_eps)."""
    out = {}
    for size, patch, img in (("small", 16, 224), ("small", 16, 384), ("medium", 16, 224), ("base", 16, 224),
                             ("base", 16, 384), ("large", 16, 224), ("large", 16, 384), ("huge", 14, 224)):
        out[f"deit3_{size}_patch{patch}_{img}"] = _size(size, patch, img, no_embed_class=True, init_values=1e-6)
    for size in ("small", "base", "large"):
        out[f"vit_{size}_patch14_dinov2"] = _size(size, 14, 518, init_values=1e-5)
        out[f"vit_{size}_patch14_reg4_dinov2"] = _size(size, 14, 518, init_values=1e-5, reg_tokens=4,
                                                       no_embed_class=True)
    reg4 = dict(class_token=False, no_embed_class=True, reg_tokens=4, global_pool="avg")
    for size, img in (("medium", 256), ("betwixt", 256), ("betwixt", 384)):
        out[f"vit_{size}_patch16_reg4_gap_{img}"] = _size(size, 16, img, init_values=1e-5, **reg4)
    out["vit_base_patch16_reg4_gap_256"] = _size("base", 16, 256, **reg4)
    gap = dict(class_token=False, global_pool="avg", fc_norm=False)
    out["vit_base_patch16_gap_224"] = dict(_size("base", 16, 224, **gap), num_heads=16)
    for size, img in (("medium", 240), ("medium", 256), ("medium", 384), ("betwixt", 256)):
        out[f"vit_{size}_patch16_gap_{img}"] = _size(size, 16, img, qkv_bias=False, init_values=1e-6, **gap)
    clip = dict(pre_norm=True, norm_eps=1e-5)
    for size, patch, img in (("medium", 32, 224), ("medium", 16, 224), ("betwixt", 32, 224), ("base", 32, 224),
                             ("base", 16, 224), ("large", 14, 224), ("large", 14, 336), ("huge", 14, 224)):
        out[f"vit_{size}_patch{patch}_clip_{img}"] = _size(size, patch, img, **clip)
    for size, patch, img in (("base", 32, 224), ("base", 16, 224), ("large", 14, 224), ("large", 14, 336),
                             ("huge", 14, 224)):
        out[f"vit_{size}_patch{patch}_clip_quickgelu_{img}"] = _size(size, patch, img, act_layer="quick_gelu", **clip)
    siglip = dict(class_token=False, global_pool="map")
    for img in (224, 256, 384, 512):
        out[f"vit_base_patch16_siglip_{img}"] = _size("base", 16, img, **siglip)
        out[f"vit_base_patch16_siglip_gap_{img}"] = _size("base", 16, img, **gap)
    out["vit_base_patch32_siglip_256"] = _size("base", 32, 256, act_layer="gelu_tanh", **siglip)
    for img in (256, 384, 512):
        tanh = {"act_layer": "gelu_tanh"} if img == 512 else {}
        out[f"vit_large_patch16_siglip_{img}"] = _size("large", 16, img, **tanh, **siglip)
        out[f"vit_so400m_patch16_siglip_{img}"] = _size("so400m", 16, img, mlp_ratio=3.7362, act_layer="gelu_tanh",
                                                        **siglip)
    for img in (224, 378):  # timm's 384 crops the input to 378 (27 patches of 14): vitlab refuses that size
        out[f"vit_so400m_patch14_siglip_{img}"] = _size("so400m", 14, img, mlp_ratio=3.7362, **siglip)
    return out


TIMM_PRESETS = {**timm_presets(), **MORE_TIMM_PRESETS}
CLIP_NORM_EPS = 1e-5


def add_output_layers(model: Model, num_heads: int, mlp_ratio: float, norm_layer, act, norm: bool, fc_norm: bool,
                      drop_rate: float, attn_pool_kind: str = "siglip", qkv_bias: bool = True) -> None:
    """timm's ViT output layers on ``model``: the final ``norm`` on every token, SigLIP's attention pool ``attn_pool``
    (global_pool 'map'), ``fc_norm`` on the pooled token, ``head_drop`` and the ``head`` (num_features wide)."""
    dim = model.embed_dim
    model.norm = norm_layer(dim) if norm else nn.Identity()
    model.attn_pool = None
    if model.global_pool == "map":
        aimv2 = attn_pool_kind == "aimv2"  # AIMv2's keys and values take the blocks' qkv_bias
        model.attn_pool = AttentionPoolLatent(dim, num_heads, mlp_ratio, qkv_bias=qkv_bias if aimv2 else True,
                                              norm_layer=norm_layer, act_layer=act, kind=attn_pool_kind)
    model.fc_norm = norm_layer(dim) if fc_norm else nn.Identity()
    model.head_drop = nn.Dropout(drop_rate)
    n = model.num_classes
    model.head = nn.Linear(model.num_features, n) if n > 0 else nn.Identity()


def _check_arguments(num_parallel: int, parallel_scaling: bool, global_pool: str, pos_embed: str, mlp_layer: str,
                     distilled: bool, class_token: bool, reg_tokens: int, fc_norm: bool | None) -> None:
    """One line naming what VisionTransformer's arguments combine wrongly, and what is accepted."""
    if num_parallel < 1:
        raise VitlabError(f"num_parallel {num_parallel} is not accepted: 1 (sequential blocks) or more (branches)")
    if parallel_scaling and num_parallel > 1:
        raise VitlabError("parallel_scaling=True and num_parallel > 1 are two kinds of block; "
                          "accepted: one of them")
    if global_pool not in GLOBAL_POOLS:
        raise VitlabError(f"global_pool {global_pool!r} is not one of {GLOBAL_POOLS}")
    if pos_embed not in POS_EMBEDS:
        raise VitlabError(f"pos_embed {pos_embed!r} is not one of {POS_EMBEDS}")
    if mlp_layer not in MLP_LAYERS:
        raise VitlabError(f"mlp_layer {mlp_layer!r} is not one vitlab implements; "
                          f"accepted: {', '.join(MLP_LAYERS)}")
    if mlp_layer != "mlp" and (num_parallel > 1 or parallel_scaling):
        raise VitlabError(f"mlp_layer={mlp_layer!r} is for sequential blocks; accepted with parallel blocks: 'mlp'")
    if distilled and (not class_token or global_pool != "token"):
        raise VitlabError("a distilled model reads the class and distillation tokens: "
                          "it needs class_token=True and global_pool='token'")
    if distilled and reg_tokens:
        raise VitlabError("a model has either a distillation token or register tokens, not both")
    if global_pool == "token_avg" and (not class_token or fc_norm):
        raise VitlabError("global_pool='token_avg' needs a class token and no fc_norm")
    if global_pool == "token" and not class_token:
        raise VitlabError("global_pool='token' needs a class token; use global_pool='avg' with class_token=False")


def _blocks(depth: int, embed_dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, qk_norm: bool,
            proj_bias: bool, init_values: float | None, proj_drop_rate: float, attn_drop_rate: float,
            drop_path_rate: float, act: type[nn.Module], norm_layer, mlp_layer: str, num_parallel: int,
            parallel_scaling: bool) -> nn.Sequential:
    """The transformer's blocks: sequential (timm's Block), parallel branches or ViT-22B's fused block, with
    stochastic depth growing linearly to drop_path_rate at the last."""
    dpr = drop_path_rates(drop_path_rate, depth)
    block = (partial(ParallelScalingBlock, qk_norm=qk_norm) if parallel_scaling else
             partial(Block, mlp_layer=MLP_BUILDERS[mlp_layer])
             if num_parallel == 1 else partial(ParallelThingsBlock, num_parallel=num_parallel))
    return nn.Sequential(*[
        block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
              attn_drop=attn_drop_rate, init_values=init_values, drop_path=dpr[i],
              act_layer=act, norm_layer=norm_layer, proj_bias=proj_bias,
              attn_layer=partial(Attention, qk_norm=qk_norm, proj_bias=proj_bias, norm_layer=norm_layer))
        for i in range(depth)])


class VisionTransformer(Model):
    """timm's VisionTransformer and its options: DeiT (distilled), DeiT III, DINOv2, CLIP, SigLIP, register ViTs,
    AIMv2, ViT-22B's parallel blocks. The arguments are timm's, with timm's names and meaning (``TIMM_ARGS``), and
    vitlab's few more.

    Args:
        img_size: the input size the position table is made for (an int, or (height, width)).
        patch_size: the side of a patch (an int, or (height, width)); the grid is img_size / patch_size.
        in_chans: the channels of an input image.
        num_classes: the classifier's width; 0 gives no classifier (forward returns the pooled features).
        global_pool: how the tokens become one: 'token' (the class token), 'avg' (the mean patch token), 'map'
            (SigLIP's attention pool), 'token_avg' (class and mean patch token side by side), '' (none).
        embed_dim: the width of every token.
        depth: the number of transformer blocks.
        num_heads: the attention heads of each block.
        mlp_ratio: the MLP's hidden width over embed_dim.
        qkv_bias: biases on the query, key and value projections.
        init_values: LayerScale's initial value (DeiT III, DINOv2); None: no LayerScale.
        class_token: a class token before the patch tokens.
        reg_tokens: register tokens after the class token (Darcet et al. 2023).
        distilled: DeiT's distillation token and its head ``head_dist``.
        no_embed_class: the position table covers the patch tokens only (the prefix tokens get none).
        pos_embed: 'learn' (a learned table), 'sincos' (a fixed 2D sin-cos table), 'none', or 'sincos_xy'
            (no parameter: the sin-cos table of each input's own grid, columns' channels first; AIMv2-native).
        dynamic_img_size: accept other input sizes, the position table resampled to each grid.
        fc_norm: a norm on the pooled token instead of the final norm on every token; None: with 'avg' pooling.
        act_layer: the MLP's activation, a name in ``layers.ACTIVATIONS`` (gelu, gelu_tanh, relu, silu, quick_gelu).
        norm_eps: the norms' epsilon (timm: 1e-6; CLIP: 1e-5).
        qk_norm: normalise queries and keys per head.
        proj_bias: biases on the attention's and the MLP's output projections.
        pre_norm: CLIP's norm ``norm_pre`` after the position embedding (the patch projection then has no bias).
        final_norm: the final norm (and fc_norm); False drops both.
        pos_embed_antialias: antialias when the position table is resampled to another grid (timm: True).
        drop_rate: dropout before the classifier.
        pos_drop_rate: dropout after the position embedding.
        proj_drop_rate: dropout after the attention's and the MLP's output projections.
        attn_drop_rate: dropout on the attention weights.
        drop_path_rate: stochastic depth of the last block (growing linearly from 0 over the blocks).
        num_parallel: attention then MLP branches per block (timm's ParallelThingsBlock); 1: sequential.
        parallel_scaling: ViT-22B's block, attention and MLP side by side from one fused projection (timm's
            ParallelScalingBlock).
        norm_layer: 'layernorm' or 'rmsnorm' (every norm of the model; timm's ``_xp_`` ViTs).
        mlp_layer: 'mlp' (timm's Mlp), 'swiglu_packed' (DINOv2's giant MLP, gate and value in one fc1) or
            'swiglu' (timm's SwiGLU, fc1_g and fc1_x; AIMv2).
        embed_norm: a norm on the patch tokens before the position embedding (timm's AIMv2).
        attn_pool_kind: the attention pool of global_pool 'map': 'siglip' (timm's) or 'aimv2'
            (transformers' AIMv2 head: the latent the query itself, no MLP).
    """

    global_pools = ("token", "avg", "")  # those reset_classifier may switch between (same width, no extra layers)
    no_weight_decay_names = ("pos_embed", "cls_token", "dist_token", "reg_token")
    timm_names = frozenset(
        [f"deit_{s}{d}_patch16_224" for s in ("tiny", "small", "base") for d in ("", "_distilled")]
        + [f"vit_{s}_patch{p}_{i}" for s in ("small", "base", "large") for p in (16, 32) for i in (224, 384)]
        + ["vit_tiny_patch16_224", "vit_tiny_patch16_384"] + list(TIMM_PRESETS))

    @property
    def family(self) -> str:
        if self.dist_token is not None:
            return "DeiT (distilled: class + distillation token)"
        if self.is_aimv2:
            return "AIMv2 (RMSNorm, SwiGLU, normalised patch tokens)"
        if self.global_pool == "map":
            return "ViT (attention-pool head)"
        if self.num_parallel > 1:
            return f"ViT ({self.num_parallel} parallel branches per block)"
        if self.parallel_scaling:
            return "ViT (parallel attention and MLP, one fused projection per block)"
        return "ViT" if self.cls_token is not None else "ViT (no class token, average pooling)"

    @property
    def classifier_names(self) -> tuple[str, ...]:
        return ("head", "head_dist") if self.dist_token is not None else ("head",)

    @property
    def is_aimv2(self) -> bool:
        """AIMv2's layout: RMSNorm (also on the patch tokens) and the split SwiGLU MLP."""
        return self.embed_norm and self.mlp_layer == "swiglu" and self.norm_layer == "rmsnorm"

    @property
    def timm_spec(self) -> TimmSpec | None:
        """timm's class; the base name is CLIP's where the LayerNorm eps is CLIP's (timm sets it by name), AIMv2's
        where the model has AIMv2's layout (its names fix the norms and the MLP)."""
        if self.pos_embed_type == "sincos_xy":
            return None
        if self.embed_norm or self.mlp_layer == "swiglu":
            return self._aimv2_timm_spec()
        distilled = self.dist_token is not None
        arch = getattr(self, "arch", None)
        clip = "_clip_" in arch if arch in self.timm_names else self.norm_eps == CLIP_NORM_EPS
        glu = self.mlp_layer == "swiglu_packed"  # timm's mlp_layer is a class, fixed by the name
        base = ("vit_giant_patch14_dinov2" if glu else "vit_base_patch16_clip_224" if clip else
                "vit_tiny_patch16_224")
        # timm's block_fn, fixed by the name: only its 18x2 names hold two branches, its pwee name fused blocks
        parallel, scaling = self.num_parallel > 1, self.parallel_scaling
        return TimmSpec("VisionTransformerDistilled" if distilled else "VisionTransformer", TIMM_ARGS,
                        "deit_tiny_distilled_patch16_224" if distilled else
                        "vit_small_patch16_18x2_224" if parallel else
                        "vit_pwee_patch16_reg1_gap_256" if scaling else base,
                        fixed={"norm_eps": CLIP_NORM_EPS if clip else 1e-6, "pos_embed_antialias": True,
                               **({"global_pool": "token"} if self.global_pool == "token_avg" else {}),
                               **({} if parallel else {"num_parallel": 1}),
                               **({} if scaling else {"parallel_scaling": False}),
                               "embed_norm": False, "attn_pool_kind": "siglip"},
                        dropped=("distilled", "mlp_layer", *(("num_parallel",) if parallel else ()),
                                 *(("parallel_scaling",) if scaling else ()),
                                 *(("norm_layer",) if self.norm_layer == "layernorm" else ())),
                        values={"pos_embed": {"sincos": "learn"}})  # the fixed table exported as a learned one

    def _aimv2_timm_spec(self) -> TimmSpec | None:
        """timm holds the split SwiGLU and the patch-token norm under its AIMv2 names only, which fix RMSNorm at
        eps 1e-5, the SwiGLU and the norm on the patch tokens."""
        arch = getattr(self, "arch", None)
        base = arch if arch in self.timm_names and arch.startswith("aimv2_") else "aimv2_large_patch14_224"
        return TimmSpec("VisionTransformer", tuple(a for a in TIMM_ARGS if a != "norm_layer"), base,
                        fixed={"norm_eps": AIMV2_NORM_EPS, "norm_layer": "rmsnorm", "mlp_layer": "swiglu",
                               "embed_norm": True, "pos_embed_antialias": True, "num_parallel": 1,
                               "parallel_scaling": False, "distilled": False, "attn_pool_kind": "siglip"})

    @property
    def no_timm(self) -> str:
        if self.pos_embed_type == "sincos_xy":
            return "timm has no ViT whose sin-cos table is computed for each input (AIMv2-native is transformers')"
        return ""

    @property
    def hf_model_type(self) -> str | None:
        if self.is_aimv2:
            return "aimv2_vision_model"
        if self.no_hf:
            return None
        return "deit" if self.dist_token is not None else "vit"

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int | tuple[int, int] = 16,
                 in_chans: int = 3, num_classes: int = 1000, global_pool: str = "token", embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 init_values: float | None = None, class_token: bool = True, reg_tokens: int = 0,
                 distilled: bool = False, no_embed_class: bool = False, pos_embed: str = "learn",
                 dynamic_img_size: bool = False, fc_norm: bool | None = None, act_layer: str = "gelu",
                 norm_eps: float = 1e-6, qk_norm: bool = False, proj_bias: bool = True, pre_norm: bool = False,
                 final_norm: bool = True, pos_embed_antialias: bool = True, drop_rate: float = 0.0,
                 pos_drop_rate: float = 0.0, proj_drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, num_parallel: int = 1, parallel_scaling: bool = False,
                 norm_layer: str = "layernorm", mlp_layer: str = "mlp", embed_norm: bool = False,
                 attn_pool_kind: str = "siglip"):
        """The arguments are the class's (see its docstring)."""
        super().__init__()
        _check_arguments(num_parallel, parallel_scaling, global_pool, pos_embed, mlp_layer, distilled, class_token,
                         reg_tokens, fc_norm)
        self.norm_eps, self.mlp_layer, self.norm_layer = norm_eps, mlp_layer, norm_layer
        self.embed_norm = embed_norm
        norm_layer = get_norm_layer(norm_layer, norm_eps)
        use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        if global_pool == "token_avg":
            self.num_features = 2 * embed_dim
        self.num_prefix_tokens = int(class_token) + int(distilled) + reg_tokens
        self.no_embed_class = no_embed_class
        self.dynamic_img_size = dynamic_img_size
        self.pos_embed_antialias = pos_embed_antialias  # resampling the table for another size (timm: True)
        self.num_parallel = num_parallel
        self.parallel_scaling = parallel_scaling
        if num_parallel > 1 or parallel_scaling:
            self.no_hf = "a ViT with parallel blocks"
        elif self.norm_layer != "layernorm" or mlp_layer != "mlp":
            self.no_hf = "a ViT with RMSNorm or a SwiGLU MLP"

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, bias=not pre_norm,
                                      dynamic_img_size=dynamic_img_size,
                                      norm_layer=norm_layer if embed_norm else None)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        embed_len = self.patch_embed.num_patches + (0 if no_embed_class else self.num_prefix_tokens)
        if pos_embed in ("none", "sincos_xy"):
            self.pos_embed = None
        else:
            self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim), requires_grad=pos_embed == "learn")
        self.pos_embed_type = pos_embed
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.norm_pre = norm_layer(embed_dim) if pre_norm else nn.Identity()

        act = get_act_layer(act_layer)
        self.blocks = _blocks(depth, embed_dim, num_heads, mlp_ratio, qkv_bias, qk_norm, proj_bias, init_values,
                              proj_drop_rate, attn_drop_rate, drop_path_rate, act, norm_layer, mlp_layer, num_parallel,
                              parallel_scaling)
        add_output_layers(self, num_heads, mlp_ratio, norm_layer, act, final_norm and not use_fc_norm,
                          final_norm and use_fc_norm, drop_rate, attn_pool_kind, qkv_bias)
        self.head_dist = None
        if distilled:
            self.head_dist = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's init; a fixed sin-cos table when pos_embed='sincos'."""
        self.init_pos_embed()
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for token in (self.dist_token, self.reg_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        self.apply(init_weights_vit)

    def init_pos_embed(self) -> None:
        """A position embedding for every token of ``patch_embed``'s grid (and the prefix tokens unless
        no_embed_class): truncated normal, or the fixed 2D sin-cos table."""
        if self.pos_embed is None:
            return
        n = self.patch_embed.num_patches + (0 if self.no_embed_class else self.num_prefix_tokens)
        if self.pos_embed.shape[1] != n:  # a subclass changed the grid
            self.pos_embed = nn.Parameter(self.pos_embed.new_zeros(1, n, self.embed_dim),
                                          requires_grad=self.pos_embed.requires_grad)
        if self.pos_embed_type == "sincos":
            table = sincos_2d_pos_embed(self.patch_embed.grid_size, self.embed_dim)
            prefix = torch.zeros(1, self.pos_embed.shape[1] - table.shape[0], self.embed_dim)
            with torch.no_grad():
                self.pos_embed.copy_(torch.cat([prefix, table[None]], dim=1))
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, w, D) grid -> (B, prefix + h*w, D) with prefix tokens and position embedding."""
        B, h, w, D = x.shape
        x = x.reshape(B, h * w, D)
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.pos_embed_type == "sincos_xy":  # the table of this grid, computed as the input comes
            x = x + sincos_2d_pos_embed((h, w), D, columns_first=True).to(x.device, x.dtype)
            return self.pos_drop(torch.cat(prefix + [x], dim=1))
        if self.pos_embed is None:
            return torch.cat(prefix + [x], dim=1)
        pos_embed = self.pos_embed
        if (h, w) != self.patch_embed.grid_size:
            pos_embed = resample_abs_pos_embed(pos_embed, (h, w), self.patch_embed.grid_size,
                                               num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens,
                                               antialias=self.pos_embed_antialias)
        if self.no_embed_class:
            x = torch.cat(prefix + [x + pos_embed], dim=1)
        else:
            x = torch.cat(prefix + [x], dim=1) + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, prefix + N, D) tokens after the final norm."""
        x = self.patch_embed(x)  # (B, h, w, D)
        x = self.norm_pre(self._pos_embed(x))  # (B, prefix + N, D)
        x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> (B, D): the pooled token (or the attention pool's output), through fc_norm."""
        if self.global_pool == "token_avg":
            return torch.cat([x[:, 0], x[:, self.num_prefix_tokens:].mean(dim=1)], dim=-1)
        if self.global_pool == "map":
            if self.attn_pool is None:
                raise VitlabError("global_pool='map' needs the attention-pool head built with the model")
            return self.fc_norm(self.attn_pool(x[:, self.num_prefix_tokens:]))
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
