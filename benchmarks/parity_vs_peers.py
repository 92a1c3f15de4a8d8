"""Parity of vitlab with timm and Hugging Face transformers on many small, randomly initialised configurations.

Each case builds a model in the peer library with the peer's own init plus Gaussian noise (std 0.02, or 0.1 where
0.02 would hide a difference below the tolerance) on every parameter, so that every parameter matters (LayerScale
gammas, ConViT gates, talking-heads mixing, ...). It
writes the model in the peer's Hub format (timm ``save_for_hf``, transformers ``save_pretrained``) to a
temporary folder, loads that folder with ``vitlab.load`` and compares eval-mode outputs on one random batch,
float32 on the CPU: the logits always; ``forward_features`` (the token sequence after the final norm) for timm
models and for transformers (against ``last_hidden_state``); both heads for distilled DeiT.

Cases that load with ``vitlab.load(folder, img_size=...)`` are compared with what timm does when a checkpoint
is fine-tuned at another resolution: ``timm.create_model(arch, img_size=NEW, **args)`` and ``load_state_dict``
after timm's own ``resample_abs_pos_embed`` (``checkpoint_filter_fn`` in timm/models/vision_transformer.py).

The tiny fixtures under tests/fixtures/parity/ (benchmarks/make_parity_fixtures.py) are checked too, at both of
their input sizes, as the rows ``fixture NAME``.

Run with the reference environment (timm, transformers), from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/parity_vs_peers.py [SUBSTRING ...]

Prints one row per case and exits with status 1 if any case differs by more than 1e-4 or fails to load.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
import transformers
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed
from timm.models import save_for_hf
from torch import Tensor, nn

import vitlab

TOL = 1e-4
NOISE_STD = 0.02
STRONG_NOISE = 0.1  # where 0.02 leaves a difference the 1e-4 tolerance cannot see
BATCH = 2

Pairs = dict[str, tuple[Tensor, Tensor]]  # output name -> (peer's, vitlab's)


def perturb(model: nn.Module, std: float = NOISE_STD) -> nn.Module:
    """Add N(0, std) noise to every parameter; eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * std)
    return model.eval()


def image_batch(in_chans: int, size: tuple[int, int]) -> Tensor:
    return torch.randn(BATCH, in_chans, *size)


def pair(x: Any) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (list, tuple)) else (int(x), int(x))


# ---------------------------------------------------------------------------------------------
# timm


@dataclass
class TimmCase:
    name: str
    arch: str
    args: dict[str, Any]
    input_size: tuple[int, int] | None = None  # another input size than built for (dynamic_img_size)
    load: dict[str, Any] = field(default_factory=dict)  # overrides given to vitlab.load
    noise: float = NOISE_STD
    peer: str = "timm"

    def run(self, folder: str) -> Pairs:
        ref = perturb(timm.create_model(self.arch, pretrained=False, **self.args), self.noise)
        save_for_hf(ref, folder, model_args=self.args, safe_serialization=True)
        ours = vitlab.load(folder, **self.load)
        if self.load:
            ref = self.timm_with_overrides(ref)
        size = self.input_size or tuple(getattr(ref, "patch_embed", getattr(ref, "stem", None)).img_size)
        x = image_batch(self.args.get("in_chans", 3), size)
        with torch.no_grad():
            f_ref, f_ours = ref.forward_features(x), ours.forward_features(x)
            pairs = {"logits": (ref(x), ours(x)), "features": (f_ref, f_ours)}
            if getattr(ref, "dist_token", None) is not None:
                pairs["logits_cls"] = (ref.head(f_ref[:, 0]), ours.head(f_ours[:, 0]))
                pairs["logits_dist"] = (ref.head_dist(f_ref[:, 1]), ours.head_dist(f_ours[:, 1]))
        return pairs

    def timm_with_overrides(self, ref: nn.Module) -> nn.Module:
        """timm's model built with the same overrides, the checkpoint's position embedding resampled as timm does."""
        new = timm.create_model(self.arch, pretrained=False, **{**self.args, **self.load}).eval()
        state = ref.state_dict()
        old_grid, new_grid = ref.patch_embed.grid_size, new.patch_embed.grid_size
        if "pos_embed" in state and tuple(old_grid) != tuple(new_grid):
            prefix = state["pos_embed"].shape[1] - old_grid[0] * old_grid[1]
            state["pos_embed"] = resample_abs_pos_embed(state["pos_embed"], new_size=new_grid, old_size=old_grid,
                                                        num_prefix_tokens=prefix)
        new.load_state_dict(state, strict=True)
        return new


