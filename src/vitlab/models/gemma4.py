"""Gemma 4's vision tower (Google 2026): timm's ``gemma4_vit_*`` under timm's names and keys.

A ViT of its own kind:

- patches flattened channel-first (C, ph, pw), read as ``2 * (x - 0.5)`` (pixels in [0, 1]), projected by a linear
  layer without bias (``patch_embed.input_proj``), plus a learned vector per column and per row
  (``patch_embed.position_embedding_table``, (2, positions, D)): any input size up to that many patches a side;
- sandwich blocks: x + norm2(attn(norm1(x))), then x + norm4(mlp(norm3(x))), every norm an RMSNorm;
- attention with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (no biases, ``head_dim`` of its own, grouped
  key/value heads where ``num_kv_heads`` says), RMSNorm on queries and keys (weighted) and on values (not), 2D RoPE
  on queries and keys (the first half of each head turns with the column, the second with the row, each half
  rotated by halves, temperature 100), and no scaling of the logits (the norms hold them);
- a gated MLP: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``;
- every projection optionally clamped to the input and output ranges its checkpoint holds (``use_clipped_linears``:
  buffers ``input_min`` ... ``output_max`` beside ``linear``; infinite until loaded).

Its readouts, as timm's: the classifier (``gemma4_vit_*``) averages the tokens, normalises them with an RMSNorm
without weights (``fc_norm``) and applies ``head``; the encoder (``gemma4_vit_*_enc``, ``encoder_only``) returns the
VLM's soft tokens: the mean of each ``pooling_kernel_size`` squared cell of the grid times sqrt(D), standardised by
``std_bias``/``std_scale`` where the checkpoint has them (``standardize``). A classifier over the soft tokens is
``encoder_pool='soft'``. timm nests the classifiers' trunk under ``encoder.``; vitlab's keys are the encoder's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec
from .layers import Attention, DropPath, RMSNorm, drop_path_rates, get_act_layer, to_2tuple

GEMMA4_SIZES = {"167m": dict(embed_dim=768, depth=16, num_heads=12, head_dim=64, intermediate_size=3072,
                             use_clipped_linears=True),
                "570m": dict(embed_dim=1152, depth=27, num_heads=16, head_dim=72, intermediate_size=4304,
                             standardize=True)}
GEMMA4_NAMES = frozenset(f"gemma4_vit_{s}{k}" for s in GEMMA4_SIZES for k in ("", "_enc"))
# the arguments timm's Gemma4VitClassifier takes with vitlab's names and meaning (its encoder: all but the last four)
GEMMA4_ARGS = ("img_size", "patch_size", "in_chans", "global_pool", "embed_dim", "depth", "num_heads", "head_dim",
               "num_kv_heads", "intermediate_size", "norm_eps", "rope_theta", "position_embedding_size",
               "pooling_kernel_size", "standardize", "use_clipped_linears", "proj_drop_rate", "attn_drop_rate",
               "drop_path_rate", "num_classes", "encoder_pool", "final_norm", "drop_rate")


class ClippableLinear(nn.Module):
    """A linear layer without bias (``linear``), its input and output clamped to the checkpoint's ranges where
    ``use_clipped`` (buffers ``input_min``, ``input_max``, ``output_min``, ``output_max``)."""

    def __init__(self, in_features: int, out_features: int, use_clipped: bool = False):
        super().__init__()
        self.use_clipped = use_clipped
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if use_clipped:
            for name, value in (("input_min", -math.inf), ("input_max", math.inf), ("output_min", -math.inf),
                                ("output_max", math.inf)):
                self.register_buffer(name, torch.tensor(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


class Gemma4PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, h, w, D): channel-first patches of ``2 * (x - 0.5)`` through ``input_proj``, plus the
    table's column and row vectors."""

    def __init__(self, img_size=768, patch_size=16, in_chans=3, embed_dim=768, position_embedding_size=10240):
        super().__init__()
        self.img_size, self.patch_size = to_2tuple(img_size), to_2tuple(patch_size)
        for side, s, p in zip(("height", "width"), self.img_size, self.patch_size):
            if s % p:
                raise VitlabError(f"image {side} {s} is not divisible by the patch size {p}; use a multiple of {p}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.dynamic_img_size = True  # a vector per row and column: any grid up to the table's length
        self.in_chans, self.position_embedding_size = in_chans, position_embedding_size
        self.input_proj = nn.Linear(in_chans * self.patch_size[0] * self.patch_size[1], embed_dim, bias=False)
        self.position_embedding_table = nn.Parameter(torch.zeros(2, position_embedding_size, embed_dim))
        nn.init.trunc_normal_(self.position_embedding_table, std=0.02)

    @property
    def proj(self) -> nn.Module:
        """The patch projection (what timm's configs name first_conv)."""
        return self.input_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise VitlabError(f"expected images of shape (B, {self.in_chans}, H, W), got {tuple(x.shape)}")
        B, C, H, W = x.shape
        (ph, pw), n = self.patch_size, self.position_embedding_size
        h, w = H // ph, W // pw
        if H % ph or W % pw or h > n or w > n:
            raise VitlabError(f"input size {H}x{W} is not a grid of {ph}x{pw} patches at most {n} a side; accepted: "
                              f"multiples of the patch size up to {n * ph}x{n * pw}")
        x = x.reshape(B, C, h, ph, w, pw).permute(0, 2, 4, 1, 3, 5).reshape(B, h, w, C * ph * pw)
        x = self.input_proj(2 * (x - 0.5))
        table = self.position_embedding_table
        return x + table[0, :w][None, None] + table[1, :h][None, :, None]  # (B, h, w, D): column, then row


def gemma4_rope(grid: tuple[int, int], head_dim: int, theta: float) -> torch.Tensor:
    """(h * w, 2 * head_dim) sines then cosines of each patch, row-major: the head's first half turns with the
    column, the second with the row, each half laid out by halves (its angles written twice)."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    ys, xs = torch.meshgrid(torch.arange(grid[0], dtype=torch.float32), torch.arange(grid[1], dtype=torch.float32),
                            indexing="ij")
    angles = [pos.flatten()[:, None] * inv_freq for pos in (xs, ys)]
    emb = torch.cat([torch.cat([a, a], dim=-1) for a in angles], dim=-1)  # (N, head_dim)
    return torch.cat([emb.sin(), emb.cos()], dim=-1)


def rotate_each_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Queries or keys (B, H, N, hd) turned by ``gemma4_rope``: each half of the head rotated by its own halves."""
    sin, cos = rope.chunk(2, dim=-1)

    def turn(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.cat([-p[..., p.shape[-1] // 2:], p[..., :p.shape[-1] // 2]], dim=-1)
                          for p in t.chunk(2, dim=-1)], dim=-1)

    return x * cos + turn(x) * sin


class Gemma4Attention(Attention):
    """Gemma 4's attention (see the module's note); the slow path passes its probabilities through ``attn_map``."""

    def __init__(self, dim, num_heads, head_dim, num_kv_heads=None, attn_drop=0.0, proj_drop=0.0, norm_eps=1e-6,
                 use_clipped=False):
        nn.Module.__init__(self)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise VitlabError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {num_heads}; accepted: "
                              "a divisor of num_heads")
        self.scale, self.fused_attn = 1.0, True  # queries and keys are normalised: no 1 / sqrt(head_dim)
        self.q_proj = ClippableLinear(dim, num_heads * head_dim, use_clipped)
        self.k_proj = ClippableLinear(dim, self.num_kv_heads * head_dim, use_clipped)
        self.v_proj = ClippableLinear(dim, self.num_kv_heads * head_dim, use_clipped)
        self.o_proj = ClippableLinear(num_heads * head_dim, dim, use_clipped)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=norm_eps)
        self.v_norm = RMSNorm(head_dim, eps=norm_eps, elementwise_affine=False)
        self.attn_drop, self.attn_map = nn.Dropout(attn_drop), nn.Identity()
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        heads = lambda proj, n: proj(x).reshape(B, N, n, self.head_dim)  # noqa: E731
        q = self.q_norm(heads(self.q_proj, self.num_heads)).transpose(1, 2)  # (B, H, N, hd)
        k = self.k_norm(heads(self.k_proj, self.num_kv_heads)).transpose(1, 2)
        v = self.v_norm(heads(self.v_proj, self.num_kv_heads)).transpose(1, 2)
        q, k = rotate_each_half(q, rope), rotate_each_half(k, rope)
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0,
                                               scale=1.0)
        else:
            x = self.attn_drop(self.attn_map((q @ k.transpose(-2, -1)).softmax(dim=-1))) @ v
        return self.proj_drop(self.o_proj(x.transpose(1, 2).reshape(B, N, -1)))


