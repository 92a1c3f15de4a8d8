"""Qwen3-VL's vision tower (Qwen team 2025; also Qwen3.5's and Qwen3.8's): timm's ``qwen3_vit_*`` as one Eva.

A pre-norm ViT (LayerNorm eps 1e-6, GELU-tanh MLP, one ``qkv`` with a bias) with two position encodings at once: a
learned table on a fixed grid (``pos_embed_grid_size``, 48 x 48 in the released towers) resampled to every input's
grid bilinearly with aligned corners, and axial RoPE on the patch coordinates (temperature 10000, half layout). No
class token and no norm on the output tokens: any input whose grid the merger can split works.

Its readout is the VLM's projector, the patch merger (``merger``): each token normalised, every 2 x 2 block of
tokens concatenated (row-major), then ``fc1``, GELU and ``fc2`` to the language model's width (``out_features``).
timm builds three kinds from it, and so does vitlab:

- the classifier (``qwen3_vit_*``): the mean patch token through a LayerNorm without weights (``fc_norm``), then
  ``head``;
- the classifier over the merger's tokens (``qwen3_vit_*_merge``, ``encoder_pool='merge'``): the mean merged token,
  then the same norm and head;
- the encoder (``qwen3_vit_*_enc``, ``encoder_only``): the merger's tokens (B, N / 4, out_features) as the output,
  no pooling, no classifier: what the language model reads.

timm nests the classifiers' trunk under ``encoder.``; vitlab's keys are the encoder's (timm's interop adds and strips
the prefix). ``forward_features`` returns the trunk's tokens (B, N, D); the merger reads them on the grid of the last
input (``grid``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import TimmSpec
from .eva import Eva
from .layers import init_weights_vit

QWEN3_SIZES = {"88m": (768, 12, 12, 4.0, 1024), "306m": (1024, 24, 16, 4.0, 2048),
               "416m": (1152, 27, 16, 4304 / 1152, 5120)}  # width, depth, heads, MLP ratio, timm's default out_features
QWEN3_NAMES = frozenset(f"qwen3_vit_{s}{k}" for s in QWEN3_SIZES for k in ("", "_merge", "_enc"))
# the arguments timm's Qwen3VitClassifier takes with vitlab's names and meaning (its encoder: all but the last four)
QWEN3_ARGS = ("img_size", "patch_size", "in_chans", "global_pool", "out_features", "embed_dim", "depth", "num_heads",
              "mlp_ratio", "merge_size", "pos_embed_grid_size", "rope_temperature", "norm_eps", "proj_drop_rate",
              "attn_drop_rate", "drop_path_rate", "num_classes", "encoder_pool", "final_norm", "drop_rate")


class PatchMerger(nn.Module):
    """Qwen's VLM projector: a norm per token, each ``merge_size`` x ``merge_size`` block of the grid concatenated
    (row-major), ``fc1``, GELU, ``fc2`` to ``out_features`` (none where 0). (B, h * w, D) -> (B, h * w / k^2, out)."""

    def __init__(self, dim: int, merge_size: int = 2, out_features: int = 0, norm_eps: float = 1e-6):
        super().__init__()
        self.merge_size = merge_size
        hidden = dim * merge_size ** 2
        self.out_features = out_features if out_features > 0 else hidden
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.fc1 = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out_features) if out_features > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        B, _, C = x.shape
        (h, w), k = grid, self.merge_size
        x = self.norm(x).reshape(B, h // k, k, w // k, k, C).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(B, (h // k) * (w // k), k * k * C)  # (B, N / k^2, k^2 D)
        return self.fc2(self.act(self.fc1(x)))


class VlmReadouts:
    """The readouts timm builds from a VLM tower's projector (Qwen3's merger, DeepSeek's aligner), as a mixin before
    the model's class: the classifier (the mean patch token), the classifier over the projector's tokens
    (``encoder_pool``) and the encoder (``encoder_only``: the projector's tokens out, no head). The subclass names its
    projector (``projector_name``, ``projector_pool``), keeps the grid of the last input in ``grid`` and calls
    ``readout_args`` before building the trunk, ``build_readout`` after."""

    tower = ""  # the tower's name in messages
    projector_name = ""  # the projector's attribute (and timm's key prefix)
    projector_pool = ""  # the encoder_pool that keeps it (timm's encoder says it as its global_pool)
    projector_tokens = ""  # what the encoder outputs, in messages

    @classmethod
    def readout_args(cls, num_classes: int, global_pool: str, encoder_pool: str, final_norm: bool,
                     encoder_only: bool) -> tuple[str, str]:
        """(global_pool, encoder_pool) as vitlab holds them; VitlabError for a readout timm does not build."""
        k = cls.projector_pool
        if global_pool == k:  # timm's encoder says its projector so
            global_pool, encoder_pool = "", k
        if encoder_pool not in ("", k):
            raise VitlabError(f"encoder_pool {encoder_pool!r} is not one vitlab implements; accepted: '', {k!r}")
        if encoder_only and (num_classes or global_pool or encoder_pool != k or final_norm):
            raise VitlabError(f"encoder_only=True is the {cls.tower}'s encoder ({cls.projector_tokens}, as the "
                              f"language model reads them); it takes num_classes=0, global_pool='', "
                              f"encoder_pool={k!r}, final_norm=False (to fine-tune, load it with encoder_only=False, "
                              "num_classes=N)")
        return global_pool, encoder_pool

    @property
    def projector(self) -> nn.Module | None:
        return getattr(self, self.projector_name)

    def build_readout(self, num_classes: int, final_norm: bool, norm: type[nn.Module], norm_eps: float) -> None:
        """num_features (the projector's width where there is one), the weightless ``fc_norm`` and ``head``."""
        if self.projector is not None:
            self.projector.apply(init_weights_vit)
        self.num_features = self.projector.out_features if self.projector is not None else self.embed_dim
        self.fc_norm = norm(self.num_features, eps=norm_eps, elementwise_affine=False) if final_norm else nn.Identity()
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.head.apply(init_weights_vit)

    def readout_timm_spec(self, timm_cls: str, args: tuple[str, ...], base_arch: str, **fixed) -> TimmSpec:
        """timm's ``{timm_cls}Encoder`` for an encoder (``args`` but the last three), else its ``{timm_cls}Classifier``
        (its trunk under ``encoder.``); ``args`` ends with num_classes, encoder_pool, final_norm, drop_rate."""
        dropped, k = ("encoder_only", "dynamic_img_size"), self.projector_pool
        if self.encoder_only:  # num_classes: 0, which timm's encoder ignores
            return TimmSpec(f"{timm_cls}Encoder", args[:-3], f"{base_arch}_enc", dropped=dropped,
                            fixed={**fixed, "encoder_pool": k, "final_norm": False, "drop_rate": 0.0},
                            values={"global_pool": {"": k}})
        return TimmSpec(f"{timm_cls}Classifier", args, base_arch, fixed=fixed, dropped=dropped,
                        trunk_prefix="encoder.")

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> the projector's tokens (where there is one), their mean (global_pool 'avg'), through fc_norm."""
        if self.projector is not None:
            x = self.projector(x, self.grid)
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        return self.fc_norm(x)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if self.encoder_only and num_classes:
            raise VitlabError(f"an encoder_only {self.tower} has no classifier; load it with encoder_only=False, "
                              "global_pool='avg', final_norm=True to fine-tune one")
        super().reset_classifier(num_classes, global_pool)


class Qwen3Vit(VlmReadouts, Eva):
    """timm's Qwen3VitClassifier and Qwen3VitEncoder (``encoder_only``): Eva's blocks with RoPE and a resampled
    table, the patch merger, mean pooling through a weightless LayerNorm."""

    global_pools = ("avg", "")
    timm_names = QWEN3_NAMES
    hf_model_type = None
    no_hf = ("Qwen3-VL's vision tower as transformers holds it (Qwen3VLVisionModel reads flattened patches of two "
             "frames with their grid_thw, inside the VLM); load timm's qwen3_vit_* folders")
    no_weight_decay_names = ("pos_embed",)
    tower, projector_name, projector_pool, projector_tokens = "Qwen3 ViT", "merger", "merge", "the merger's tokens"

    def __init__(self, img_size=768, patch_size=16, in_chans=3, num_classes=1000, global_pool="avg", encoder_pool="",
                 out_features=0, embed_dim=1152, depth=27, num_heads=16, mlp_ratio=4304 / 1152, merge_size=2,
                 pos_embed_grid_size=48, rope_temperature=10000.0, norm_eps=1e-6, act_layer="gelu_tanh",
                 final_norm=True, drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0,
                 encoder_only=False, dynamic_img_size=True):
        global_pool, encoder_pool = self.readout_args(num_classes, global_pool, encoder_pool, final_norm, encoder_only)
        super().__init__(img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=0,
                         global_pool=global_pool, embed_dim=embed_dim, depth=depth, num_heads=num_heads, qkv_bias=True,
                         mlp_ratio=mlp_ratio, attn_type="rope", class_token=False, use_abs_pos_emb=True,
                         use_rot_pos_emb=True, rope_temperature=rope_temperature, rope_rotate_half=True,
                         use_post_transformer_norm=False, use_fc_norm=False, dynamic_img_size=dynamic_img_size,
                         act_layer=act_layer, norm_eps=norm_eps, drop_rate=drop_rate, proj_drop_rate=proj_drop_rate,
                         attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        self.encoder_pool, self.encoder_only, self.act_layer = encoder_pool, encoder_only, act_layer
        self.pos_embed_grid_size, self.grid = pos_embed_grid_size, self.patch_embed.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_grid_size ** 2, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.merger = PatchMerger(embed_dim, merge_size, out_features, norm_eps) if encoder_pool == "merge" else None
        self.build_readout(num_classes, final_norm, nn.LayerNorm, norm_eps)

    @property
    def family(self) -> str:
        readout = ("the merger's tokens" if self.encoder_only else "the mean merged token" if self.merger is not None
                   else "the mean patch token")
        return f"Qwen3-VL ViT (axial RoPE and a resampled table, {readout})"

    @property
    def timm_spec(self) -> TimmSpec:
        """timm's Qwen3VitEncoder for an encoder, else its Qwen3VitClassifier (its trunk under ``encoder.``)."""
        return self.readout_timm_spec("Qwen3Vit", QWEN3_ARGS, "qwen3_vit_306m", act_layer="gelu_tanh")

    @property
    def grid_multiple(self) -> int:
        """What the patch grid's sides must be multiples of: the merger's block."""
        return self.merger.merge_size if self.merger is not None else 1

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, w, D) grid -> (B, h * w, D) plus the table resampled to (h, w) bilinearly, corners aligned (in
        float32 at least, as Qwen does), whatever the model's own grid."""
        B, h, w, D = x.shape
        g, pos_embed = self.pos_embed_grid_size, self.pos_embed
        if (h, w) != (g, g):
            dtype = pos_embed.dtype if pos_embed.dtype == torch.float64 else torch.float32
            table = pos_embed.reshape(1, g, g, D).permute(0, 3, 1, 2).to(dtype)
            table = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
            pos_embed = table.permute(0, 2, 3, 1).reshape(1, h * w, D).to(x.dtype)
        return self.pos_drop(x.reshape(B, h * w, D) + pos_embed)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, N, D) patch tokens (no final norm); ``grid`` keeps their (h, w) for the
        merger."""
        p = self.patch_embed.patch_size
        self.grid = (x.shape[-2] // p[0], x.shape[-1] // p[1])
        if self.merger is not None and (self.grid[0] % self.merger.merge_size or self.grid[1] % self.merger.merge_size):
            raise VitlabError(f"a {self.grid[0]}x{self.grid[1]} patch grid does not split into the merger's "
                              f"{self.merger.merge_size}x{self.merger.merge_size} blocks; accepted: an input whose "
                              f"sides are multiples of {p[0] * self.merger.merge_size} pixels")
        return super().forward_features(x)