VIT, DEIT, CAIT, CONVIT = "vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224", "cait_xxs24_224", "convit_tiny"
SMALL = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5)
CAIT_SMALL = dict(SMALL, depth_token_only=1)
CONVIT_SMALL = dict(img_size=32, patch_size=8, embed_dim=8, depth=4, num_heads=4, num_classes=5, local_up_to_layer=2)


def timm_cases() -> list[TimmCase]:
    v, d, c, g = SMALL, SMALL, CAIT_SMALL, CONVIT_SMALL
    return [
        TimmCase("vit", VIT, v),
        TimmCase("vit embed64 depth3 heads4", VIT, dict(v, embed_dim=64, depth=3, num_heads=4)),
        TimmCase("vit embed96 heads6", VIT, dict(v, embed_dim=96, num_heads=6)),
        TimmCase("vit patch4 img32", VIT, dict(v, patch_size=4)),
        TimmCase("vit patch8 img48", VIT, dict(v, img_size=48)),
        TimmCase("vit patch16 img64", VIT, dict(v, img_size=64, patch_size=16)),
        TimmCase("vit img(32,48)", VIT, dict(v, img_size=(32, 48))),
        TimmCase("vit in_chans=1", VIT, dict(v, in_chans=1)),
        TimmCase("vit qkv_bias=False", VIT, dict(v, qkv_bias=False)),
        TimmCase("vit no class token, avg", VIT, dict(v, class_token=False, global_pool="avg")),
        TimmCase("vit class token, avg", VIT, dict(v, global_pool="avg")),
        TimmCase("vit avg fc_norm=False", VIT, dict(v, global_pool="avg", fc_norm=False)),
        TimmCase("vit init_values=1e-5", VIT, dict(v, init_values=1e-5)),
        TimmCase("vit init_values=1e-5 noise=0.1", VIT, dict(v, init_values=1e-5), noise=STRONG_NOISE),
        TimmCase("vit no_embed_class", VIT, dict(v, no_embed_class=True)),
        TimmCase("vit reg_tokens=2", VIT, dict(v, reg_tokens=2)),
        TimmCase("vit reg_tokens=4 no_embed_class", VIT, dict(v, reg_tokens=4, no_embed_class=True)),
        TimmCase("vit reg_tokens=2 no class token avg", VIT,
                 dict(v, reg_tokens=2, class_token=False, global_pool="avg")),
        TimmCase("vit mlp_ratio=2.5", VIT, dict(v, mlp_ratio=2.5)),
        TimmCase("vit num_classes=0", VIT, dict(v, num_classes=0)),
        TimmCase("vit pos_embed=none", VIT, dict(v, pos_embed="none")),
        TimmCase("vit dynamic 32 -> 48x40", VIT, dict(v, dynamic_img_size=True), input_size=(48, 40)),
        TimmCase("vit dynamic (32,48) -> 40x24", VIT, dict(v, img_size=(32, 48), dynamic_img_size=True),
                 input_size=(40, 24)),
        TimmCase("vit dynamic reg4 no_embed_class -> 24x40", VIT,
                 dict(v, dynamic_img_size=True, reg_tokens=4, no_embed_class=True), input_size=(24, 40)),
        TimmCase("vit load dynamic_img_size=True -> 40x48", VIT, v, input_size=(40, 48),
                 load=dict(dynamic_img_size=True)),
        TimmCase("vit load img_size=48", VIT, v, load=dict(img_size=48)),
        TimmCase("vit load img_size=(48,32)", VIT, v, load=dict(img_size=(48, 32))),
        TimmCase("vit (32,48) load img_size=64", VIT, dict(v, img_size=(32, 48)), load=dict(img_size=64)),
        TimmCase("vit avg no class load img_size=48", VIT, dict(v, class_token=False, global_pool="avg"),
                 load=dict(img_size=48)),
        TimmCase("deit", DEIT, d),
        TimmCase("deit embed64 depth3 heads4 patch4", DEIT, dict(d, embed_dim=64, depth=3, num_heads=4, patch_size=4)),
        TimmCase("deit img(32,48)", DEIT, dict(d, img_size=(32, 48))),
        TimmCase("deit init_values=1e-5", DEIT, dict(d, init_values=1e-5)),
        TimmCase("deit qkv_bias=False in_chans=1", DEIT, dict(d, qkv_bias=False, in_chans=1)),
        TimmCase("deit dynamic 32 -> 48x40", DEIT, dict(d, dynamic_img_size=True), input_size=(48, 40)),
        TimmCase("deit dynamic (32,48) -> 40x24", DEIT, dict(d, img_size=(32, 48), dynamic_img_size=True),
                 input_size=(40, 24)),
        TimmCase("deit dynamic 32 -> 40x48 noise=0.1", DEIT, dict(d, dynamic_img_size=True), input_size=(40, 48),
                 noise=STRONG_NOISE),
        TimmCase("deit load img_size=48", DEIT, d, load=dict(img_size=48)),
        # CaiT's small LayerScale and near-uniform attention hide its talking-heads mixing (proj_l, proj_w) and
        # norm1 below 1e-4 under 0.02 noise, so its cases use STRONG_NOISE; one keeps the default.
        TimmCase("cait noise=0.02", CAIT, c),
        TimmCase("cait depth_token_only=1", CAIT, c, noise=STRONG_NOISE),
        TimmCase("cait depth_token_only=2", CAIT, dict(c, depth_token_only=2), noise=STRONG_NOISE),
        TimmCase("cait heads6", CAIT, dict(c, num_heads=6), noise=STRONG_NOISE),
        TimmCase("cait embed64 heads4", CAIT, dict(c, embed_dim=64, num_heads=4), noise=STRONG_NOISE),
        TimmCase("cait qkv_bias=False", CAIT, dict(c, qkv_bias=False), noise=STRONG_NOISE),
        TimmCase("cait init_values=1", CAIT, dict(c, init_values=1.0), noise=STRONG_NOISE),
        TimmCase("cait mlp_ratio=3 token_only=2", CAIT, dict(c, mlp_ratio=3.0, mlp_ratio_token_only=2.0),
                 noise=STRONG_NOISE),
        TimmCase("cait patch4 img32", CAIT, dict(c, patch_size=4), noise=STRONG_NOISE),
        TimmCase("cait img(32,48)", CAIT, dict(c, img_size=(32, 48)), noise=STRONG_NOISE),
        TimmCase("cait load img_size=48", CAIT, c, load=dict(img_size=48), noise=STRONG_NOISE),
        TimmCase("convit heads4", CONVIT, g),
        TimmCase("convit heads9", CONVIT, dict(g, num_heads=9)),
        TimmCase("convit heads9 noise=0.1", CONVIT, dict(g, num_heads=9), noise=STRONG_NOISE),
        TimmCase("convit heads16", CONVIT, dict(g, num_heads=16, embed_dim=4)),
        TimmCase("convit local_up_to_layer=0", CONVIT, dict(g, local_up_to_layer=0)),
        TimmCase("convit local_up_to_layer=1", CONVIT, dict(g, local_up_to_layer=1)),
        TimmCase("convit local_up_to_layer=3 (all but one)", CONVIT, dict(g, local_up_to_layer=3)),
        # every block GPSA: timm (like the original ConViT code) then never inserts the class token
        TimmCase("convit local_up_to_layer=depth (all GPSA)", CONVIT, dict(g, local_up_to_layer=4)),
        TimmCase("convit locality_strength=2", CONVIT, dict(g, locality_strength=2.0)),
        TimmCase("convit qkv_bias=True", CONVIT, dict(g, qkv_bias=True)),
        TimmCase("convit patch4 img32", CONVIT, dict(g, patch_size=4)),
        TimmCase("convit avg", CONVIT, dict(g, global_pool="avg")),
        TimmCase("convit load img_size=48", CONVIT, g, load=dict(img_size=48)),
        *backbone_cases(),
        *beit_cases(),
        *family_cases(),
        *eva_cases(),
    ]


