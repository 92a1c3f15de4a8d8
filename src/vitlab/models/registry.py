"""Model names (timm's where timm has the model) and their defaults; create_model and list_models."""
from __future__ import annotations

import difflib
import inspect
import math
from typing import Any

from torch import nn

from ..catalog import matching
from ..errors import VitlabError
from .airbench import AirBench
from .airbench_hybrid import AirBenchHybrid
from .base import DEFAULT_MEAN, DEFAULT_STD, Model, make_pretrained_cfg
from .beit import Beit
from .cait import Cait
from .cct import CompactTransformer
from .convit import ConVit
from .deepseek import DEEPSEEK_SIZES, DeepseekVit
from .eva import (
    DINOV3_NORM_EPS,
    DINOV3_OTHERS,
    DINOV3_SIZES,
    LINGBOT_SIZES,
    SAPIENS2_SIZES,
    Eva,
    sapiens2_kv_heads,
)
from .gemma4 import GEMMA4_SIZES, Gemma4Vit
from .hybrid import HybridVisionTransformer
from .mixer import MlpMixer
from .naflex import NaFlexVit
from .pe import PE_IMAGES, PE_LANG_DEPTH, PE_NORM_EPS, PE_PROJ, PE_SIZES, PerceptionEncoder
from .qwen3 import QWEN3_SIZES, Qwen3Vit
from .resnet import ResNet
from .resnetv2 import ResNetV2VisionTransformer
from .vit import TIMM_PRESETS, VisionTransformer
from .vit_presets import VIT_SIZES, vit_size

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INCEPTION_MEAN, INCEPTION_STD = DEFAULT_MEAN, DEFAULT_STD
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

class ModelSpec:
    """A registered name: its class, its default arguments and its preprocessing."""

    def __init__(self, cls: type[nn.Module], args: dict[str, Any], mean, std, description: str = ""):
        self.cls, self.args, self.mean, self.std, self.description = cls, args, mean, std, description


_REGISTRY: dict[str, ModelSpec] = {}


def register(name: str, cls: type[nn.Module], mean=IMAGENET_MEAN, std=IMAGENET_STD, **args: Any) -> None:
    _REGISTRY[name] = ModelSpec(cls, args, mean, std)


# ViT (timm's names; "augreg" weights use mean = std = 0.5)
_VIT_SIZES = {_size: VIT_SIZES[_size] for _size in ("tiny", "small", "base", "large")}
for _size, (_dim, _depth, _heads) in _VIT_SIZES.items():
    for _patch in (16, 32):
        for _img in (224, 384):
            register(f"vit_{_size}_patch{_patch}_{_img}", VisionTransformer, INCEPTION_MEAN, INCEPTION_STD,
                     img_size=_img, patch_size=_patch, embed_dim=_dim, depth=_depth, num_heads=_heads)
# DeiT: the ViT class, with the distillation token for the *_distilled names
for _size in ("tiny", "small", "base"):
    _dim, _depth, _heads = _VIT_SIZES[_size]
    register(f"deit_{_size}_patch16_224", VisionTransformer,
             patch_size=16, embed_dim=_dim, depth=_depth, num_heads=_heads)
    register(f"deit_{_size}_distilled_patch16_224", VisionTransformer,
             patch_size=16, embed_dim=_dim, depth=_depth, num_heads=_heads, distilled=True)
# DeiT III, DINOv2, register and GAP ViTs, CLIP and SigLIP image towers: timm's names and arguments; TIPSv2 takes
# pixels in [0, 1] as they are
for _name, _args in TIMM_PRESETS.items():
    _clip = "_clip_" in _name or _name.startswith("aimv2_")  # AIMv2 normalises as OpenAI's CLIP
    _mean_std = ((CLIP_MEAN, CLIP_STD) if _clip else ((0.0,) * 3, (1.0,) * 3) if "_tipsv2" in _name
                 else (INCEPTION_MEAN, INCEPTION_STD)
                 if "gap" in _name or "siglip" in _name or "_xp_" in _name else (IMAGENET_MEAN, IMAGENET_STD))
    register(_name, VisionTransformer, *_mean_std, **_args)
# CaiT
_CAIT = {"xxs24": (192, 24, 4, 1e-5), "xxs36": (192, 36, 4, 1e-5), "xs24": (288, 24, 6, 1e-5),
         "s24": (384, 24, 8, 1e-5), "s36": (384, 36, 8, 1e-6)}
