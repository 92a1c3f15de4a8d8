"""Write tests/fixtures/parity/: tiny random-weight backbones in timm's and transformers' own folder layouts.

Each folder is written by the peer library itself (timm ``save_for_hf``, transformers ``save_pretrained``),
read back by that library to check it, and holds ``io.safetensors``: ``input`` (B, C, H, W) and the peer's
eval-mode outputs, ``logits`` and ``features`` (the token sequence ``forward_features`` returns). Where the
model takes other input sizes, ``io_dynamic.safetensors`` holds the same at a second size: timm models
built with ``dynamic_img_size=True`` (vitlab loads them with ``dynamic_img_size=True``), DINOv2 in
transformers (which always interpolates its position table) and DINOv3 in transformers (RoPE, no table). Every
parameter gets Gaussian noise so that each one matters. The format is /work/shared/parity/README.md's.

Runs only in the reference environment, from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/make_parity_fixtures.py
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
import transformers
from safetensors.torch import load_file, save_file
from timm.models import save_for_hf
from torch import nn

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "parity"
NOISE = 0.1
BATCH = 2
TINY = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)

GEMMA4_TINY = dict(img_size=12, patch_size=2, embed_dim=16, depth=2, num_heads=2, head_dim=8, intermediate_size=24,
                   position_embedding_size=12)
# name -> (timm architecture, model_args, second input size or None)
TIMM = {
    "timm_deit3": ("deit3_small_patch16_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_dinov2": ("vit_small_patch14_dinov2", dict(TINY, img_size=16, patch_size=4, num_classes=0), (24, 20)),
    "timm_dinov2_reg4": ("vit_small_patch14_reg4_dinov2", dict(TINY, img_size=16, patch_size=4, num_classes=0),
                         (20, 28)),
    "timm_vit_reg4_gap": ("vit_betwixt_patch16_reg4_gap_256", dict(TINY, img_size=16, patch_size=4, num_classes=5),
                          (24, 20)),
    "timm_vit_gap": ("vit_medium_patch16_gap_256", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_vit_qk_norm": ("vit_tiny_patch16_224", dict(TINY, img_size=16, patch_size=4, num_classes=5, qk_norm=True,
                                                      act_layer="swish"), (24, 20)),
    "timm_vit_no_final_norm": ("vit_tiny_patch16_224", dict(TINY, img_size=16, patch_size=4, num_classes=5,
                                                            final_norm=False, proj_bias=False), (24, 20)),
    "timm_vit_fc_norm_token": ("vit_tiny_patch16_224", dict(TINY, img_size=16, patch_size=4, num_classes=5,
                                                                fc_norm=True), (24, 20)),
    "timm_clip": ("vit_base_patch16_clip_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_clip_quickgelu": ("vit_base_patch16_clip_quickgelu_224", dict(TINY, img_size=16, patch_size=4,
                                                                         num_classes=5), (24, 20)),
    "timm_siglip": ("vit_base_patch16_siglip_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_siglip_no_head": ("vit_base_patch16_siglip_224", dict(TINY, img_size=16, patch_size=4, num_classes=0),
                            None),
    "timm_beit": ("beit_base_patch16_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), None),
    "timm_beitv2_token": ("beitv2_base_patch16_224", dict(TINY, img_size=16, patch_size=4, num_classes=5,
                                                          global_pool="token"), None),
    "timm_beit_shared_abs": ("beit_base_patch16_224", dict(TINY, img_size=(16, 20), patch_size=4, num_classes=5,
                                                           use_abs_pos_emb=True, use_rel_pos_bias=False,
                                                           use_shared_rel_pos_bias=True), None),
    "timm_vit_r_s16_p8": ("vit_tiny_r_s16_p8_224", dict(TINY, img_size=32, patch_size=2, num_classes=5), (48, 40)),
    "timm_mixer": ("mixer_b16_224", dict(img_size=16, patch_size=4, num_blocks=2, embed_dim=16, num_classes=5,
                                         mlp_ratio=(0.5, 2.0)), None),  # the token MLP fixes the grid: one size
    "timm_eva02": ("eva02_tiny_patch14_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_eva02_subln": ("eva02_base_patch14_224", dict(TINY, img_size=16, patch_size=4, num_classes=5,
                                                        scale_attn_inner=True), (20, 28)),
    "timm_vit_rope_axial": ("vit_small_patch16_rope_224", dict(TINY, img_size=16, patch_size=4, num_classes=5),
                            (24, 20)),
    "timm_vit_rope_mixed_ape": ("vit_small_patch16_rope_mixed_ape_224", dict(TINY, img_size=16, patch_size=4,
                                                                              num_classes=5), (24, 20)),
    "timm_vit_rope_reg_gap": ("vit_medium_patch16_rope_reg1_gap_256", dict(TINY, img_size=16, patch_size=4,
                                                                            num_classes=5), (20, 24)),
    "timm_vit_parallel": ("vit_small_patch16_18x2_224", dict(TINY, img_size=16, patch_size=4, num_classes=5),
                          (24, 20)),
    "timm_vit_pwee": ("vit_pwee_patch16_reg1_gap_256", dict(TINY, img_size=16, patch_size=4, num_classes=5),
                      (24, 20)),
    "timm_vit_pwee_qk_norm": ("vit_pwee_patch16_reg1_gap_256", dict(TINY, img_size=16, patch_size=4, num_classes=5,
                                                                    qkv_bias=False, qk_norm=True), (24, 20)),
    # EVA-CLIP image towers: the sub-LayerNorm in attention and MLP, class-token pooling, the projection as the head
    "timm_eva02_clip": ("eva02_base_patch16_clip_224", dict(TINY, img_size=16, patch_size=4, num_classes=6), (24, 20)),
    "timm_eva_giant_clip": ("eva_giant_patch14_clip_224", dict(TINY, img_size=16, patch_size=4, num_classes=6), None),
    # DINOv3: RoPE on patch centres in [-1, 1], registers, LayerScale; SwiGLU rounded to 8 (plus), q and v biases
    "timm_dinov3": ("vit_small_patch16_dinov3", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_dinov3_plus_qkvb": ("vit_small_plus_patch16_dinov3_qkvb", dict(TINY, img_size=16, patch_size=4,
                                                                          num_classes=0, mlp_ratio=2.25), (20, 28)),
    "timm_dinov3_token": ("vit_base_patch16_dinov3", dict(TINY, img_size=(16, 20), patch_size=4, num_classes=5,
                                                          global_pool="token"), (28, 24)),
    # Perception Encoder: a position table and axial RoPE from 1 in (x, y) order, rescaled to the name's grid; Core's
    # attention pool (8 heads, over the class token too) and projection; Spatial and Lang without a final norm
    "timm_pe_core": ("vit_pe_core_tiny_patch16_384", dict(TINY, img_size=16, patch_size=4, num_classes=6), (24, 20)),
    "timm_pe_core_gigantic": ("vit_pe_core_gigantic_patch14_448", dict(TINY, img_size=16, patch_size=4,
                                                                       num_classes=6), (20, 28)),
    "timm_pe_spatial": ("vit_pe_spatial_small_patch16_512", dict(TINY, img_size=16, patch_size=4), (24, 20)),
    "timm_pe_lang": ("vit_pe_lang_large_patch14_448", dict(TINY, img_size=(16, 20), patch_size=4), (28, 24)),
    # RMSNorm everywhere with ViT-22B's fused parallel blocks and qk-norm (timm's _xp_ ViTs)
    "timm_vit_xp": ("vit_base_patch16_xp_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    # DINOv2's and TIPSv2's giants: the packed SwiGLU MLP (fc1 holds gate and value)
    "timm_dinov2_giant": ("vit_giant_patch14_dinov2", dict(TINY, img_size=16, patch_size=4, num_classes=5), (20, 28)),
    "timm_tipsv2_giant": ("vit_giant_patch14_reg1_tipsv2", dict(TINY, img_size=16, patch_size=4, num_classes=0),
                          (24, 20)),
    # EVA-CLIP-E: residual post-norm blocks, an absolute position table, no RoPE
    "timm_eva02_enormous": ("eva02_enormous_patch14_clip_224", dict(TINY, img_size=16, patch_size=4, num_classes=6),
                            (24, 20)),
    # LingBot: DINOv3's RoPE with q and v biases and class-token pooling; the giant's SwiGLU rounded up to 8
    "timm_lingbot": ("vit_small_patch16_lingbot", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    "timm_lingbot_giant": ("vit_giant_patch16_lingbot", dict(TINY, img_size=16, patch_size=4, num_classes=0,
                                                              mlp_ratio=4 * 2 / 3), (20, 28)),
    # Sapiens2: grouped-query attention in the middle block, qk-norm, RMSNorm, 8 registers, a portrait input
    "timm_sapiens2": ("vit_base_patch16_sapiens2", dict(TINY, depth=3, num_heads=4, num_kv_heads=(4, 2, 4),
                                                        img_size=(16, 12), patch_size=4, num_classes=5), (20, 28)),
    # AIMv2: RMSNorm on the patch tokens and everywhere else, split SwiGLU, no biases, mean pooling
    "timm_aimv2": ("aimv2_large_patch14_224", dict(TINY, img_size=16, patch_size=4, num_classes=5), (24, 20)),
    # Qwen3-VL's tower: a 4x4 table resampled to each grid and RoPE; the classifier, the classifier over the patch
    # merger's tokens, the encoder (the merger's tokens out); the merger splits grids of even sides
    "timm_qwen3": ("qwen3_vit_88m", dict(TINY, img_size=16, patch_size=4, num_classes=5, pos_embed_grid_size=4),
                   (24, 20)),
    "timm_qwen3_merge": ("qwen3_vit_88m_merge", dict(TINY, img_size=16, patch_size=4, num_classes=5,
                                                     pos_embed_grid_size=4, out_features=8), (16, 24)),
    "timm_qwen3_enc": ("qwen3_vit_88m_enc", dict(TINY, img_size=16, patch_size=4, pos_embed_grid_size=4,
                                                 out_features=8), (24, 16)),
    # Gemma 4's tower: a 6-long table per axis, sandwich blocks, clamped projections (167m) or standardised soft
    # tokens (570m); the soft-token pool splits grids into 3x3 cells
    "timm_gemma4": ("gemma4_vit_167m", dict(GEMMA4_TINY, num_classes=5), (24, 20)),
    "timm_gemma4_enc": ("gemma4_vit_570m_enc", dict(GEMMA4_TINY, num_kv_heads=1), (12, 24)),
    # DeepSeek-V4's tower: RMSNorm, bias-free packed SwiGLU, RoPE only; the classifier, the classifier over the
    # aligner's tokens, the encoder (the aligner's tokens out); the aligner pads the 4x7 and 5x7 grids to its 3x3
    # blocks, and the encoder pads 18x26 images to its 4-pixel patches (dynamic_img_pad)
    "timm_deepseek": ("deepseek_vit_412m", dict(TINY, img_size=24, patch_size=4, num_classes=5), (20, 28)),
    "timm_deepseek_align": ("deepseek_vit_412m_align", dict(TINY, img_size=24, patch_size=4, num_classes=5,
                                                            out_features=8), (16, 28)),
    "timm_deepseek_enc": ("deepseek_vit_412m_enc", dict(TINY, img_size=24, patch_size=4, out_features=8,
                                                        dynamic_img_pad=True), (18, 26)),
}
# timm classes that take every input size without being asked (no dynamic_img_size argument)
ANY_SIZE = ("qwen3_vit_", "gemma4_vit_", "deepseek_vit_")
# the size only in pretrained_cfg.input_size, as older timm exports write it
SIZE_IN_PRETRAINED_CFG = {"timm_dinov2"}
# built from timm's class with the name's pretrained_cfg: the registered function fixes the width and depth (timm
# refuses them in model_args), so such a folder is the one way to make a small one; timm's create_model cannot read
# it back, a fresh class instance checks its weights instead
BY_CLASS = {"timm_mixer": "MlpMixer"}

# name -> (transformers class, config class, config, second input size or None)
HF_TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
HF = {
    "hf_dinov2": ("Dinov2Model", "Dinov2Config", dict(HF_TINY, mlp_ratio=2), (24, 20)),
    "hf_dinov2_registers": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig",
                            dict(HF_TINY, mlp_ratio=2, num_register_tokens=4), (20, 28)),
    "hf_dinov2_classifier": ("Dinov2ForImageClassification", "Dinov2Config", dict(HF_TINY, mlp_ratio=2, num_labels=5),
                             (24, 20)),
    "hf_dinov2_registers_classifier": ("Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersConfig",
                                       dict(HF_TINY, mlp_ratio=2, num_register_tokens=4, num_labels=5), (20, 28)),
    "hf_clip_vision": ("CLIPVisionModel", "CLIPVisionConfig", dict(HF_TINY, intermediate_size=32), None),
    "hf_clip_vision_projection": ("CLIPVisionModelWithProjection", "CLIPVisionConfig",
                                  dict(HF_TINY, intermediate_size=32, projection_dim=24), None),
    "hf_siglip_vision": ("SiglipVisionModel", "SiglipVisionConfig", dict(HF_TINY, intermediate_size=32), None),
    "hf_beit_classifier": ("BeitForImageClassification", "BeitConfig",
                           dict(HF_TINY, intermediate_size=32, use_relative_position_bias=True, num_labels=5),
                           (24, 20)),
    "hf_beit_shared": ("BeitModel", "BeitConfig", dict(HF_TINY, intermediate_size=32,
                                                       use_shared_relative_position_bias=True,
                                                       use_absolute_position_embeddings=True), (24, 24)),
    "hf_data2vec_vision": ("Data2VecVisionForImageClassification", "Data2VecVisionConfig",
                           dict(HF_TINY, intermediate_size=32, use_relative_position_bias=True, use_mean_pooling=False,
                                num_labels=5), (20, 28)),
    "hf_vit_msn": ("ViTMSNForImageClassification", "ViTMSNConfig", dict(HF_TINY, intermediate_size=32, num_labels=5),
                   None),
    "hf_vit_mae": ("ViTMAEModel", "ViTMAEConfig", dict(HF_TINY, intermediate_size=32, mask_ratio=0.0), None),
    "hf_dinov3": ("DINOv3ViTModel", "DINOv3ViTConfig", dict(HF_TINY, intermediate_size=32, num_register_tokens=4),
                  (24, 20)),
    "hf_dinov3_gated": ("DINOv3ViTModel", "DINOv3ViTConfig", dict(HF_TINY, intermediate_size=40, use_gated_mlp=True,
                                                                  hidden_act="silu", num_register_tokens=2,
                                                                  layerscale_value=0.1), (20, 28)),
    # DINOv2's giant MLP: SwiGLU, fused gate and value saved as mlp.weights_in (hidden 2/3 of 32, rounded up to 8s)
    "hf_dinov2_giant": ("Dinov2Model", "Dinov2Config", dict(HF_TINY, mlp_ratio=2, use_swiglu_ffn=True), (24, 20)),
    # AIMv2's tower with its attention-pool head: a learned table (one size), or native (the sin-cos table of each
    # grid, any size) with biases
    "hf_aimv2": ("Aimv2VisionModel", "Aimv2VisionConfig", dict(HF_TINY, intermediate_size=24), None),
    "hf_aimv2_native": ("Aimv2VisionModel", "Aimv2VisionConfig", dict(HF_TINY, intermediate_size=24, is_native=True,
                                                                      qkv_bias=True, mlp_bias=True), (24, 20)),
}

# transformers' wrapper of a timm model (how the Hub ships Perception Encoder and other timm models for transformers):
# name -> (class, timm architecture, its model_args, label names or None, second input size: io_dynamic.safetensors
# from the same weights in a wrapper whose model_args add dynamic_img_size)
TIMM_WRAPPER = {
    "hf_timm_wrapper_pe_core": ("TimmWrapperModel", "vit_pe_core_tiny_patch16_384",
                                dict(TINY, img_size=16, patch_size=4), None, (24, 20)),
    "hf_timm_wrapper_classifier": ("TimmWrapperForImageClassification", "deit3_small_patch16_224",
                                   dict(TINY, img_size=16, patch_size=4), ["cat", "dog", "fox"], (20, 28)),
}

# SigLIP 2 (transformers): patch-flattened inputs, the position table resized per image. name -> (class, vision
# config, second grid): io.safetensors at the table's own grid, io_dynamic.safetensors at another one, both with every
# patch real; naflex.safetensors a batch of four aspect ratios built by Siglip2ImageProcessor, padded to NAFLEX_PATCHES
SIGLIP2_TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, patch_size=4,
                    num_patches=16)
SIGLIP2 = {
    "hf_siglip2_vision": ("Siglip2VisionModel", SIGLIP2_TINY, (5, 7)),
    "hf_siglip2": ("Siglip2Model", dict(SIGLIP2_TINY, num_patches=25, hidden_act="gelu"), (3, 6)),
}
SIGLIP2_TEXT = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    max_position_embeddings=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)
NAFLEX_PATCHES = 20
# timm's NaFlex ViTs: any input size (io_dynamic at a second one) and naflex.safetensors, a batch of NAFLEX_IMAGES
# cut by timm's Patchify and padded by its NaFlexCollator (patches, patch_coord, patch_valid)
NAFLEX_TINY = dict(TINY, img_size=16, patch_size=4, pos_embed_grid_size=(4, 4))
TIMM_NAFLEX = {
    "timm_naflexvit_siglip": ("naflexvit_base_patch16_siglip", dict(NAFLEX_TINY, num_classes=5), (20, 28)),
    "timm_naflexvit_gap": ("naflexvit_base_patch16_gap", dict(NAFLEX_TINY, num_classes=5), (28, 12)),
    "timm_naflexvit_par_gap": ("naflexvit_base_patch16_par_gap", dict(NAFLEX_TINY, num_classes=5), (12, 32)),
    "timm_naflexvit_parfac_gap": ("naflexvit_base_patch16_parfac_gap", dict(NAFLEX_TINY, num_classes=5), (32, 20)),
    "timm_naflexvit_so150m2_map": ("naflexvit_so150m2_patch16_reg1_map", dict(NAFLEX_TINY, num_classes=0,
                                                                              mlp_ratio=34 / 13), (24, 20)),
    # C-RADIO: class token out, registers, the table without antialiasing, corners aligned in v3's base
    "timm_naflexvit_radio_v3": ("naflexvit_base_patch16_radio_v3", dict(NAFLEX_TINY, pos_embed_grid_size=(6, 6)),
                                (36, 20)),
    "timm_naflexvit_radio_v4": ("naflexvit_so400m_patch16_radio_v4", dict(NAFLEX_TINY, pos_embed_grid_size=(6, 6),
                                                                           mlp_ratio=2.5), (12, 32)),
}
NAFLEX_IMAGES = ((30, 70), (64, 20), (33, 33), (12, 40))  # (height, width) in pixels


# timm folders that timm also loads at other input sizes, resizing tensors on load (BEiT's relative position tables
# by its checkpoint rule): io_resized_HxW.safetensors holds timm's outputs of the folder loaded at each size
RESIZED = {"timm_beit": [(24, 24), (28, 20)]}


def perturb(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * NOISE)
    return model.eval()


def write_io(path: Path, x: torch.Tensor, logits: torch.Tensor, features: torch.Tensor) -> None:
    save_file({"input": x.contiguous(), "logits": logits.contiguous(), "features": features.contiguous()}, path)


def by_class(name: str, arch: str, args: dict[str, Any]) -> nn.Module:
    """timm's class of BY_CLASS[name] built with args, carrying the registered name's pretrained_cfg."""
    model = getattr(timm.models, BY_CLASS[name])(**args)
    size = model.stem.img_size  # the size it is built for, as create_model would record it
    model.pretrained_cfg = {**timm.models.get_pretrained_cfg(arch).to_dict(), "architecture": arch,
                            "input_size": (args.get("in_chans", 3), *size)}
    return model


def timm_class(name: str, args: dict[str, Any], folder: Path) -> nn.Module:
    model = getattr(timm.models, BY_CLASS[name])(**args)
    model.load_state_dict(load_file(folder / "model.safetensors"))
    return model


def buffers_that_matter(model: nn.Module) -> None:
    """Gemma 4's clamp ranges (infinite as built) set where they cut, its soft tokens' standardisation away from
    the identity, so that a reader that ignores them fails."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "input_max", "output_min", "output_max")):
                b.fill_((1.5 if "input" in name else 0.3) * (1 if name.endswith("max") else -1))
            elif name.endswith("std_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
            elif name.endswith("std_scale"):
                b.copy_(1 + torch.randn_like(b) * 0.1)


def tokens(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The trunk's token sequence (B, N, D): forward_features, or for Qwen3's, Gemma 4's and DeepSeek's towers
    (Qwen3's and DeepSeek's forward_features is a (B, h, w, D) grid; a classifier over the merger's, soft or aligned
    tokens returns those) their encoder's, the grid flattened."""
    if type(model).__name__.startswith(("Qwen3Vit", "Gemma4Vit", "DeepseekVit")):
        out = getattr(model, "encoder", model).forward_features(x)
        return out.flatten(1, 2) if out.ndim == 4 else out
    return model.forward_features(x)


def timm_folder(name: str, arch: str, args: dict[str, Any], second: tuple[int, int] | None) -> None:
    folder = OUT / name
    ref = perturb(by_class(name, arch, args) if name in BY_CLASS else timm.create_model(arch, pretrained=False, **args))
    buffers_that_matter(ref)
    save_for_hf(ref, folder, model_args=args, safe_serialization=True)
    if name in SIZE_IN_PRETRAINED_CFG:
        cfg = json.loads((folder / "config.json").read_text())
        size = cfg["model_args"].pop("img_size")
        cfg["pretrained_cfg"]["input_size"] = [3, *(size if isinstance(size, list) else (size, size))]
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    back = (timm.create_model(f"local-dir:{folder}", pretrained=True) if name not in BY_CLASS else  # timm reads its
            timm_class(name, args, folder)).eval()  # own folder back
    trunk = getattr(ref, "encoder", ref)  # the VLM towers' classifiers hold their trunk under encoder
    embed = getattr(trunk, "patch_embed", getattr(ref, "stem", None))  # Mixer: stem
    x = torch.randn(BATCH, 3, *getattr(embed, "img_size", None) or (args["img_size"],) * 2)  # Gemma 4: no img_size
    with torch.no_grad():
        assert torch.equal(back(x), ref(x)), f"{name}: timm does not read back its own folder"
        write_io(folder / "io.safetensors", x, ref(x), tokens(ref, x))
        if second:
            any_size = arch.startswith(ANY_SIZE)
            dyn = ref if any_size else timm.create_model(arch, pretrained=False, **{**args, "dynamic_img_size": True})
            dyn.load_state_dict(ref.state_dict())
            x = torch.randn(BATCH, 3, *second)
            write_io(folder / "io_dynamic.safetensors", x, dyn.eval()(x), tokens(dyn, x))
        for size in RESIZED.get(name, ()):
            other = timm.create_model(f"local-dir:{folder}", pretrained=True, img_size=size).eval()
            x = torch.randn(BATCH, 3, *size)
            write_io(folder / f"io_resized_{size[0]}x{size[1]}.safetensors", x, other(x), other.forward_features(x))


def hf_folder(name: str, cls: str, config_cls: str, config: dict[str, Any], second: tuple[int, int] | None) -> None:
    folder = OUT / name
    model_cls = getattr(transformers, cls)
    ref = perturb(model_cls(getattr(transformers, config_cls)(**config)))
    ref.save_pretrained(folder)
    back = model_cls.from_pretrained(folder).eval()

    def outputs(x: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if cls == "ViTMAEModel":  # every patch kept in order: mask_ratio 0 and ascending noise (no shuffle)
            noise = torch.arange(ref.embeddings.patch_embeddings.num_patches, dtype=x.dtype).expand(len(x), -1)
            out = ref(pixel_values=x, noise=noise, **kw).last_hidden_state
            return out[:, 0], out
        if cls.endswith("ForImageClassification"):  # the classifier on the pooled tokens
            return ref(pixel_values=x, **kw).logits, ref.base_model(pixel_values=x, **kw).last_hidden_state
        out = ref(pixel_values=x, **kw)
        logits = out.image_embeds if cls.endswith("WithProjection") else out.pooler_output
        return logits, out.last_hidden_state

    x = torch.randn(BATCH, 3, config["image_size"], config["image_size"])
    with torch.no_grad():
        index = 0 if cls.endswith(("Projection", "Classification")) else 1
        if cls != "ViTMAEModel":  # MAE without its noise draws a fresh shuffle each call
            assert torch.equal(outputs(x)[0], back(pixel_values=x)[index]), name
        else:
            assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), back.state_dict().values())), name
        write_io(folder / "io.safetensors", x, *outputs(x))
        if second:  # BEiT resamples its absolute position embedding only when asked to
            kw = {"interpolate_pos_encoding": True} if cls.startswith(("Beit", "Data2Vec")) else {}
            x = torch.randn(BATCH, 3, *second)
            write_io(folder / "io_dynamic.safetensors", x, *outputs(x, **kw))