def backbone_cases() -> list[TimmCase]:
    """Today's backbones by timm name (DeiT III, DINOv2, registers, GAP, CLIP, SigLIP) and the ViT options."""
    v = dict(SMALL, num_classes=5)
    cases = []
    for arch in ("deit3_small_patch16_224", "vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2",
                 "vit_betwixt_patch16_reg4_gap_256", "vit_base_patch16_reg4_gap_256", "vit_medium_patch16_gap_256",
                 "vit_base_patch16_gap_224", "vit_base_patch16_clip_224", "vit_base_patch16_clip_quickgelu_224",
                 "vit_base_patch16_siglip_224", "vit_base_patch32_siglip_256", "vit_base_patch16_siglip_gap_224"):
        heads = 4 if arch == "vit_base_patch16_gap_224" else 3  # its 16 heads: 48 / 4 per head at this width
        cases.append(TimmCase(arch, arch, dict(v, num_heads=heads)))
        cases.append(TimmCase(f"{arch} dynamic -> 48x40", arch, dict(v, num_heads=heads, dynamic_img_size=True),
                              input_size=(48, 40)))
    cases.append(TimmCase("vit_small_patch14_dinov2 num_classes=0", "vit_small_patch14_dinov2",
                          dict(v, num_classes=0)))
    for label, options in (("qk_norm", dict(qk_norm=True)), ("proj_bias=False", dict(proj_bias=False)),
                           ("pre_norm", dict(pre_norm=True)), ("final_norm=False", dict(final_norm=False)),
                           ("final_norm=False avg", dict(final_norm=False, global_pool="avg")),
                           ("fc_norm=True token", dict(fc_norm=True)), ("global_pool=map", dict(global_pool="map")),
                           ("map no class token", dict(global_pool="map", class_token=False)),
                           ("act swish", dict(act_layer="swish")), ("act quick_gelu", dict(act_layer="quick_gelu")),
                           ("qk_norm map reg_tokens=2", dict(qk_norm=True, global_pool="map", reg_tokens=2))):
        cases.append(TimmCase(f"vit {label}", VIT, dict(v, **options)))
    return cases