for _name, (_dim, _depth, _heads, _ls) in _CAIT.items():
    for _img in (224, 384):
        register(f"cait_{_name}_{_img}", Cait, img_size=_img, patch_size=16, embed_dim=_dim, depth=_depth,
                 num_heads=_heads, init_values=_ls)
# BEiT and BEiT v2 (timm's names): relative position bias in every block, LayerScale, mean pooling with fc_norm
_BEIT = dict(patch_size=16, use_abs_pos_emb=False, use_rel_pos_bias=True)
for _img in (224, 384):
    register(f"beit_base_patch16_{_img}", Beit, INCEPTION_MEAN, INCEPTION_STD, **_BEIT, img_size=_img,
             **vit_size("base"), init_values=0.1)
for _img in (224, 384, 512):
    register(f"beit_large_patch16_{_img}", Beit, INCEPTION_MEAN, INCEPTION_STD, **_BEIT, img_size=_img,
             **vit_size("large"), init_values=1e-5)
for _size, (_dim, _depth, _heads) in ((_s, VIT_SIZES[_s]) for _s in ("base", "large")):
    register(f"beitv2_{_size}_patch16_224", Beit, **_BEIT, embed_dim=_dim, depth=_depth, num_heads=_heads,
             init_values=1e-5)
# EVA02 (timm's names): axial RoPE rescaled to the 16x16 pre-training grid, SwiGLU (sub-LayerNorm from base up)
_EVA02 = {"tiny": (*VIT_SIZES["tiny"], (224, 336)), "small": (*VIT_SIZES["small"], (224, 336)),
          "base": (*VIT_SIZES["base"], (224, 448)), "large": (*VIT_SIZES["large"], (224, 448))}
for _size, (_dim, _depth, _heads, _imgs) in _EVA02.items():
    _big = dict(qkv_fused=False, scale_mlp=True) if _size in ("base", "large") else {}
    for _img in _imgs:
        register(f"eva02_{_size}_patch14_{_img}", Eva, CLIP_MEAN, CLIP_STD, img_size=_img, patch_size=14,
                 embed_dim=_dim, depth=_depth, num_heads=_heads, mlp_ratio=4 * 2 / 3, swiglu_mlp=True,
                 use_rot_pos_emb=True, ref_feat_shape=(16, 16), **_big)
# EVA-g (the first EVA): timm's Eva class without RoPE, an absolute position embedding, mean pooling
for _img, _mean_std in ((224, (CLIP_MEAN, CLIP_STD)), (336, (CLIP_MEAN, CLIP_STD)),
                       (560, (IMAGENET_MEAN, IMAGENET_STD))):
    register(f"eva_giant_patch14_{_img}", Eva, *_mean_std, img_size=_img, patch_size=14, embed_dim=1408, depth=40,
             num_heads=16, mlp_ratio=6144 / 1408)
# EVA-CLIP image towers (timm's names): EVA02 with the sub-LayerNorm inside attention too (scale_attn_inner) and
# EVA-g, class-token pooling; the head is the CLIP projection (its width the embedding's)
for _name, (_patch, _dim, _depth, _heads, _img, _proj) in {
        "eva02_base_patch16_clip_224": (16, 768, 12, 12, 224, 512),
        "eva02_large_patch14_clip_224": (14, 1024, 24, 16, 224, 768),
        "eva02_large_patch14_clip_336": (14, 1024, 24, 16, 336, 768)}.items():
    register(_name, Eva, CLIP_MEAN, CLIP_STD, img_size=_img, patch_size=_patch, embed_dim=_dim, depth=_depth,
             num_heads=_heads, qkv_fused=False, mlp_ratio=4 * 2 / 3, swiglu_mlp=True, scale_mlp=True,
             scale_attn_inner=True, use_rot_pos_emb=True, ref_feat_shape=(16, 16), global_pool="token",
             num_classes=_proj)
register("eva_giant_patch14_clip_224", Eva, CLIP_MEAN, CLIP_STD, img_size=224, patch_size=14, embed_dim=1408, depth=40,
         num_heads=16, mlp_ratio=6144 / 1408, global_pool="token", num_classes=1024)
# EVA-CLIP-E: residual post-norm blocks (a norm after attention and after the MLP, no LayerScale), no RoPE
register("eva02_enormous_patch14_clip_224", Eva, CLIP_MEAN, CLIP_STD, img_size=224, patch_size=14, embed_dim=1792,
         depth=64, num_heads=16, mlp_ratio=15360 / 1792, use_post_norm=True, global_pool="token", num_classes=1024)