def timm_wrapper_folder(name: str, cls: str, arch: str, args: dict[str, Any], labels: list[str] | None,
                        second: tuple[int, int]) -> None:
    """A TimmWrapperModel (timm's forward_features and its pooled features) or TimmWrapperForImageClassification
    (timm's logits), written by save_pretrained: config.json names the timm architecture, weights are timm_model.*;
    io_dynamic.safetensors at the ``second`` input size, from the same weights built with dynamic_img_size"""
    folder = OUT / name
    kw = dict(id2label=dict(enumerate(labels))) if labels else {}
    config = transformers.TimmWrapperConfig(architecture=arch, model_args=args, **kw)
    model_cls = getattr(transformers, cls)
    ref = perturb(model_cls(config))
    ref.save_pretrained(folder)
    back = model_cls.from_pretrained(folder).eval()
    x = torch.randn(BATCH, 3, args["img_size"], args["img_size"])
    with torch.no_grad():
        features = ref.timm_model.forward_features(x)
        out = ref(pixel_values=x)
        logits = out.logits if labels else out.pooler_output
        assert torch.equal(back(pixel_values=x)[0], out[0]), f"{name}: transformers does not read back its folder"
        write_io(folder / "io.safetensors", x, logits, features)
        dyn = model_cls(transformers.TimmWrapperConfig(architecture=arch, model_args={**args, "dynamic_img_size": True},
                                                       **kw)).eval()
        dyn.load_state_dict(ref.state_dict())
        x = torch.randn(BATCH, 3, *second)
        out = dyn(pixel_values=x)
        write_io(folder / "io_dynamic.safetensors", x, out.logits if labels else out.pooler_output,
                 dyn.timm_model.forward_features(x))