def beit_cases() -> list[TimmCase]:
    """BEiT, BEiT v2 (relative position bias per block or shared, LayerScale, mean pooling with fc_norm)."""
    b = dict(SMALL, num_classes=5)
    return [
        TimmCase("beit_base_patch16_224", "beit_base_patch16_224", b),
        TimmCase("beitv2_base_patch16_224", "beitv2_base_patch16_224", b, noise=STRONG_NOISE),
        TimmCase("beit token pooling", "beit_base_patch16_224", dict(b, global_pool="token")),
        TimmCase("beit avg without fc_norm", "beit_base_patch16_224", dict(b, use_fc_norm=False)),
        TimmCase("beit shared bias + abs pos", "beit_base_patch16_224",
                 dict(b, use_abs_pos_emb=True, use_rel_pos_bias=False, use_shared_rel_pos_bias=True)),
        TimmCase("beit shared + own bias", "beit_base_patch16_224", dict(b, use_shared_rel_pos_bias=True)),
        TimmCase("beit qkv_bias=False no LayerScale", "beit_base_patch16_224", dict(b, qkv_bias=False,
                                                                                     init_values=0.0)),
        TimmCase("beit img(32,48) patch8", "beit_base_patch16_224", dict(b, img_size=(32, 48))),
        TimmCase("beit num_classes=0", "beit_base_patch16_224", dict(b, num_classes=0)),
    ]