# RoPE ViTs (Heo et al. 2024, timm's names): axial (temperature 100) or mixed RoPE, optionally an absolute embedding
for _size, (_dim, _depth, _heads) in ((_s, VIT_SIZES[_s]) for _s in ("small", "base", "large")):
    for _kind, _rope in (("", dict(rope_temperature=100.0)), ("_mixed", dict(rope_temperature=10.0,
                                                                                rope_type="mixed"))):
        for _ape, _pos in (("", dict(use_abs_pos_emb=False)), ("_ape", dict(no_embed_class=True))):
            register(f"vit_{_size}_patch16_rope{_kind}{_ape}_224", Eva, patch_size=16, embed_dim=_dim, depth=_depth,
                     num_heads=_heads, attn_type="rope", init_values=1e-5, global_pool="token",
                     use_rot_pos_emb=True, rope_grid_indexing="xy", **_rope, **_pos,
                     **({"use_fc_norm": False} if (_size, _kind, _ape) == ("base", "", "") else {}))
# timm's SBB RoPE ViTs: registers, no class token, average pooling, EVA's axial RoPE
for _name, (_dim, _depth, _heads, _regs, _bias, _mean_std) in {
        "vit_medium_patch16_rope_reg1_gap_256": (512, 12, 8, 1, True, (INCEPTION_MEAN, INCEPTION_STD)),
        "vit_mediumd_patch16_rope_reg1_gap_256": (512, 20, 8, 1, False, (INCEPTION_MEAN, INCEPTION_STD)),
        "vit_betwixt_patch16_rope_reg4_gap_256": (640, 12, 10, 4, True, (CLIP_MEAN, CLIP_STD)),
        "vit_base_patch16_rope_reg1_gap_256": (768, 12, 12, 1, True, (INCEPTION_MEAN, INCEPTION_STD))}.items():
    register(_name, Eva, *_mean_std, img_size=256, patch_size=16, embed_dim=_dim, depth=_depth, num_heads=_heads,
             qkv_bias=_bias, init_values=1e-5, class_token=False, num_reg_tokens=_regs, use_rot_pos_emb=True,
             use_abs_pos_emb=False, ref_feat_shape=(16, 16))
# DINOv3 (timm's names): RoPE on patch centres in [-1, 1] (temperature 100, half layout) and no position table, so any
# input size; class + 4 register tokens, LayerScale; SwiGLU (hidden width rounded to 8) in the plus sizes; _qkvb:
# query and value biases (zero in Meta's weights)
_DINOV3 = dict(img_size=256, patch_size=16, init_values=1e-5, rope_type="dinov3", rope_temperature=100.0,
               rope_rotate_half=True, use_rot_pos_emb=True, use_abs_pos_emb=False, num_reg_tokens=4, use_fc_norm=False,
               norm_eps=DINOV3_NORM_EPS, dynamic_img_size=True, qkv_bias=False)
for _size, (_dim, _depth, _heads, _swiglu) in DINOV3_SIZES.items():
    for _qkvb in ("", "_qkvb"):
        register(f"vit_{_size}_patch16_dinov3{_qkvb}", Eva, **{**_DINOV3, "qkv_bias": bool(_qkvb)}, embed_dim=_dim,
                 depth=_depth, num_heads=_heads, **(dict(swiglu_mlp=True, swiglu_align_to=8) if _swiglu else {}))
for _name, _args in DINOV3_OTHERS.items():
    register(_name, Eva, **{**_DINOV3, **_args})
# NaFlex ViTs (timm's names): a linear embedding of flattened patches, a 16x16 position table resized to each image's
# grid, so a batch may mix aspect ratios; _siglip: SigLIP 2's image tower (bilinear resize, attention pool)
_NAFLEX = dict(img_size=384, patch_size=16)
for _kind, _args in {"gap": dict(init_values=1e-5, global_pool="avg", reg_tokens=4, fc_norm=True),
                     "par_gap": dict(init_values=1e-5, pos_embed_ar_preserving=True, global_pool="avg", reg_tokens=4,
                                     fc_norm=True),
                     "parfac_gap": dict(init_values=1e-5, pos_embed_ar_preserving=True, pos_embed="factorized",
                                        global_pool="avg", reg_tokens=4, fc_norm=True),
                     "map": dict(init_values=1e-5, global_pool="map", reg_tokens=1),
                     "siglip": dict(act_layer="gelu_tanh", global_pool="map",
                                    pos_embed_interp_mode="bilinear")}.items():
    register(f"naflexvit_base_patch16_{_kind}", NaFlexVit, INCEPTION_MEAN, INCEPTION_STD, **_NAFLEX, embed_dim=768,
             depth=12, num_heads=12, **_args)
