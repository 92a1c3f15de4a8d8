"""Layers shared by every vitlab model: patch embedding, attention, MLP, LayerScale, DropPath, Block.

Submodule and parameter names follow timm (``patch_embed.proj``, ``attn.qkv``, ``mlp.fc1``,
``ls1.gamma``) because those names are the checkpoint format.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError


def to_2tuple(x: int | Sequence[int]) -> tuple[int, int]:
    """An int or a pair as a pair of ints."""
    if isinstance(x, (list, tuple)):
        if len(x) != 2:
            raise VitlabError(f"expected an int or a pair (height, width), got {x!r}")
        return int(x[0]), int(x[1])
    return int(x), int(x)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x), the GELU approximation of CLIP and some Hub configs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "quick_gelu": QuickGELU,
}
ACT_ALIASES = {"swish": "silu", "gelu_python": "gelu"}  # other names of the same functions (timm, transformers)


def canonical_act(name: str) -> str:
    """An activation's name in ACTIVATIONS ('swish' -> 'silu'); unknown names are returned as they are."""
    return ACT_ALIASES.get(name, name)


def get_act_layer(name: str) -> Callable[[], nn.Module]:
    """The activation constructor for a name in ACTIVATIONS (or an alias in ACT_ALIASES)."""
    if canonical_act(name) not in ACTIVATIONS:
        raise VitlabError(f"unknown activation {name!r}; accepted: {', '.join([*ACTIVATIONS, *ACT_ALIASES])}")
    return ACTIVATIONS[canonical_act(name)]