def family_cases() -> list[TimmCase]:
    """The ViT paper's ResNetV2 hybrids (stem only, R26, R50 at stride 16 and 32), at their size and another;
    MLP-Mixer at its own size (the token MLP fixes it)."""
    h = dict(embed_dim=48, depth=2, num_heads=3, num_classes=5)
    cases = []
    r_ti = "vit_tiny_r_s16_p8_224"
    for name, arch, args in ((r_ti, r_ti, dict(h, img_size=64)),
                             (f"{r_ti} patch2", r_ti, dict(h, img_size=32, patch_size=2)),
                             *((a, a, dict(h, img_size=48 if "384" in a else 64))
                               for a in ("vit_small_r26_s32_224", "vit_base_r50_s16_384", "vit_large_r50_s32_224"))):
        cases.append(TimmCase(name, arch, args))
        cases.append(TimmCase(f"{name} dynamic -> 80x56", arch, dict(args, dynamic_img_size=True), input_size=(80, 56)))
    cases.append(TimmCase("vit_small_r26_s32_224 load img_size=96", "vit_small_r26_s32_224", dict(h, img_size=64),
                          load=dict(img_size=96)))
    # MLP-Mixer: timm's names fix width and depth; the input size, the MLP ratios and the head are free
    for arch, args in (("mixer_s16_224", dict(img_size=64, mlp_ratio=(0.5, 0.5), num_classes=5)),
                       ("mixer_b32_224", dict(img_size=96, mlp_ratio=(1.0, 0.25), num_classes=0)),
                       ("mixer_s32_224", dict(img_size=224, num_classes=7, stem_norm=True))):
        cases.append(TimmCase(f"{arch} {args['img_size']}", arch, args))
    # plain-ViT names vitlab gained from the name walk (models/vit_presets.py), small, with their own options
    v = dict(SMALL, num_heads=3)
    for arch in ("flexivit_small", "eva_large_patch14_196", "vit_base_patch16_224_miil",
                 "vit_so150m2_patch16_reg1_gap_256", "vit_huge_patch14_clip_336", "vit_base_patch16_radio_v3",
                 "vit_base_patch14_reg1_tipsv2",
                 "deit_base_distilled_patch16_384"):
        cases.append(TimmCase(arch, arch, dict(v, mlp_ratio=34 / 13) if "so150m2" in arch else v))
    return cases


def eva_cases() -> list[TimmCase]:
    """EVA02 (axial RoPE, SwiGLU, sub-LayerNorm) and the RoPE ViTs (axial, mixed, with an absolute embedding)."""
    e = dict(SMALL, num_classes=5)
    cases = []
    for arch in ("eva02_tiny_patch14_224", "eva02_base_patch14_224", "vit_small_patch16_rope_224",
                 "vit_base_patch16_rope_224", "vit_small_patch16_rope_ape_224", "vit_small_patch16_rope_mixed_224",
                 "vit_small_patch16_rope_mixed_ape_224", "vit_medium_patch16_rope_reg1_gap_256",
                 "vit_mediumd_patch16_rope_reg1_gap_256", "vit_betwixt_patch16_rope_reg4_gap_256"):
        cases.append(TimmCase(arch, arch, e))
        cases.append(TimmCase(f"{arch} dynamic -> 48x40", arch, dict(e, dynamic_img_size=True), input_size=(48, 40)))
    return cases + [
        TimmCase("eva02 scale_attn_inner", "eva02_base_patch14_224", dict(e, scale_attn_inner=True)),
        TimmCase("eva02 token pooling", "eva02_tiny_patch14_224", dict(e, global_pool="token")),
        TimmCase("eva02 no rope, abs pos", "eva02_tiny_patch14_224", dict(e, use_rot_pos_emb=False)),
        TimmCase("eva02 img(32,48) ref(4,6)", "eva02_tiny_patch14_224", dict(e, img_size=(32, 48),
                                                                             ref_feat_shape=(4, 6))),
        TimmCase("eva qkv_bias=False qk_norm", "eva02_tiny_patch14_224", dict(e, qkv_bias=False, qk_norm=True)),
        TimmCase("rope init_values=0.5 pre-norm", "vit_small_patch16_rope_224",
                 dict(e, init_values=0.5, use_pre_transformer_norm=True)),
        TimmCase("rope grid offset 0.5 ij", "vit_small_patch16_rope_224",
                 dict(e, rope_grid_offset=0.5, rope_grid_indexing="ij")),
        TimmCase("eva02 load img_size=48", "eva02_tiny_patch14_224", e, load=dict(img_size=48)),
        TimmCase("eva_giant_patch14_224", "eva_giant_patch14_224", dict(e, mlp_ratio=4.0)),
        TimmCase("rope mixed ape load img_size=(48,40)", "vit_small_patch16_rope_mixed_ape_224", e,
                 load=dict(img_size=(48, 40))),
    ]