for _pool, _args in (("gap", dict(global_pool="avg", fc_norm=True)), ("map", dict(global_pool="map"))):
    register(f"naflexvit_so150m2_patch16_reg1_{_pool}", NaFlexVit, INCEPTION_MEAN, INCEPTION_STD, **_NAFLEX,
             embed_dim=832, depth=21, num_heads=13, mlp_ratio=34 / 13, init_values=1e-5, qkv_bias=False, reg_tokens=1,
             **_args)
register("naflexvit_so400m_patch16_siglip", NaFlexVit, INCEPTION_MEAN, INCEPTION_STD, **_NAFLEX, embed_dim=1152,
         depth=27, num_heads=16, mlp_ratio=3.7362, act_layer="gelu_tanh", global_pool="map",
         pos_embed_interp_mode="bilinear")
# C-RADIO v3 and v4 backbones (timm's names): NaFlex ViTs with a class token read as the output, the other teachers'
# summary tokens as registers, a 128x128 table resized to a square of the longer side and cropped, no final norm
_RADIO = dict(img_size=512, patch_size=16, class_token=True, global_pool="token", final_norm=False,
              pos_embed_grid_size=(128, 128), pos_embed_interp_mode="bilinear", pos_embed_ar_preserving=True,
              pos_embed_antialias=False)
for _name, _args in {
        "naflexvit_base_patch16_radio_v3": dict(**vit_size("base"), init_values=1e-5, reg_tokens=7,
                                                pos_embed_align_corners=True),
        "naflexvit_large_patch16_radio_v3": dict(**vit_size("large"), init_values=1e-5,
                                                 reg_tokens=7),
        "naflexvit_huge_patch16_radio_v3": dict(**vit_size("huge"), reg_tokens=7,
                                                pos_embed_align_corners=True),
        "naflexvit_giant_patch16_radio_v3": dict(**vit_size("giant2"), reg_tokens=7),
        "naflexvit_so400m_patch16_radio_v4": dict(**vit_size("so400m"), mlp_ratio=4304 / 1152,
                                                  reg_tokens=9),
        "naflexvit_huge_patch16_radio_v4": dict(**vit_size("huge"), reg_tokens=9)}.items():
    register(_name, NaFlexVit, CLIP_MEAN, CLIP_STD, **_RADIO, **_args)
