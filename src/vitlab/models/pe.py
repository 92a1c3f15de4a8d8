"""Perception Encoder (Bolya et al. 2025, Meta): timm's Eva built as PE's image towers, under timm's names and keys.

PE's ViT is CLIP's pre-norm ViT (``norm_pre`` after the position table, no patch-embedding bias) with both a learned
absolute position table, class token included, and 2D axial RoPE on the patch tokens (coordinates counted from 1,
``rope_grid_offset=1``, in (column, row) order, rescaled to the pre-training grid ``ref_feat_shape``), LayerNorm
eps 1e-5. The three kinds differ in their readout:

- PE-Core (``vit_pe_core_*``): attention pooling (``attn_pool``, SigLIP's head: one learned query over every token,
  the class token included, 8 heads) after the final norm, then the CLIP projection as ``head`` (its width timm's
  ``num_classes``);
- PE-Spatial and PE-Lang (``vit_pe_spatial_*``, ``vit_pe_lang_*``): no final norm, no head; the mean patch token;
  Lang has LayerScale (0.1) and fewer blocks (23 of 24, 47 of 50: the last ones were dropped for the language model).

The gigantic sizes have no class token and no grid offset; Spatial-G has LayerScale too. Other input sizes
(``dynamic_img_size``) resample the table and rebuild the rotation for the new grid, as timm does.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import nn

from ..errors import VitlabError
from .base import TimmSpec
from .eva import EVA_ARGS, Eva
from .layers import AttentionPoolLatent, init_weights_vit

PE_NORM_EPS = 1e-5
PE_SIZES = {"tiny": (16, 192, 12, 3, 4.0), "small": (16, 384, 12, 6, 4.0), "base": (16, 768, 12, 12, 4.0),
            "large": (14, 1024, 24, 16, 4.0), "gigantic": (14, 1536, 50, 16, 8960 / 1536)}  # patch, width, depth,
# heads, MLP ratio; the image size of each kind's weights; PE-Core's projection width; PE-Lang's depth
PE_IMAGES = {"core": {"tiny": 384, "small": 384, "base": 224, "large": 336, "gigantic": 448},
             "spatial": {"tiny": 512, "small": 512, "base": 512, "large": 448, "gigantic": 448},
             "lang": {"large": 448, "gigantic": 448}}
PE_PROJ = {"tiny": 512, "small": 512, "base": 1024, "large": 1024, "gigantic": 1280}
PE_LANG_DEPTH = {"large": 23, "gigantic": 47}
PE_NAMES = frozenset(f"vit_pe_{kind}_{size}_patch{PE_SIZES[size][0]}_{img}" for kind, sizes in PE_IMAGES.items()
                     for size, img in sizes.items())


class PerceptionEncoder(Eva):
    """timm's Eva as PE builds it; ``global_pool='map'`` adds timm's attention-pool head ``attn_pool``."""

    global_pools = ("map", "avg", "token", "")
    timm_names = PE_NAMES
    hf_model_type = None
    no_hf = ("Perception Encoder's image tower (transformers has no class of its own for it: its PE models wrap "
             "timm's Eva through timm_wrapper)")
    no_pretrain = ("MAE and MPP run the ViT encoder's forward, without rotary attention; PE's own objective, "
                   "contrastive image-text training, is not implemented")

    def __init__(self, global_pool="map", attn_pool_num_heads=None, attn_pool_mlp_ratio=None, **kwargs):
        super().__init__(global_pool=global_pool, **kwargs)
        self.attn_pool = None
        if global_pool == "map":
            self.attn_pool = AttentionPoolLatent(
                self.embed_dim, attn_pool_num_heads or self.blocks[0].attn.num_heads,
                attn_pool_mlp_ratio or kwargs.get("mlp_ratio", 4.0),
                norm_layer=partial(nn.LayerNorm, eps=self.norm_eps), act_layer=nn.GELU)
            self.attn_pool.apply(init_weights_vit)

    @property
    def family(self) -> str:
        readout = "attention-pool head" if self.attn_pool is not None else "mean patch token"
        return f"Perception Encoder (axial RoPE and a position table, {readout})"

    @property
    def timm_spec(self) -> TimmSpec:
        """timm's Eva, with the attention pool's arguments, under a PE name: timm's PE names fix LayerNorm eps 1e-5."""
        spec = super().timm_spec
        return replace(spec, args=EVA_ARGS + ("attn_pool_num_heads", "attn_pool_mlp_ratio"),
                       base_arch="vit_pe_core_base_patch16_224", fixed={**spec.fixed, "norm_eps": PE_NORM_EPS})

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's rule: another pooling drops the attention pool; 'map' needs the one built with the model."""
        if global_pool == "map" and self.attn_pool is None:
            raise VitlabError("global_pool='map' needs the attention-pool head built with the model; accepted here: "
                              f"{', '.join(repr(p) for p in self.global_pools if p != 'map')}")
        super().reset_classifier(num_classes, global_pool)
        if global_pool is not None and global_pool != "map":
            self.attn_pool = None

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> (B, D): the attention pool's learned query over every token (the class token included), else
        Eva's pooling; then fc_norm."""
        if self.global_pool == "map" and self.attn_pool is not None:
            return self.fc_norm(self.attn_pool(x))
        return super().pool(x)