# ---------------------------------------------------------------------------------------------
# transformers


@dataclass
class HfCase:
    name: str
    cls: str  # a transformers class name
    config: dict[str, Any]
    noise: float = NOISE_STD
    peer: str = "transformers"

    def build(self, folder: str) -> tuple[nn.Module, nn.Module, Tensor]:
        """The peer's model (perturbed, saved to folder), vitlab's load of that folder, and an input batch."""
        config = getattr(transformers, CONFIGS[self.cls])(**self.config)
        ref = perturb(getattr(transformers, self.cls)(config), self.noise)
        ref.save_pretrained(folder)
        return ref, vitlab.load(folder), image_batch(config.num_channels, pair(config.image_size))

    def run(self, folder: str) -> Pairs:
        ref, ours, x = self.build(folder)
        with torch.no_grad():
            out = ref(pixel_values=x)
            f_ours = ours.forward_features(x)
            if self.cls.startswith(("Dinov2", "Beit", "Data2Vec")) and self.cls.endswith("ForImageClassification"):
                return {"logits": (out.logits, ours(x)),
                        "features": (ref.base_model(pixel_values=x).last_hidden_state, f_ours)}
            if self.cls == "Data2VecVisionModel":  # no pooler by default: the tokens only
                return {"features": (out.last_hidden_state, f_ours)}
            if not self.cls.startswith(("ViT", "DeiT")):  # DINOv2, CLIP, SigLIP: the pooled output (or projection)
                logits = out.image_embeds if self.cls.endswith("WithProjection") else out.pooler_output
                return {"logits": (logits, ours(x)), "features": (out.last_hidden_state, f_ours)}
            if self.cls.endswith("Model"):  # no head: the encoder's output
                return {"features": (out.last_hidden_state, f_ours)}
            base = ref.vit if self.cls.startswith("ViT") else ref.deit
            pairs = {"logits": (out.logits, ours(x)), "features": (base(pixel_values=x).last_hidden_state, f_ours)}
            if self.cls.endswith("WithTeacher"):
                pairs["logits_cls"] = (out.cls_logits, ours.head(f_ours[:, 0]))
                pairs["logits_dist"] = (out.distillation_logits, ours.head_dist(f_ours[:, 1]))
        return pairs


CONFIGS = {"ViTForImageClassification": "ViTConfig", "ViTModel": "ViTConfig", "DeiTModel": "DeiTConfig",
           "DeiTForImageClassification": "DeiTConfig", "DeiTForImageClassificationWithTeacher": "DeiTConfig",
           "Dinov2Model": "Dinov2Config", "Dinov2WithRegistersModel": "Dinov2WithRegistersConfig",
           "Dinov2ForImageClassification": "Dinov2Config",
           "Dinov2WithRegistersForImageClassification": "Dinov2WithRegistersConfig",
           "CLIPVisionModel": "CLIPVisionConfig", "CLIPVisionModelWithProjection": "CLIPVisionConfig",
           "SiglipVisionModel": "SiglipVisionConfig", "BeitModel": "BeitConfig",
           "BeitForImageClassification": "BeitConfig", "Data2VecVisionModel": "Data2VecVisionConfig",
           "Data2VecVisionForImageClassification": "Data2VecVisionConfig"}
HF_BACKBONE = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, image_size=32, patch_size=8)
HF_SMALL = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
                image_size=32, patch_size=8, num_labels=5)