class RMSNorm(nn.RMSNorm):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension: torch's fused kernel (its backward is one op, which
    a model of seven RMSNorms a block, Gemma 4's, needs to keep timm's training speed), written out as timm's RmsNorm
    computes it while exporting to ONNX (whose exporter has no aten::rms_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.onnx.is_in_onnx_export():
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        return x * self.weight if self.weight is not None else x


NORM_LAYERS: dict[str, type[nn.Module]] = {"layernorm": nn.LayerNorm, "rmsnorm": RMSNorm}  # timm's names


def get_norm_layer(name: str, eps: float) -> Callable[[int], nn.Module]:
    """The norm constructor (width -> module) for a name in NORM_LAYERS, at ``eps``."""
    if name not in NORM_LAYERS:
        raise VitlabError(f"norm_layer {name!r} is not one vitlab implements; accepted: {', '.join(NORM_LAYERS)}")
    return partial(NORM_LAYERS[name], eps=eps)


def check_images(x: torch.Tensor, in_chans: int, img_size: tuple[int, int], dynamic_img_size: bool) -> None:
    """ValueError unless x is (B, in_chans, H, W) at img_size (any size when dynamic_img_size)."""
    if x.ndim != 4 or x.shape[1] != in_chans:
        raise VitlabError(f"expected images of shape (B, {in_chans}, H, W), got {tuple(x.shape)}")
    if not dynamic_img_size and tuple(x.shape[-2:]) != tuple(img_size):
        raise VitlabError(f"input size {x.shape[-2]}x{x.shape[-1]} does not match the model's "
                          f"{img_size[0]}x{img_size[1]}; use img_size=... or dynamic_img_size=True")


class PatchEmbed(nn.Module):
    """Image to patch tokens with one strided convolution."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, bias=True,
                 dynamic_img_size=False, norm_layer: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        for side, (s, p) in zip(("height", "width"), zip(self.img_size, self.patch_size)):
            if s % p:
                raise VitlabError(f"image {side} {s} is not divisible by the patch size {p}; "
                                  f"use an image size that is a multiple of {p}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.dynamic_img_size = dynamic_img_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer is not None else nn.Identity()  # AIMv2's RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, h, w, D), a grid of tokens (through ``norm``, where there is one)."""
        if x.ndim != 4 or x.shape[1] != self.proj.in_channels:
            raise VitlabError(f"expected images of shape (B, {self.proj.in_channels}, H, W), got {tuple(x.shape)}")
        H, W = x.shape[-2:]
        if self.dynamic_img_size:
            if H % self.patch_size[0] or W % self.patch_size[1]:
                raise VitlabError(f"input size {H}x{W} is not divisible by the patch size "
                                  f"{self.patch_size[0]}x{self.patch_size[1]}")
        elif (H, W) != self.img_size:
            raise VitlabError(f"input size {H}x{W} does not match the model's {self.img_size[0]}x{self.img_size[1]}; "
                              "build or load the model with img_size=... or dynamic_img_size=True")
        return self.norm(self.proj(x).permute(0, 2, 3, 1))  # (B, h, w, D)


class Attention(nn.Module):
    """Multi-head self-attention: fused (scaled_dot_product_attention) or the explicit slow path.

    The slow path passes the probabilities (B, heads, N, N) through ``attn_map``, an identity
    that analysis code hooks to read them. ``qk_norm`` normalises each head's queries and keys
    (``q_norm``, ``k_norm``) before the dot product; ``proj_bias`` is the output projection's bias.
    """

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0, qk_norm=False,
                 proj_bias=True, norm_layer: Callable[[int], nn.Module] = nn.LayerNorm):
        super().__init__()
        if dim % num_heads:
            raise VitlabError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = True
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.attn_map = nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, D) -> (B, N, D); ``attn_mask`` is added to the logits (a NaFlex batch's padding, -inf-like)."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, hd) each
        q, k = self.q_norm(q), self.k_norm(k)
        return self.proj_drop(self.proj(self.attend(q, k, v, attn_mask)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, N, hd) queries, keys, values -> (B, N, H * hd): softmax(q k^T * scale + bias) v.

        ``bias`` (broadcast to (B, H, N, N)) is added to the logits (BEiT's relative position bias); the slow
        path computes the same probabilities as the fused one and passes them through ``attn_map``.
        """
        B, H, N, hd = q.shape
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, N, N)
            if bias is not None:
                attn = attn + bias
            attn = self.attn_map(attn.softmax(dim=-1))
            x = self.attn_drop(attn) @ v
        return x.transpose(1, 2).reshape(B, N, H * hd)


class Mlp(nn.Module):
    """fc1 -> activation -> dropout -> (norm, EVA02's sub-LayerNorm) -> fc2 -> dropout."""

    def __init__(self, in_features, hidden_features=None, act_layer=nn.GELU, drop=0.0, bias=True, norm_layer=None):
        super().__init__()
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class SwiGLU(nn.Module):
    """silu(gate) * x -> dropout -> (norm) -> fc2 -> dropout: EVA02's gated MLP (timm's SwiGLU, ``fc1_g`` and
    ``fc1_x``), or with ``packed=True`` one fc1 whose first half is the gate (timm's GluMlp, gate first)."""

    def __init__(self, in_features, hidden_features, drop=0.0, norm_layer=None, packed=False, act_layer=nn.SiLU,
                 bias=True):
        super().__init__()
        self.packed = packed
        if packed:
            self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias)
        else:
            self.fc1_g = nn.Linear(in_features, hidden_features, bias=bias)
            self.fc1_x = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, x = self.fc1(x).chunk(2, dim=-1) if self.packed else (self.fc1_g(x), self.fc1_x(x))
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(gate) * x))))


def init_weights_rescaled(model: nn.Module, head_init_scale: float) -> None:
    """BEiT's and EVA's init (timm's): truncated normal weights and tokens, each block's output projections
    (``attn.proj``, ``mlp.fc2``) divided by sqrt(2 (layer + 1)), the head scaled by ``head_init_scale``."""
    model.apply(init_weights_vit)
    for name in ("pos_embed", "cls_token", "reg_token"):
        if getattr(model, name, None) is not None:
            nn.init.trunc_normal_(getattr(model, name), std=0.02)
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            blk.attn.proj.weight.div_(math.sqrt(2.0 * (i + 1)))
            blk.mlp.fc2.weight.div_(math.sqrt(2.0 * (i + 1)))
        if head_init_scale and isinstance(model.head, nn.Linear):
            model.head.weight.mul_(head_init_scale)
            model.head.bias.mul_(head_init_scale)