# Perception Encoder (timm's names): CLIP's pre-norm ViT with a position table and axial RoPE counted from 1 in (x, y)
# order, rescaled to the weights' grid; Core reads out through an attention pool and its projection, Spatial and Lang
# the mean patch token without a final norm (timm's weights have no head: a folder's num_classes 0 is read as such);
# the gigantic sizes have no class token and no grid offset
for _kind, _sizes in PE_IMAGES.items():
    for _size, _img in _sizes.items():
        _patch, _dim, _depth, _heads, _ratio = PE_SIZES[_size]
        _big = _size == "gigantic"
        _readout = (dict(global_pool="map", attn_pool_num_heads=8, attn_pool_mlp_ratio=4.0, num_classes=PE_PROJ[_size])
                    if _kind == "core" else dict(global_pool="avg", use_post_transformer_norm=False, use_fc_norm=False))
        register(f"vit_pe_{_kind}_{_size}_patch{_patch}_{_img}", PerceptionEncoder, INCEPTION_MEAN, INCEPTION_STD,
                 img_size=_img, patch_size=_patch, embed_dim=_dim, depth=PE_LANG_DEPTH.get(_size, _depth)
                 if _kind == "lang" else _depth, num_heads=_heads, mlp_ratio=_ratio, attn_type="rope",
                 class_token=not _big, use_pre_transformer_norm=True, use_rot_pos_emb=True,
                 ref_feat_shape=(_img // _patch,) * 2, rope_grid_offset=0.0 if _big else 1.0, rope_grid_indexing="xy",
                 norm_eps=PE_NORM_EPS, **_readout,
                 **(dict(init_values=0.1) if _kind == "lang" or (_kind, _big) == ("spatial", True) else {}))
# LingBot-Vision (timm's names): DINOv3's layout with q and v biases and class-token pooling; the giant: SwiGLU
_LINGBOT = {**_DINOV3, "img_size": 224, "qkv_bias": True, "global_pool": "token"}
for _size, (_dim, _depth, _heads) in LINGBOT_SIZES.items():
    register(f"vit_{_size}_patch16_lingbot", Eva, **_LINGBOT, embed_dim=_dim, depth=_depth, num_heads=_heads)
register("vit_giant_patch16_lingbot", Eva, **{**_LINGBOT, "qkv_bias": False}, **vit_size("giant2"),
         mlp_ratio=4 * 2 / 3, swiglu_mlp=True, swiglu_align_to=8)
# Sapiens2 (timm's names): DINOv3's RoPE, class + 8 registers, RMSNorm, qk-norm, q/k/v biases, packed SwiGLU, LayerScale
# on attention only; grouped-query attention in all but the first and last 8 blocks; 1024x768 portraits, any size
for _size, (_dim, _depth, _heads, _kv) in SAPIENS2_SIZES.items():
    register(f"vit_{_size}_patch16_sapiens2", Eva, img_size=(1024, 768), patch_size=16, dynamic_img_size=True,
             embed_dim=_dim, depth=_depth, num_heads=_heads, num_kv_heads=sapiens2_kv_heads(_depth, _heads, _kv),
             attn_type="rope", qkv_fused=False, qkv_bias=True, qk_norm=True, global_pool="token", swiglu_mlp=True,
             mlp_ratio=4.0, init_values=1.0, attn_only_layer_scale=True, rope_type="dinov3", rope_temperature=100.0,
             rope_rotate_half=True, rope_rescale_coords=2.0, use_rot_pos_emb=True, use_abs_pos_emb=False,
             num_reg_tokens=8, use_fc_norm=False, norm_layer="rmsnorm")


def _register_vlm_tower(prefix: str, cls: type[nn.Module], sizes: dict[str, tuple], pool: str, **args: Any) -> None:
    """A VLM tower's three timm names: the classifier, the classifier over its projector's tokens (``_{pool}``), the
    encoder whose output is those tokens (``_enc``); sizes: width, depth, heads, MLP ratio, the projector's width."""
    for size, (dim, depth, heads, ratio, out) in sizes.items():
        size_args = dict(args, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=ratio)
        register(f"{prefix}_{size}", cls, INCEPTION_MEAN, INCEPTION_STD, **size_args)
        register(f"{prefix}_{size}_{pool}", cls, INCEPTION_MEAN, INCEPTION_STD, **size_args, encoder_pool=pool,
                 out_features=out)
        register(f"{prefix}_{size}_enc", cls, INCEPTION_MEAN, INCEPTION_STD, **size_args, encoder_pool=pool,
                 out_features=out, num_classes=0, global_pool="", final_norm=False, encoder_only=True)


# Qwen3-VL's vision tower (timm's names): the classifier, the classifier over the patch merger's tokens (_merge), the
# encoder whose output is the merger's tokens (_enc); 768-pixel inputs by default, any size whose grid splits in 2x2
_register_vlm_tower("qwen3_vit", Qwen3Vit, QWEN3_SIZES, "merge", img_size=768, patch_size=16)
# DeepSeek-V4's vision tower (timm's names): the classifier, the classifier over the aligner's tokens (_align), the
# encoder whose output is the aligner's tokens (_enc); 546-pixel inputs by default (39x39 patches of 14), any multiple
# of the patch (the aligner pads the grid to its 3x3 blocks); out_features: V4.1-Flash's width
_register_vlm_tower("deepseek_vit", DeepseekVit, DEEPSEEK_SIZES, "align", img_size=546, patch_size=14)
# Gemma 4's vision tower (timm's names): the classifier, and the encoder whose output is the VLM's soft tokens;
# pixels in [0, 1] as they are (the model maps them to [-1, 1] itself)
for _size, _args in GEMMA4_SIZES.items():
    register(f"gemma4_vit_{_size}", Gemma4Vit, (0.0,) * 3, (1.0,) * 3, img_size=768, patch_size=16, **_args)
    register(f"gemma4_vit_{_size}_enc", Gemma4Vit, (0.0,) * 3, (1.0,) * 3, img_size=768, patch_size=16, **_args,
             num_classes=0, global_pool="", encoder_pool="soft", final_norm=False, encoder_only=True)
# ConViT (embed_dim is per head)
for _name, _heads in (("tiny", 4), ("small", 9), ("base", 16)):
    register(f"convit_{_name}", ConVit, local_up_to_layer=10, locality_strength=1.0, embed_dim=48, num_heads=_heads)
# Hybrid: ResNet-18 stages to stride 16, then ViT-S/ViT-Ti
register("vit_small_r18_s16_224", HybridVisionTransformer, **vit_size("small"),
         backbone_layers=(2, 2, 2), backbone_widths=(64, 128, 256), backbone_stem="imagenet")
register("vit_tiny_r18_s16_224", HybridVisionTransformer, **vit_size("tiny"),
         backbone_layers=(2, 2, 2), backbone_widths=(64, 128, 256), backbone_stem="imagenet")
# The ViT paper's hybrids: a BiT ResNetV2 (stage depths) makes the tokens; timm's names
for _name, (_layers, _patch, _dim, _depth, _heads) in {
        "tiny_r_s16_p8": ((), 8, 192, 12, 3), "small_r26_s32": ((2, 2, 2, 2), 1, 384, 12, 6),
        "base_r26_s32": ((2, 2, 2, 2), 1, 768, 12, 12), "base_r50_s16": ((3, 4, 9), 1, 768, 12, 12),
        "large_r50_s32": ((3, 4, 6, 3), 1, 1024, 24, 16)}.items():
    for _img in (224, 384):
        if f"vit_{_name}_{_img}" in ResNetV2VisionTransformer.timm_names:
            register(f"vit_{_name}_{_img}", ResNetV2VisionTransformer, INCEPTION_MEAN, INCEPTION_STD, img_size=_img,
                     patch_size=_patch, embed_dim=_dim, depth=_depth, num_heads=_heads, backbone_layers=_layers)
# MLP-Mixer (timm's names): token-mixing MLPs in place of attention
for _size, (_dim, _blocks) in {"s": (512, 8), "b": (768, 12), "l": (1024, 24)}.items():
    for _patch in (16, 32):
        register(f"mixer_{_size}{_patch}_224", MlpMixer, INCEPTION_MEAN, INCEPTION_STD, patch_size=_patch,
                 num_blocks=_blocks, embed_dim=_dim)
# ResNets (teachers)
register("resnet18", ResNet, layers=(2, 2, 2, 2), stem="imagenet", img_size=224)
register("resnet34", ResNet, layers=(3, 4, 6, 3), stem="imagenet", img_size=224)

# CIFAR presets: 32x32 input, patch 4 (an 8x8 grid of 64 tokens)
_CIFAR = dict(img_size=32, num_classes=10)
register("vit_tiny_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=192, depth=9, num_heads=3)
register("vit_small_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=384, depth=9, num_heads=6)
register("vit_tiny_sincos_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=192, depth=9, num_heads=3, pos_embed="sincos")
register("vit_tiny_avg_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=192, depth=9, num_heads=3, class_token=False, global_pool="avg")
register("deit_tiny_distilled_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=192, depth=9, num_heads=3, distilled=True)
register("vit_nano_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=128, depth=4, num_heads=4)
register("deit_nano_distilled_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=128, depth=4, num_heads=4, distilled=True)
register("deit_small_distilled_patch4_32", VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=384, depth=9, num_heads=6, distilled=True)
register("convit_tiny_patch4_32", ConVit, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=48, depth=9, num_heads=4, local_up_to_layer=6, locality_strength=1.0)
register("convit_nano_patch4_32", ConVit, CIFAR_MEAN, CIFAR_STD, **_CIFAR,  # vit_nano's size: 4 x 32 = 128 wide
         patch_size=4, embed_dim=32, depth=4, num_heads=4, local_up_to_layer=3, locality_strength=1.0)
register("convit_small_patch4_32", ConVit, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=48, depth=9, num_heads=9, local_up_to_layer=6, locality_strength=1.0)
register("cait_xxs_patch4_32", Cait, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         patch_size=4, embed_dim=192, depth=8, num_heads=4, init_values=1e-5, depth_token_only=2)
register("vit_tiny_r18_32", HybridVisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         embed_dim=192, depth=7, num_heads=3, backbone_layers=(1, 1, 1), backbone_widths=(32, 64, 128),
         backbone_stem="cifar")
register("vit_nano_r18_32", HybridVisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         embed_dim=128, depth=4, num_heads=4, backbone_layers=(1, 1, 1), backbone_widths=(32, 64, 128),
         backbone_stem="cifar")
register("vit_nano_r5_s4_32", ResNetV2VisionTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,  # BiT stem + 1 block: 8x8
         embed_dim=128, depth=4, num_heads=4, patch_size=1, backbone_layers=(1,))
register("mixer_nano_patch4_32", MlpMixer, CIFAR_MEAN, CIFAR_STD, **_CIFAR, patch_size=4, num_blocks=4,
         embed_dim=128)  # vit_nano_patch4_32's grid and width, attention replaced by the token MLP
register("resnet18_32", ResNet, CIFAR_MEAN, CIFAR_STD, **_CIFAR, layers=(2, 2, 2, 2), stem="cifar")
register("resnet10_32", ResNet, CIFAR_MEAN, CIFAR_STD, **_CIFAR, layers=(1, 1, 1, 1), stem="cifar")
# The speed-run CNN (airbench) and the hybrid that tokenizes with its whitening stem and conv groups
register("airbench_32", AirBench, CIFAR_MEAN, CIFAR_STD, **_CIFAR, widths=(64, 256, 256))
register("vit_nano_airbench_32", AirBenchHybrid, CIFAR_MEAN, CIFAR_STD, **_CIFAR, stem_widths=(64, 256),
         embed_dim=128, depth=4, num_heads=4, class_token=False, global_pool="avg")
# CCT (the paper's names: depth / kernel x tokenizer layers): CIFAR from scratch, and ImageNet
register("cct_7_3x1_32", CompactTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, tokenizer_layers=1, tokenizer_kernel=3)
register("cct_7_3x2_32", CompactTransformer, CIFAR_MEAN, CIFAR_STD, **_CIFAR,
         embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, tokenizer_layers=2, tokenizer_kernel=3)
register("cct_14_7x2_224", CompactTransformer, embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0,
         tokenizer_layers=2, tokenizer_kernel=7, img_size=224)
# The embedded default (8x8 digits): patch 2, a 4x4 grid, average pooling (which learns faster here)
register("vit_micro_patch2_8", VisionTransformer, (0.5,), (0.5,), img_size=8, patch_size=2, in_chans=1,
         num_classes=10, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0, class_token=False, global_pool="avg")


# every class a registered name builds, by class name (config.json's "class")
MODEL_CLASSES: dict[str, type[Model]] = {spec.cls.__name__: spec.cls for spec in _REGISTRY.values()}


def model_class(name: str | None, source: str) -> type[Model]:
    """The model class a config names; an unknown name is an error naming ``source`` and the accepted ones."""
    if name not in MODEL_CLASSES:
        raise VitlabError(f"{source}: unknown model class {name!r}; accepted: {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[name]


def check_model(model: object, what: str) -> None:
    """TypeError unless ``model`` is an instance of a vitlab model class (``what`` names the caller)."""
    if type(model) not in MODEL_CLASSES.values():
        raise TypeError(f"{what} takes a vitlab model ({', '.join(MODEL_CLASSES)}), got {type(model).__name__}")


def list_models(pattern: str = "*") -> list[str]:
    """Registered names matching a shell-style pattern (``vit_*``, ``*cifar*``), sorted.

    Example::

        vitlab.list_models("vit_tiny*")               # ['vit_tiny_avg_patch4_32', 'vit_tiny_patch16_224', ...]
    """
    return matching(_REGISTRY, pattern)


def get_spec(name: str) -> ModelSpec:
    """The spec of a registered name; an unknown name's error lists the closest ones."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise VitlabError(f"unknown model {name!r}{hint} (`vitlab models` lists all {len(_REGISTRY)})")
    return _REGISTRY[name]


def accepted_args(cls: type[nn.Module]) -> list[str]:
    """The arguments a model class takes, with timm's names."""
    params = inspect.signature(cls.__init__).parameters
    names = [p for p in params if p not in ("self", "kwargs")]
    if "kwargs" in params:  # the rest go to the parent class, less those this class sets itself
        names += [p for p in accepted_args(cls.__mro__[1]) if p not in names and p not in cls.parent_args_fixed]
    return names


def arg_defaults(cls: type[nn.Module]) -> dict[str, Any]:
    """The default of every argument a model class takes (through the parents it passes ``**kwargs`` to)."""
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass is not Model and issubclass(klass, Model):
            for name, p in inspect.signature(klass.__init__).parameters.items():
                defaults.setdefault(name, p.default)
    return {name: defaults.get(name) for name in accepted_args(cls)}


def _number_problem(name: str, value: Any, kind: type, positive: bool) -> str | None:
    """Why ``value`` is not a valid number ``name`` of type ``kind`` (int, or float that takes an int too)."""
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return "an integer" if kind is int else "a number"
    if kind is float and not math.isfinite(value):
        return "a finite number"
    if name.endswith("_rate") and not 0 <= value < 1:
        return "a number in [0, 1)"
    if positive and value <= 0 or value < 0:
        return f"{'an integer' if kind is int else 'a number'} {'> 0' if positive else '>= 0'}"
    return None


def _arg_problem(cls: type[nn.Module], name: str, value: Any, default: Any) -> str | None:
    """What argument ``name`` accepts, when ``value`` is not that; the type is the default's (None: any)."""
    positive = name in getattr(cls, "positive_args", ())
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, (int, float)):
        if name in getattr(cls, "pair_args", ()) and isinstance(value, (list, tuple)):
            if len(value) != 2:
                return "an integer or a pair of them"
            return next((p + " or a pair of them" for v in value if (p := _number_problem(name, v, int, positive))),
                        None)
        return _number_problem(name, value, type(default), positive)
    if isinstance(default, str):
        return None if isinstance(value, str) else "text"
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or not (value or name in getattr(cls, "empty_args", ())):
            return "a list of numbers"
        kind = type(default[0]) if default else int
        if any(_number_problem(name, v, kind, positive) for v in value):
            return f"a list of {'integers' if kind is int else 'numbers'} {'> 0' if positive else '>= 0'}"
    return None


def check_args(cls: type[nn.Module], args: dict[str, Any]) -> None:
    """One line naming the first argument a model class does not take, or a value of the wrong kind or range."""
    accepted = arg_defaults(cls)
    unknown = [k for k in args if k not in accepted]
    if unknown:
        raise VitlabError(f"{cls.__name__} does not take {', '.join(map(repr, unknown))}; "
                          f"accepted: {', '.join(accepted)}")
    for name, value in args.items():
        problem = _arg_problem(cls, name, value, accepted[name])
        if problem:
            raise VitlabError(f"model argument {name}={value!r} is not valid for {cls.__name__}; accepted: {problem}")


def build(cls: type[nn.Module], args: dict[str, Any], given: dict[str, Any] | None = None) -> nn.Module:
    """cls(**args), with an error naming any argument the class does not take, or of the wrong kind or range, and
    one line naming the ``given`` ones (all by default) where arguments each valid do not build a model together."""
    check_args(cls, args)
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    try:
        return cls(**args)
    except ValueError:
        raise
    except (TypeError, ZeroDivisionError, RuntimeError, AssertionError, OverflowError, IndexError) as e:
        named = ", ".join(f"{k}={v!r}" for k, v in (args if given is None else given).items()) or "its defaults"
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VitlabError(f"{cls.__name__} cannot be built with {named} ({why})") from None


def create_model(name: str, **overrides: Any) -> nn.Module:
    """A new model by registered name, its defaults updated by overrides (timm's argument names); its weights are
    new (pretrained ones come from ``vitlab.load``).

    Example::

        model = vitlab.create_model("vit_tiny_patch4_32", num_classes=10, depth=6)
        result = vitlab.fit(model, ((x, y), (x_test, y_test)), epochs=5)   # trains model itself
    """
    if "pretrained" in overrides:
        raise VitlabError(f"create_model({name!r}, pretrained=...): vitlab's models start new; pretrained weights load "
                          f"with vitlab.load('hf-hub:timm/<name>'), a timm or Hugging Face folder, or a run folder")
    spec = get_spec(name)
    args = {**spec.args, **overrides}
    model = build(spec.cls, args, overrides)
    model.arch = name
    model.model_args = dict(overrides)
    model.pretrained_cfg = make_pretrained_cfg(model, args.get("in_chans", 3), spec.mean, spec.std)
    return model


def model_config(model: nn.Module) -> dict[str, Any]:
    """What rebuilds this model: class, registered name and arguments (used by vitlab.save)."""
    return {"architecture": getattr(model, "arch", None), "class": type(model).__name__,
            "model_args": getattr(model, "model_args", {})}