class Gemma4Mlp(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), GELU-tanh by default."""

    def __init__(self, dim, hidden, act_layer="gelu_tanh", drop=0.0, use_clipped=False):
        super().__init__()
        self.gate_proj = ClippableLinear(dim, hidden, use_clipped)
        self.up_proj = ClippableLinear(dim, hidden, use_clipped)
        self.down_proj = ClippableLinear(hidden, dim, use_clipped)
        self.act, self.drop = get_act_layer(act_layer)(), nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


class Gemma4Block(nn.Module):
    """Sandwich block: x + norm2(attn(norm1(x))), then x + norm4(mlp(norm3(x)))."""

    def __init__(self, dim, num_heads, head_dim, intermediate_size, num_kv_heads=None, norm_eps=1e-6, attn_drop=0.0,
                 proj_drop=0.0, drop_path=0.0, act_layer="gelu_tanh", use_clipped=False):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim, eps=norm_eps), RMSNorm(dim, eps=norm_eps)
        self.attn = Gemma4Attention(dim, num_heads, head_dim, num_kv_heads, attn_drop, proj_drop, norm_eps,
                                    use_clipped)
        self.norm3, self.norm4 = RMSNorm(dim, eps=norm_eps), RMSNorm(dim, eps=norm_eps)
        self.mlp = Gemma4Mlp(dim, intermediate_size, act_layer, proj_drop, use_clipped)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.norm2(self.attn(self.norm1(x), rope)))
        return x + self.drop_path(self.norm4(self.mlp(self.norm3(x))))


class Gemma4Vit(Model):
    """timm's Gemma4VitClassifier and Gemma4VitEncoder (``encoder_only``)."""

    global_pools = ("avg", "")
    timm_names = GEMMA4_NAMES
    hf_model_type = None
    no_hf = ("Gemma 4's vision tower as transformers holds it (Gemma4VisionModel reads patches with their positions "
             "inside the VLM); load timm's gemma4_vit_* folders")
    no_weight_decay_names = ("patch_embed.position_embedding_table",)
    no_pretrain = "MAE and MPP run the plain ViT's encoder; Gemma 4's tower has its own blocks and position table"

    def __init__(self, img_size=768, patch_size=16, in_chans=3, num_classes=1000, global_pool="avg", encoder_pool="",
                 embed_dim=768, depth=16, num_heads=12, head_dim=64, num_kv_heads=None, intermediate_size=3072,
                 norm_eps=1e-6, rope_theta=100.0, position_embedding_size=10240, pooling_kernel_size=3,
                 standardize=False, use_clipped_linears=False, final_norm=True, act_layer="gelu_tanh", drop_rate=0.0,
                 proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, encoder_only=False,
                 dynamic_img_size=True):
        super().__init__()
        if global_pool == "soft":  # timm's encoder says its soft-token pool so
            global_pool, encoder_pool = "", "soft"
        for name, value, accepted in (("global_pool", global_pool, self.global_pools),
                                      ("encoder_pool", encoder_pool, ("", "soft"))):
            if value not in accepted:
                raise VitlabError(f"{name} {value!r} is not one vitlab implements; accepted: "
                                  f"{', '.join(map(repr, accepted))}")
        if head_dim % 4:
            raise VitlabError(f"head_dim {head_dim} is not a multiple of 4, which Gemma 4's 2D RoPE needs")
        if encoder_only and (num_classes or global_pool or encoder_pool != "soft" or final_norm):
            raise VitlabError("encoder_only=True is Gemma 4's encoder (the soft tokens, as the language model reads "
                              "them); it takes num_classes=0, global_pool='', encoder_pool='soft', final_norm=False "
                              "(to fine-tune, load it with encoder_only=False, num_classes=N)")
        self.num_classes, self.global_pool, self.encoder_pool = num_classes, global_pool, encoder_pool
        self.encoder_only, self.act_layer = encoder_only, act_layer
        self.dynamic_img_size = True  # a vector per row and column: every grid up to the table's length
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 0
        self.head_dim, self.rope_theta, self.pooling_kernel_size = head_dim, rope_theta, pooling_kernel_size
        self.patch_embed = Gemma4PatchEmbed(img_size, patch_size, in_chans, embed_dim, position_embedding_size)
        self.grid = self.patch_embed.grid_size
        self.blocks = nn.ModuleList([
            Gemma4Block(embed_dim, num_heads, head_dim, intermediate_size, num_kv_heads, norm_eps, attn_drop_rate,
                        proj_drop_rate, dpr, act_layer, use_clipped_linears)
            for dpr in drop_path_rates(drop_path_rate, depth)])
        if standardize:
            self.register_buffer("std_bias", torch.zeros(embed_dim))
            self.register_buffer("std_scale", torch.ones(embed_dim))
        else:
            self.std_bias = self.std_scale = None
        self.fc_norm = RMSNorm(embed_dim, eps=norm_eps, elementwise_affine=False) if final_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @property
    def family(self) -> str:
        readout = ("the soft tokens" if self.encoder_only else "the mean soft token" if self.encoder_pool == "soft"
                   else "the mean patch token")
        return f"Gemma 4 ViT (sandwich RMSNorm blocks, 2D RoPE, {readout})"

    @property
    def timm_spec(self) -> TimmSpec:
        """timm's Gemma4VitEncoder for an encoder, else its Gemma4VitClassifier (its trunk under ``encoder.``)."""
        if self.encoder_only:
            return TimmSpec("Gemma4VitEncoder", GEMMA4_ARGS[:-3], "gemma4_vit_167m_enc",  # num_classes: 0, ignored
                            fixed={"act_layer": "gelu_tanh", "encoder_pool": "soft",
                                   "final_norm": False, "drop_rate": 0.0},
                            dropped=("encoder_only", "dynamic_img_size"), values={"global_pool": {"": "soft"}})
        return TimmSpec("Gemma4VitClassifier", GEMMA4_ARGS, "gemma4_vit_167m", fixed={"act_layer": "gelu_tanh"},
                        dropped=("encoder_only", "dynamic_img_size"), trunk_prefix="encoder.")

    @property
    def grid_multiple(self) -> int:
        """What the patch grid's sides must be multiples of: the soft-token pool's cell."""
        return self.pooling_kernel_size if self.encoder_pool == "soft" else 1

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) pixels in [0, 1] -> (B, N, D) patch tokens; ``grid`` keeps their (h, w) for the pool."""
        x = self.patch_embed(x)  # (B, h, w, D)
        B, h, w, D = x.shape
        self.grid = (h, w)
        k = self.grid_multiple
        if h % k or w % k:
            raise VitlabError(f"a {h}x{w} patch grid does not split into the soft-token pool's {k}x{k} cells; "
                              f"accepted: sides that are multiples of {k * self.patch_embed.patch_size[0]} pixels")
        rope = gemma4_rope((h, w), self.head_dim, self.rope_theta).to(x.device, x.dtype)
        x = x.reshape(B, h * w, D)
        for blk in self.blocks:
            x = blk(x, rope)
        return x

    def soft_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h * w, D) -> (B, h * w / k^2, D): the mean of each k x k cell (row-major) times sqrt(D), then
        standardised where the checkpoint says."""
        B, _, D = x.shape
        (h, w), k = self.grid, self.pooling_kernel_size
        cells = F.avg_pool2d(x.transpose(1, 2).reshape(B, D, h, w), k).flatten(2).transpose(1, 2)
        cells = cells * math.sqrt(D)
        return cells if self.std_bias is None else (cells - self.std_bias) * self.std_scale

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> the soft tokens (encoder_pool 'soft'), their mean (global_pool 'avg'), through fc_norm."""
        if self.encoder_pool == "soft":
            x = self.soft_tokens(x)
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        return self.fc_norm(x)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if self.encoder_only and num_classes:
            raise VitlabError("an encoder_only Gemma 4 ViT has no classifier; load it with encoder_only=False, "
                              "global_pool='avg', final_norm=True to fine-tune one")
        super().reset_classifier(num_classes, global_pool)