HF_VARIANTS = {
    "": {},
    "hidden64 heads4 layers3": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=256),
    "qkv_bias=False": dict(qkv_bias=False),
    "gelu_new": dict(hidden_act="gelu_new"),
    "relu": dict(hidden_act="relu"),
    "layer_norm_eps=1e-6": dict(layer_norm_eps=1e-6),
    "intermediate=100": dict(intermediate_size=100),
    "num_channels=1": dict(num_channels=1),
    "image48 patch16": dict(image_size=48, patch_size=16),
    "image[32,48]": dict(image_size=[32, 48]),
}


def hf_cases() -> list[HfCase]:
    cases = []
    for cls, short in (("ViTForImageClassification", "hf vit"), ("DeiTForImageClassificationWithTeacher", "hf deit")):
        for label, variant in HF_VARIANTS.items():
            # exact GELU in place of its tanh approximation differs by < 1e-4 under 0.02 noise
            noise = STRONG_NOISE if variant.get("hidden_act") == "gelu_new" else NOISE_STD
            cases.append(HfCase(f"{short} {label}".strip(), cls, dict(HF_SMALL, **variant), noise))
    return cases + [
        HfCase("hf vit gelu_fast", "ViTForImageClassification", dict(HF_SMALL, hidden_act="gelu_fast"), STRONG_NOISE),
        HfCase("hf vit quick_gelu", "ViTForImageClassification", dict(HF_SMALL, hidden_act="quick_gelu")),
        HfCase("hf vit image32 patch4", "ViTForImageClassification", dict(HF_SMALL, patch_size=4)),
        HfCase("hf vit patch_size=[8,8]", "ViTForImageClassification", dict(HF_SMALL, patch_size=[8, 8])),
        HfCase("hf vit dropout=0.1 (eval)", "ViTForImageClassification",
               dict(HF_SMALL, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
        HfCase("hf deit no teacher", "DeiTForImageClassification", HF_SMALL),
        HfCase("hf deit no teacher gelu_new", "DeiTForImageClassification", dict(HF_SMALL, hidden_act="gelu_new"),
               STRONG_NOISE),
        HfCase("hf ViTModel", "ViTModel", HF_SMALL),
        HfCase("hf ViTModel hidden64 heads4", "ViTModel", dict(HF_SMALL, **HF_VARIANTS["hidden64 heads4 layers3"])),
        HfCase("hf DeiTModel", "DeiTModel", HF_SMALL),
        HfCase("hf Dinov2Model", "Dinov2Model", HF_BACKBONE),
        HfCase("hf Dinov2Model layerscale=0.1 gelu_python", "Dinov2Model",
               dict(HF_BACKBONE, layerscale_value=0.1, hidden_act="gelu_python")),
        HfCase("hf Dinov2WithRegistersModel", "Dinov2WithRegistersModel", dict(HF_BACKBONE, num_register_tokens=4)),
        HfCase("hf Dinov2ForImageClassification", "Dinov2ForImageClassification", dict(HF_BACKBONE, num_labels=5)),
        HfCase("hf Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersForImageClassification",
               dict(HF_BACKBONE, num_register_tokens=2, num_labels=5)),
        HfCase("hf CLIPVisionModel", "CLIPVisionModel", dict(HF_BACKBONE, intermediate_size=96)),
        HfCase("hf CLIPVisionModel gelu", "CLIPVisionModel", dict(HF_BACKBONE, intermediate_size=96,
                                                                   hidden_act="gelu")),
        HfCase("hf CLIPVisionModelWithProjection", "CLIPVisionModelWithProjection",
               dict(HF_BACKBONE, intermediate_size=96, projection_dim=24)),
        HfCase("hf SiglipVisionModel", "SiglipVisionModel", dict(HF_BACKBONE, intermediate_size=96)),
        *hf_beit_cases(),
    ]


def hf_beit_cases() -> list[HfCase]:
    """transformers' BEiT and data2vec-vision: own or shared relative bias, absolute positions, both poolings."""
    b = dict(HF_SMALL, use_relative_position_bias=True)
    return [
        HfCase("hf BeitForImageClassification", "BeitForImageClassification", b),
        HfCase("hf BeitForImageClassification cls pooling", "BeitForImageClassification",
               dict(b, use_mean_pooling=False)),
        HfCase("hf BeitForImageClassification shared + abs", "BeitForImageClassification",
               dict(HF_SMALL, use_shared_relative_position_bias=True, use_absolute_position_embeddings=True)),
        HfCase("hf BeitForImageClassification no LayerScale", "BeitForImageClassification",
               dict(b, layer_scale_init_value=0.0)),
        HfCase("hf BeitModel", "BeitModel", b),
        HfCase("hf Data2VecVisionForImageClassification", "Data2VecVisionForImageClassification", b),
        HfCase("hf Data2VecVisionModel", "Data2VecVisionModel", b),
    ]


FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "parity"


@dataclass
class FixtureCase:
    """A stored folder of tests/fixtures/parity: the peer's outputs at its own size, and at a second one."""

    name: str
    folder: Path

    @property
    def peer(self) -> str:
        return "timm" if self.folder.name.startswith("timm") else "transformers"

    def run(self, _: str) -> Pairs:
        pairs = {}
        for io_name, load in (("io.safetensors", {}), ("io_dynamic.safetensors", {"dynamic_img_size": True})):
            if (self.folder / io_name).is_file():
                io = load_file(self.folder / io_name)
                ours = vitlab.load(self.folder, **load)
                with torch.no_grad():
                    f = ours.forward_features(io["input"])
                    tag = "" if not load else f" {'x'.join(map(str, io['input'].shape[-2:]))}"
                    pairs[f"logits{tag}"] = (io["logits"], ours.forward_head(f))
                    pairs[f"features{tag}"] = (io["features"], f)
        return pairs


def fixture_cases() -> list[FixtureCase]:
    return [FixtureCase(f"fixture {p.name}", p) for p in sorted(FIXTURES.iterdir()) if (p / "io.safetensors").is_file()]


# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    case: TimmCase | HfCase | FixtureCase
    diffs: dict[str, float]
    error: str | None = None

    @property
    def max_diff(self) -> float:
        return max(self.diffs.values(), default=float("nan"))

    @property
    def ok(self) -> bool:
        return self.error is None and self.max_diff <= TOL


def run_case(case: TimmCase | HfCase | FixtureCase, seed: int) -> Result:
    torch.manual_seed(seed)
    try:
        with tempfile.TemporaryDirectory() as folder:
            pairs = case.run(folder)
    except Exception as e:  # noqa: BLE001 - a case that cannot load or run is reported, not fatal
        return Result(case, {}, f"{type(e).__name__}: {e}")
    diffs, shapes = {}, []
    for name, (ref, ours) in pairs.items():
        if ref.shape == ours.shape:
            diffs[name] = (ref.float() - ours.float()).abs().max().item()
        else:
            shapes.append(f"{name} shape {tuple(ours.shape)}, peer {tuple(ref.shape)}")
    return Result(case, diffs, "; ".join(shapes) or None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run only the cases whose name contains one of these")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's "Writing model shards"
    logging.getLogger("timm").setLevel(logging.ERROR)  # "Pretrained mean does not match 1 channels"
    cases: list[TimmCase | HfCase | FixtureCase] = [*timm_cases(), *hf_cases(), *fixture_cases()]
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only)]
    print(f"vitlab {vitlab.__version__} vs timm {timm.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}; tolerance {TOL:g}\n")
    width = max(len(c.name) for c in cases)
    print(f"{'case':<{width}}  {'peer':<12}  {'max |diff|':>10}  pass  worst output / error")
    t0, results = time.perf_counter(), []
    for seed, case in enumerate(cases):
        r = run_case(case, seed)
        results.append(r)
        worst = r.error or max(r.diffs, key=r.diffs.get)
        print(f"{case.name:<{width}}  {case.peer:<12}  {r.max_diff:>10.2e}  {'yes' if r.ok else 'NO':<4}  {worst}",
              flush=True)
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} cases pass ({time.perf_counter() - t0:.0f} s)")
    for r in failed:
        detail = r.error or ", ".join(f"{k} {v:.2e}" for k, v in r.diffs.items())
        print(f"  FAIL {r.case.name}: {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