def siglip2_folder(name: str, cls: str, vision: dict[str, Any], second: tuple[int, int]) -> None:
    from PIL import Image
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

    folder = OUT / name
    if cls == "Siglip2Model":
        config = transformers.Siglip2Config(vision_config=vision, text_config=SIGLIP2_TEXT)
    else:
        config = transformers.Siglip2VisionConfig(**vision)
    ref = perturb(getattr(transformers, cls)(config))
    ref.save_pretrained(folder)
    back = getattr(transformers, cls).from_pretrained(folder).eval()
    tower = ref.vision_model if cls == "Siglip2Model" else ref
    patch = vision["patch_size"]

    def outputs(batch: dict[str, torch.Tensor], model: nn.Module = tower) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(**batch)
        return out.pooler_output, out.last_hidden_state

    def full_grid(x: torch.Tensor) -> dict[str, torch.Tensor]:  # every patch real, as the processor flattens them
        grid = (x.shape[-2] // patch, x.shape[-1] // patch)
        return {"pixel_values": torch.stack([convert_image_to_patches(img, patch) for img in x]),
                "pixel_attention_mask": torch.ones(len(x), grid[0] * grid[1], dtype=torch.int32),
                "spatial_shapes": torch.tensor([grid] * len(x))}

    side = int(vision["num_patches"] ** 0.5)
    with torch.no_grad():
        for file, grid in (("io.safetensors", (side, side)), ("io_dynamic.safetensors", second)):
            x = torch.randn(BATCH, 3, grid[0] * patch, grid[1] * patch)
            batch = full_grid(x)
            assert torch.equal(outputs(batch)[0], outputs(batch, back.vision_model if cls == "Siglip2Model"
                                                             else back)[0]), name
            write_io(folder / file, x, *outputs(batch))
        processor = transformers.Siglip2ImageProcessor(patch_size=patch, max_num_patches=NAFLEX_PATCHES)
        images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8).numpy())
                  for h, w in NAFLEX_IMAGES]
        batch = dict(processor(images=images, return_tensors="pt"))
        logits, features = outputs(batch)
        pixels = {f"image_{i}": torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
                  for i, img in enumerate(images)}  # (C, H, W) uint8, what the processor was given
        save_file({**{k: v.contiguous() for k, v in batch.items()}, **pixels, "logits": logits,
                   "features": features}, folder / "naflex.safetensors")