def mlp_hidden(dim: int, mlp_ratio: float) -> int:
    """Hidden width int(dim * mlp_ratio), robust to ratios like 3072/768 written as floats."""
    return int(round(dim * mlp_ratio, 6))


class LayerScale(nn.Module):
    """A learned per-channel scale on a residual branch (CaiT), initialised small."""

    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """Stochastic depth: zero a whole sample's residual branch with probability drop_prob."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


def drop_path_rates(drop_path_rate: float, depth: int) -> list[float]:
    """Stochastic depth rising linearly from 0 at the first block to drop_path_rate at the last."""
    return [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]


class DropPath(nn.Module):
    """Stochastic depth per sample, as a module."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)), each optionally scaled.

    ``attn`` may be any token mixer with the (B, N, D) -> (B, N, D) signature (MHSA, GPSA,
    talking heads), so every family shares this block. ``proj_bias`` is the MLP's biases (the
    attention's own goes in ``attn_kwargs``, as timm's Block passes both); ``mlp_layer`` builds the MLP from
    (dim, hidden width, act_layer, drop, bias), as timm's.
    """

    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_drop=0.0, attn_drop=0.0,
                 init_values=None, drop_path=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm,
                 attn_layer: Callable[..., nn.Module] = Attention, proj_bias=True,
                 mlp_layer: Callable[..., nn.Module] | None = None, **attn_kwargs):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                               proj_drop=proj_drop, **attn_kwargs)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = (mlp_layer or Mlp)(dim, mlp_hidden(dim, mlp_ratio), act_layer=act_layer, drop=proj_drop,
                                      bias=proj_bias)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.drop_path1(self.ls1(self.attn(y) if attn_mask is None else self.attn(y, attn_mask)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def split_swiglu(dim: int, hidden: int, act_layer=nn.SiLU, drop=0.0, bias=True) -> SwiGLU:
    """timm's SwiGLU as a ViT's mlp_layer (AIMv2): gate ``fc1_g`` and value ``fc1_x``, each ``hidden`` wide."""
    return SwiGLU(dim, hidden, drop=drop, act_layer=act_layer, bias=bias)


def packed_swiglu(dim: int, hidden: int, act_layer=nn.SiLU, drop=0.0, bias=True) -> SwiGLU:
    """timm's SwiGLUPacked as a ViT's mlp_layer (DINOv2's giants): ``hidden`` is fc1's width, gate and value
    halves side by side, so fc2 reads hidden / 2."""
    if hidden % 2:
        raise VitlabError(f"a packed SwiGLU splits fc1's {hidden} outputs in two halves; accepted: an even "
                          "int(embed_dim * mlp_ratio)")
    return SwiGLU(dim, hidden // 2, drop=drop, packed=True, act_layer=act_layer, bias=bias)


class ParallelThingsBlock(nn.Module):
    """Parallel pre-norm blocks (Touvron et al. 2022, "Three things everyone should know about Vision
    Transformers"): ``num_parallel`` attention branches summed onto x, then as many MLP branches. timm's keys:
    ``attns.i.{norm,attn,ls}``, ``ffns.i.{norm,mlp,ls}``; the arguments are Block's."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_drop=0.0, attn_drop=0.0,
                 init_values=None, drop_path=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm,
                 attn_layer: Callable[..., nn.Module] = Attention, proj_bias=True, num_parallel=2, **attn_kwargs):
        super().__init__()
        self.num_parallel = num_parallel

        def branch(name: str, inner: nn.Module) -> nn.Sequential:
            return nn.Sequential(OrderedDict([
                ("norm", norm_layer(dim)), (name, inner),
                ("ls", LayerScale(dim, init_values) if init_values else nn.Identity()),
                ("drop_path", DropPath(drop_path) if drop_path > 0.0 else nn.Identity())]))

        self.attns = nn.ModuleList([branch("attn", attn_layer(dim, num_heads=num_heads, qkv_bias=qkv_bias,
                                                              attn_drop=attn_drop, proj_drop=proj_drop, **attn_kwargs))
                                    for _ in range(num_parallel)])
        self.ffns = nn.ModuleList([branch("mlp", Mlp(dim, mlp_hidden(dim, mlp_ratio), act_layer=act_layer,
                                                     drop=proj_drop, bias=proj_bias))
                                   for _ in range(num_parallel)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.stack([branch(x) for branch in self.attns]).sum(dim=0)
        return x + torch.stack([branch(x) for branch in self.ffns]).sum(dim=0)


class ParallelScalingBlock(Attention):
    """ViT-22B's parallel block (Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters"):
    one norm, one fused projection to the MLP's hidden units and to q, k, v; attention and MLP side by side, their
    outputs projected (``attn_out_proj``, ``mlp_out_proj``, or one ``out_proj`` of both), summed, scaled and added
    onto x. timm's keys: ``in_norm``, ``in_proj`` (its bias, with qkv_bias, also the MLP's; else ``mlp_bias``),
    ``q_norm``, ``k_norm``, ``ls``. It is its own attention module (``attend`` and ``attn_map``), so analyses read
    its maps as a plain ViT's; the arguments are Block's."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_drop=0.0, attn_drop=0.0,
                 init_values=None, drop_path=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm, proj_bias=True,
                 qk_norm=False, fuse_out_proj=False, attn_layer=None):
        super().__init__(dim, num_heads, attn_drop=attn_drop, qk_norm=qk_norm, norm_layer=norm_layer)
        del self.qkv, self.proj, self.proj_drop  # the fused projections below stand in for them
        hidden = mlp_hidden(dim, mlp_ratio)
        self.in_norm = norm_layer(dim)
        self.in_proj = nn.Linear(dim, hidden + 3 * dim, bias=qkv_bias)
        self.in_split = [hidden, dim, dim, dim]
        self.mlp_bias = None if qkv_bias else nn.Parameter(torch.zeros(hidden))
        self.mlp_drop = nn.Dropout(proj_drop)
        self.mlp_act = act_layer()
        self.out_proj = nn.Linear(dim + hidden, dim, bias=proj_bias) if fuse_out_proj else None
        self.attn_out_proj = None if fuse_out_proj else nn.Linear(dim, dim, bias=proj_bias)
        self.mlp_out_proj = None if fuse_out_proj else nn.Linear(hidden, dim, bias=proj_bias)
        self.ls = LayerScale(dim, init_values) if init_values is not None else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        h, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            h = h + self.mlp_bias
        q, k, v = (t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        a = self.attend(self.q_norm(q), self.k_norm(k), v)
        h = self.mlp_drop(self.mlp_act(h))
        y = self.out_proj(torch.cat((a, h), dim=-1)) if self.out_proj is not None else \
            self.attn_out_proj(a) + self.mlp_out_proj(h)
        return x + self.drop_path(self.ls(y))


ATTN_POOL_KINDS = ("siglip", "aimv2")


class AttentionPoolLatent(nn.Module):
    """Attention pooling with a learned query (SigLIP's head, timm's ``attn_pool``): tokens (B, N, D) -> (B, D).

    One latent query attends over the tokens (``q`` on the latent, ``kv`` on the tokens), then a
    projection and a pre-norm MLP with its residual. ``attn_map`` carries the probabilities
    (B, heads, 1, N) on the slow path, as in Attention. ``kind='aimv2'`` is AIMv2's head (transformers'
    Aimv2AttentionPoolingHead): the latent is the query as it is (no ``q``), keys and values take ``qkv_bias``, and
    the projection is the output (no norm, no MLP).
    """

    def __init__(self, dim, num_heads=8, mlp_ratio=4.0, qkv_bias=True, norm_layer=nn.LayerNorm, act_layer=nn.GELU,
                 kind="siglip"):
        super().__init__()
        if dim % num_heads:
            raise VitlabError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = True
        if kind not in ATTN_POOL_KINDS:
            raise VitlabError(f"attn_pool_kind {kind!r} is not one vitlab implements; accepted: "
                              f"{', '.join(ATTN_POOL_KINDS)}")
        siglip = kind == "siglip"
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim, bias=qkv_bias) if siglip else nn.Identity()
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_map = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.norm = norm_layer(dim) if siglip else None
        self.mlp = Mlp(dim, mlp_hidden(dim, mlp_ratio), act_layer=act_layer) if siglip else None
        nn.init.trunc_normal_(self.latent, std=dim ** -0.5 if siglip else 0.02)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, D) tokens -> (B, D); ``attn_mask`` (B, 1, 1, N) is added to the logits (padding left out)."""
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            logits = (q * self.scale) @ k.transpose(-2, -1)
            x = self.attn_map((logits if attn_mask is None else logits + attn_mask).softmax(dim=-1)) @ v
        x = self.proj(x.transpose(1, 2).reshape(B, 1, C))
        if self.mlp is not None:
            x = x + self.mlp(self.norm(x))
        return x[:, 0]


# ---------------------------------------------------------------------------------------------
# Position embeddings


def resample_abs_pos_embed(posemb: torch.Tensor, new_size: Sequence[int], old_size: Sequence[int] | None = None,
                           num_prefix_tokens: int = 1, interpolation: str = "bicubic",
                           antialias: bool = True) -> torch.Tensor:
    """Resample a (1, prefix + h*w, D) position embedding to a new patch grid; prefix tokens kept apart."""
    new_size = tuple(new_size) if isinstance(new_size, (list, tuple)) else to_2tuple(new_size)  # traced sizes stay
    n_grid = posemb.shape[1] - num_prefix_tokens
    if old_size is None:
        side = math.isqrt(n_grid)
        if side * side != n_grid:
            raise VitlabError(f"cannot infer the grid of a position embedding with {n_grid} patch entries; "
                              "give old_size=(h, w)")
        old_size = (side, side)
    old_size = to_2tuple(old_size)
    if old_size[0] * old_size[1] != n_grid:
        raise VitlabError(f"position embedding has {n_grid} patch entries, not a {old_size[0]}x{old_size[1]} grid")
    if tuple(old_size) == tuple(new_size):
        return posemb
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim, dtype = grid.shape[-1], grid.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_size, mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, grid], dim=1)


