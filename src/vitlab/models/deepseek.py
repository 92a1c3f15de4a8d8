"""DeepSeek-V4's vision tower (DeepSeek-AI 2026; V4 and V4.1): timm's ``deepseek_vit_*`` as one Eva.

A pre-norm ViT with RMSNorm everywhere (eps 1e-6), one ``qkv`` with a bias and ``proj`` with one, a packed SwiGLU
MLP without biases (``mlp.fc1`` holds gate then value, hidden int(D * mlp_ratio)), and axial RoPE on the patch
coordinates (temperature 10000, half layout) as its only position encoding: no table, no class token, any grid of
14-pixel patches (``dynamic_img_pad``: images zero-padded on the bottom and right to the patch first). The trunk ends
with an RMSNorm (``norm``).

Its readout is the VLM's projector, the aligner (``aligner``): the grid zero-padded on the bottom and right to
multiples of ``downsample_ratio`` (3), each 3 x 3 block of tokens concatenated channel-major ((C, kh, kw), as
``F.unfold`` and ``pixel_unshuffle`` order them), then ``fc1`` to the language model's width (``out_features``),
GELU and ``fc2``. timm builds three kinds from it, and so does vitlab:

- the classifier (``deepseek_vit_*``): the mean patch token through an RMSNorm without weights (``fc_norm``; timm's
  ``norm`` beside ``encoder``, which holds no tensor), then ``head``;
- the classifier over the aligner's tokens (``deepseek_vit_*_align``, ``encoder_pool='align'``): the mean aligned
  token, then the same norm and head;
- the encoder (``deepseek_vit_*_enc``, ``encoder_only``): the aligner's tokens (B, ceil(h / 3) * ceil(w / 3),
  out_features), no pooling, no classifier: what the language model reads.

timm nests the classifiers' trunk under ``encoder.``; vitlab's keys are the encoder's (timm's interop adds and strips
the prefix). ``forward_features`` returns the trunk's normalised tokens (B, N, D); the aligner reads them on the grid
of the last input (``grid``). timm's RMSNorm computes in float32 whatever the input's precision; vitlab's in the
input's (the same in float32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import TimmSpec
from .eva import Eva
from .layers import RMSNorm, init_weights_vit
from .qwen3 import VlmReadouts

DEEPSEEK_SIZES = {"412m": (1024, 32, 16, 2816 / 1024, 5120)}  # width, depth, heads, MLP ratio, V4.1's out_features
DEEPSEEK_NAMES = frozenset(f"deepseek_vit_{s}{k}" for s in DEEPSEEK_SIZES for k in ("", "_align", "_enc"))
# the arguments timm's DeepseekVitClassifier takes with vitlab's names and meaning (its encoder: all but the last
# four, num_classes filtered out by timm)
DEEPSEEK_ARGS = ("img_size", "patch_size", "in_chans", "global_pool", "out_features", "embed_dim", "depth",
                 "num_heads", "mlp_ratio", "downsample_ratio", "rope_temperature", "norm_eps", "proj_drop_rate",
                 "attn_drop_rate", "drop_path_rate", "dynamic_img_pad", "num_classes", "encoder_pool", "final_norm",
                 "drop_rate")


class DeepseekAligner(nn.Module):
    """DeepSeek's VLM projector: the grid zero-padded to multiples of ``downsample_ratio`` r, each r x r block's tokens
    concatenated channel-major, ``fc1`` to ``out_features``, GELU, ``fc2``. (B, h * w, D) -> (B, ceil(h / r) *
    ceil(w / r), out_features)."""

    def __init__(self, dim: int, downsample_ratio: int = 3, out_features: int = 0):
        super().__init__()
        if downsample_ratio < 1 or out_features < 1:
            raise VitlabError(f"DeepSeek's aligner takes downsample_ratio >= 1 and out_features >= 1 (the language "
                              f"model's width), got {downsample_ratio} and {out_features}")
        self.downsample_ratio, self.out_features = downsample_ratio, out_features
        self.fc1 = nn.Linear(dim * downsample_ratio ** 2, out_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(out_features, out_features)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        B, _, C = x.shape
        (h, w), r = grid, self.downsample_ratio
        x = F.pad(x.transpose(1, 2).reshape(B, C, h, w), (0, -w % r, 0, -h % r))
        x = F.pixel_unshuffle(x, r).flatten(2).transpose(1, 2)  # (B, N / r^2, C r^2), (C, kh, kw) per token
        return self.fc2(self.act(self.fc1(x)))


class DeepseekVit(VlmReadouts, Eva):
    """timm's DeepseekVitClassifier and DeepseekVitEncoder (``encoder_only``): Eva's RMSNorm blocks with RoPE and a
    bias-free packed SwiGLU, the aligner, mean pooling through a weightless RMSNorm."""

    global_pools = ("avg", "")
    timm_names = DEEPSEEK_NAMES
    hf_model_type = None
    no_hf = ("DeepSeek-V4's vision tower (transformers holds it only inside the VLM); load timm's deepseek_vit_* "
             "folders")
    no_weight_decay_names = ()
    mlp_bias = False
    tower, projector_name, projector_pool, projector_tokens = "DeepSeek ViT", "aligner", "align", "the aligner's tokens"

    def __init__(self, img_size=546, patch_size=14, in_chans=3, num_classes=1000, global_pool="avg", encoder_pool="",
                 out_features=0, embed_dim=1024, depth=32, num_heads=16, mlp_ratio=2816 / 1024, downsample_ratio=3,
                 rope_temperature=10000.0, norm_eps=1e-6, final_norm=True, drop_rate=0.0, proj_drop_rate=0.0,
                 attn_drop_rate=0.0, drop_path_rate=0.0, dynamic_img_pad=False, encoder_only=False,
                 dynamic_img_size=True):
        global_pool, encoder_pool = self.readout_args(num_classes, global_pool, encoder_pool, final_norm, encoder_only)
        super().__init__(img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=0,
                         global_pool=global_pool, embed_dim=embed_dim, depth=depth, num_heads=num_heads, qkv_bias=True,
                         mlp_ratio=mlp_ratio, swiglu_mlp=True, attn_type="rope", class_token=False,
                         use_abs_pos_emb=False, use_rot_pos_emb=True, rope_temperature=rope_temperature,
                         rope_rotate_half=True, use_post_transformer_norm=True, use_fc_norm=False,
                         dynamic_img_size=dynamic_img_size, norm_layer="rmsnorm", norm_eps=norm_eps,
                         drop_rate=drop_rate, proj_drop_rate=proj_drop_rate, attn_drop_rate=attn_drop_rate,
                         drop_path_rate=drop_path_rate)
        self.encoder_pool, self.encoder_only, self.dynamic_img_pad = encoder_pool, encoder_only, dynamic_img_pad
        self.grid = self.patch_embed.grid_size
        self.aligner = DeepseekAligner(embed_dim, downsample_ratio, out_features) if encoder_pool == "align" else None
        self.build_readout(num_classes, final_norm, RMSNorm, norm_eps)

    def init_weights(self, head_init_scale: float) -> None:
        """timm's: truncated normal (std .02) Linear weights and zero biases, no rescaling by depth."""
        self.apply(init_weights_vit)

    @property
    def family(self) -> str:
        readout = ("the aligner's tokens" if self.encoder_only else "the mean aligned token"
                   if self.aligner is not None else "the mean patch token")
        return f"DeepSeek ViT (RMSNorm, SwiGLU, axial RoPE, {readout})"

    @property
    def timm_spec(self) -> TimmSpec:
        """timm's DeepseekVitEncoder for an encoder, else its DeepseekVitClassifier (its trunk under ``encoder.``)."""
        return self.readout_timm_spec("DeepseekVit", DEEPSEEK_ARGS, "deepseek_vit_412m")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images (zero-padded to the patch where ``dynamic_img_pad``) -> (B, N, D) normalised patch
        tokens; ``grid`` keeps their (h, w) for the aligner."""
        p = self.patch_embed.patch_size
        if self.dynamic_img_pad:
            x = F.pad(x, (0, -x.shape[-1] % p[1], 0, -x.shape[-2] % p[0]))
        self.grid = (x.shape[-2] // p[0], x.shape[-1] // p[1])
        return super().forward_features(x)