def timm_naflex_folder(name: str, arch: str, args: dict[str, Any], second: tuple[int, int]) -> None:
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import Patchify

    folder = OUT / name
    ref = perturb(timm.create_model(arch, pretrained=False, **args))
    save_for_hf(ref, folder, model_args=args, safe_serialization=True)
    back = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    with torch.no_grad():
        for file, size in (("io.safetensors", (args["img_size"],) * 2), ("io_dynamic.safetensors", second)):
            x = torch.randn(BATCH, 3, *size)
            assert torch.equal(back(x), ref(x)), f"{name}: timm does not read back its own folder"
            write_io(folder / file, x, ref(x), ref.forward_features(x))
        patchify = Patchify(args["patch_size"])
        samples = [(patchify(torch.randn(3, h // 2, w // 2)), 0) for h, w in NAFLEX_IMAGES]  # edges zero-padded
        batch, _ = NaFlexCollator(max_seq_len=max(len(p["patches"]) for p, _ in samples) + 3)(samples)
        batch = {k: batch[k] for k in ("patches", "patch_coord", "patch_valid")}
        features = ref.forward_features(**batch)
        save_file({**batch, "logits": ref(batch).contiguous(), "features": features["patches"]},
                  folder / "naflex.safetensors")


def main() -> int:
    logging.getLogger("timm").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    only = sys.argv[1:]
    writers = {**dict.fromkeys(TIMM, timm_folder), **dict.fromkeys(HF, hf_folder),
               **dict.fromkeys(SIGLIP2, siglip2_folder), **dict.fromkeys(TIMM_NAFLEX, timm_naflex_folder),
               **dict.fromkeys(TIMM_WRAPPER, timm_wrapper_folder)}
    for seed, (name, spec) in enumerate({**TIMM, **HF, **SIGLIP2, **TIMM_NAFLEX, **TIMM_WRAPPER}.items()):
        if only and name not in only:
            continue
        torch.manual_seed(seed)
        shutil.rmtree(OUT / name, ignore_errors=True)
        writers[name](name, *spec)
        size = sum(p.stat().st_size for p in (OUT / name).iterdir())
        print(f"{name:<28} {size / 1024:6.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