def resample_patch_embed(weight: torch.Tensor, new_size: int | Sequence[int], interpolation: str = "bicubic",
                         antialias: bool = True) -> torch.Tensor:
    """A (D, C, p, p) patch-embedding kernel for another patch size, by FlexiViT's pseudo-inverse resize.

    With R the resize of a patch to ``new_size`` (``F.interpolate``), the new kernel is pinv(R^T) w: a patch x
    and its resized R x give the same token, <R x, w'> = <x, w>, exactly when upsampling (least squares when
    reducing). As timm's ``resample_patch_embed`` (Beyer et al., FlexiViT, 2023).
    """
    old, new = tuple(weight.shape[-2:]), to_2tuple(new_size)
    if old == new:
        return weight
    n = old[0] * old[1]
    basis = torch.eye(n, dtype=torch.float32).reshape(n, 1, *old)
    resize = F.interpolate(basis, size=new, mode=interpolation, antialias=antialias).reshape(n, -1)  # (n, n') = R^T
    pinv = torch.linalg.pinv(resize.double())  # (n', n)
    flat = weight.detach().double().reshape(-1, n) @ pinv.T  # (D * C, n')
    return flat.reshape(*weight.shape[:2], *new).to(weight.dtype)


def sincos_2d_pos_embed(grid_size: Sequence[int], dim: int, temperature: float = 10000.0,
                        columns_first: bool = False) -> torch.Tensor:
    """Fixed 2D sin-cos embedding (MAE / "simple ViT"), (h*w, dim): half the channels encode rows, half columns
    (the columns' half first with ``columns_first``, as AIMv2-native's table)."""
    if dim % 4:
        raise VitlabError(f"a 2D sin-cos position embedding needs embed_dim divisible by 4, got {dim}")
    h, w = to_2tuple(grid_size)
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    ys = ys.flatten()[:, None] * omega[None]  # (h*w, dim/4)
    xs = xs.flatten()[:, None] * omega[None]
    if columns_first:
        ys, xs = xs, ys
    return torch.cat([ys.sin(), ys.cos(), xs.sin(), xs.cos()], dim=1)


def init_weights_vit(module: nn.Module) -> None:
    """timm's default ViT init: truncated normal (std .02) for Linear weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
