"""NaFlex ViT (SigLIP 2, Tschannen et al. 2025; timm's NaFlexVit): a ViT whose patches are embedded by one linear
layer on flattened pixels, so a batch may mix images of different aspect ratios and sizes.

A NaFlex batch holds each image as its own grid of patches, row-major and padded to one length: ``patches``
(B, N, ph * pw * C) flattened as (ph, pw, C), which rows are real (``patch_valid``, B x N), and each image's grid
(h, w). The learned position table (gh, gw) is resized to each image's grid; attention and pooling leave the
padding out through an additive mask. Plain (B, C, H, W) images are the same model at one grid for the batch.

Submodule names are timm's (``embeds.proj``, ``embeds.pos_embed``, ``embeds.reg_token``, ``blocks``, ``attn_pool``),
which are its checkpoint format; transformers' Siglip2VisionModel is read into it by ``interop.hf_siglip2``.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec
from .layers import (
    Attention,
    Block,
    drop_path_rates,
    get_act_layer,
    init_weights_vit,
    to_2tuple,
)
from .vit import add_output_layers

POS_EMBEDS = ("learned", "factorized", "none")
GLOBAL_POOLS = ("map", "avg", "token", "")
INTERPOLATIONS = ("bilinear", "bicubic")
NORM_EPS = 1e-6  # timm's LayerNorm and transformers' SigLIP 2 default
# the arguments timm's NaFlexVit takes with vitlab's names and meaning
TIMM_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "mlp_ratio", "qkv_bias", "qk_norm", "proj_bias", "init_values", "class_token", "reg_tokens", "pos_embed",
             "pos_embed_grid_size", "pos_embed_interp_mode", "pos_embed_ar_preserving", "pos_embed_antialias",
             "pos_embed_align_corners", "final_norm", "fc_norm", "act_layer", "use_key_only_attn_mask", "drop_rate",
             "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")
NAFLEX_KEYS = {"hf": ("pixel_values", "pixel_attention_mask", "spatial_shapes"),
               "timm": ("patches", "patch_valid", "patch_coord")}


def patchify(x: torch.Tensor, patch_size: tuple[int, int]) -> torch.Tensor:
    """(B, C, H, W) images -> (B, h, w, ph * pw * C) patches, each flattened as (ph, pw, C) (SigLIP 2's processor
    and timm's batch_patchify)."""
    B, C, H, W = x.shape
    ph, pw = patch_size
    if H % ph or W % pw:
        raise VitlabError(f"input size {H}x{W} is not divisible by the patch size {ph}x{pw}")
    x = x.reshape(B, C, H // ph, ph, W // pw, pw).permute(0, 2, 4, 3, 5, 1)  # (B, h, w, ph, pw, C)
    return x.reshape(B, H // ph, W // pw, ph * pw * C)


def naflex_size(height: int, width: int, patch: int, max_patches: int) -> tuple[int, int]:
    """The size SigLIP 2's processor resizes an image to: the largest scale (found by bisection to 1e-5) at which
    both sides, each rounded up to whole patches (one at least), make at most ``max_patches`` patches."""
    def side(scale: float, n: int) -> int:
        return max(patch, math.ceil(n * scale / patch) * patch)

    lo, hi = 1e-6, 100.0
    while hi - lo >= 1e-5:
        mid = (lo + hi) / 2
        if side(mid, height) * side(mid, width) <= max_patches * patch * patch:
            lo = mid
        else:
            hi = mid
    return side(lo, height), side(lo, width)


def naflex_batch(images: list[torch.Tensor], patch_size: int = 16, max_patches: int = 256) -> dict[str, torch.Tensor]:
    """A NaFlex batch of (C, H, W) float images of any sizes, as SigLIP 2's processor builds it (transformers' keys):
    each image resized, keeping its aspect ratio, to at most ``max_patches`` patches (bilinear, antialiased),
    cut into patches flattened as (ph, pw, C), padded with zeros to ``max_patches``. Normalise the images first."""
    if not images or any(img.ndim != 3 for img in images):
        raise VitlabError("naflex_batch takes a non-empty list of (C, H, W) images")
    values, masks, shapes = [], [], []
    for img in images:
        size = naflex_size(img.shape[-2], img.shape[-1], patch_size, max_patches)
        if tuple(img.shape[-2:]) != size:
            img = F.interpolate(img[None].float(), size=size, mode="bilinear", align_corners=False, antialias=True)[0]
        patches = patchify(img[None], (patch_size, patch_size))[0]  # (h, w, K)
        h, w, k = patches.shape
        values.append(torch.cat([patches.reshape(h * w, k), patches.new_zeros(max_patches - h * w, k)]))
        masks.append(torch.arange(max_patches) < h * w)
        shapes.append((h, w))
    return {"pixel_values": torch.stack(values), "pixel_attention_mask": torch.stack(masks).int(),
            "spatial_shapes": torch.tensor(shapes)}


def naflex_inputs(x: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """(patches (B, N, K), valid (B, N) bool, each image's grid (h, w)) of a NaFlex batch in transformers' keys
    (pixel_values, pixel_attention_mask, spatial_shapes) or timm's (patches, patch_valid, patch_coord)."""
    for kind, (patches, valid, where) in NAFLEX_KEYS.items():
        if patches in x:
            missing = [k for k in (valid, where) if k not in x]
            if missing:
                raise VitlabError(f"a NaFlex batch in {kind}'s keys lacks {', '.join(missing)}; accepted: "
                                  f"{', '.join((patches, valid, where))}")
            p, v, w = x[patches], x[valid], torch.as_tensor(x[where])
            if p.ndim != 3 or v.shape != p.shape[:2]:
                raise VitlabError(f"a NaFlex batch's {patches} is {tuple(p.shape)} and {valid} "
                                  f"{tuple(v.shape)}; accepted: (B, N, patch * patch * channels) and (B, N)")
            shapes = w.amax(dim=1) + 1 if kind == "timm" else w  # timm: each patch's (row, column)
            return p, v.bool(), [(int(h), int(w_)) for h, w_ in shapes.tolist()]
    raise VitlabError(f"a NaFlex batch holds {', '.join(map(repr, x))}; accepted: "
                      + " or ".join(", ".join(keys) for keys in NAFLEX_KEYS.values()))


def padding_mask(valid: torch.Tensor, prefix: int, key_only: bool, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask of a NaFlex batch (0 where attended, the dtype's lowest value elsewhere): the padding
    as keys (B, 1, 1, L) with ``key_only``, else every pair with a padded end (B, 1, L, L), as timm's
    create_attention_mask; prefix tokens are always real."""
    valid = torch.cat([valid.new_ones(valid.shape[0], prefix), valid], dim=1)
    keep = valid[:, None, None, :] if key_only else valid[:, None, :, None] & valid[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=valid.device).masked_fill_(~keep, torch.finfo(dtype).min)


class NaFlexEmbeds(nn.Module):
    """timm's ``embeds``: the linear patch projection ``proj``, the prefix tokens and the position table (learned
    (1, gh, gw, D), or factorized rows and columns ``pos_embed_y``/``pos_embed_x``). Its forward embeds images
    into a grid (B, h, w, D); the model adds the position entries."""

    dynamic_img_size = True  # any size divisible by the patch

    def __init__(self, img_size, patch_size, in_chans, embed_dim, pos_embed, grid_size, class_token, reg_tokens,
                 bias=True):
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.pos_embed_grid_size = to_2tuple(grid_size)  # the position table's grid
        self.img_size = to_2tuple(img_size) if img_size else tuple(g * p for g, p in zip(self.pos_embed_grid_size,
                                                                                        self.patch_size))
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Linear(self.patch_size[0] * self.patch_size[1] * in_chans, embed_dim, bias=bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        gh, gw = self.pos_embed_grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, gh, gw, embed_dim)) if pos_embed == "learned" else None
        self.pos_embed_y = nn.Parameter(torch.zeros(1, gh, embed_dim)) if pos_embed == "factorized" else None
        self.pos_embed_x = nn.Parameter(torch.zeros(1, gw, embed_dim)) if pos_embed == "factorized" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, h, w, D) patch tokens."""
        if x.ndim != 4 or x.shape[1] * self.patch_size[0] * self.patch_size[1] != self.proj.in_features:
            chans = self.proj.in_features // (self.patch_size[0] * self.patch_size[1])
            raise VitlabError(f"expected images of shape (B, {chans}, H, W), got {tuple(x.shape)}")
        return self.proj(patchify(x, self.patch_size))

    def conv_weight(self) -> torch.Tensor:
        """``proj``'s weight as the (D, C, ph, pw) filters of the equivalent strided convolution."""
        (ph, pw), D = self.patch_size, self.proj.out_features
        return self.proj.weight.reshape(D, ph, pw, -1).permute(0, 3, 1, 2)


class NaFlexVit(Model):
    """timm's NaFlexVit (and SigLIP 2's image tower): ``forward_features`` takes (B, C, H, W) images or a NaFlex
    batch (a dict, see the module's docstring); on a NaFlex batch it returns {"patches": tokens, "patch_valid":
    valid} as timm does, which ``forward_head`` pools with the padding left out.

    ``pos_embed_interp_mode`` (bilinear for SigLIP 2, with ``pos_embed_antialias``) resizes the table to each grid;
    ``pos_embed_ar_preserving`` resizes it to a square of the longer side and crops (RADIO: a 128 x 128 table,
    without antialiasing, some with ``pos_embed_align_corners``). ``use_key_only_attn_mask``
    masks padded keys only (transformers' SigLIP 2), else every pair with a padded end (timm's default);
    ``pos_embed_pad_first`` gives padded tokens the first patch's position entry (transformers') instead of none.
    Neither changes a real token's output or the pooled one.
    """

    any_input_size = True  # every grid, every aspect ratio: its table is resized to each image's
    no_weight_decay_names = ("embeds.pos_embed", "embeds.pos_embed_y", "embeds.pos_embed_x", "embeds.cls_token",
                             "embeds.reg_token", "pos_embed", "cls_token", "reg_token")
    no_pretrain = ("MAE and MPP embed patches with a convolution over a fixed grid; the NaFlex ViT's linear "
                   "embedding of flattened patches is not wired into them")
    timm_names = frozenset(
        [f"naflexvit_base_patch16_{k}" for k in ("gap", "par_gap", "parfac_gap", "map", "siglip")]
        + [f"naflexvit_so150m2_patch16_reg1_{k}" for k in ("gap", "map")] + ["naflexvit_so400m_patch16_siglip"]
        + [f"naflexvit_{s}_patch16_radio_v3" for s in ("base", "large", "huge", "giant")]
        + [f"naflexvit_{s}_patch16_radio_v4" for s in ("so400m", "huge")])

    @property
    def family(self) -> str:
        return "NaFlex ViT (linear patch embedding, variable aspect ratio)"

    @property
    def hf_model_type(self) -> str | None:
        return "siglip2_vision_model" if not self.hf_missing() else None

    @property
    def no_hf(self) -> str:
        return f"a NaFlex ViT with {', '.join(self.hf_missing())} (SigLIP 2's Siglip2VisionModel has none)"

    def hf_missing(self) -> list[str]:
        """What of this model transformers' Siglip2VisionModel cannot express (its head checked on export)."""
        e, blk = self.embeds, self.blocks[0]
        table = e.pos_embed
        checks = (("prefix tokens", self.num_prefix_tokens > 0),
                  ("a factorized or no position table", table is None),
                  ("a non-square position table", table is not None and table.shape[1] != table.shape[2]),
                  ("non-square patches", e.patch_size[0] != e.patch_size[1]),
                  ("a table resized other than bilinear with antialiasing, corners not aligned",
                   (self.pos_embed_interp_mode, self.pos_embed_antialias, self.pos_embed_align_corners,
                    self.pos_embed_ar_preserving) != ("bilinear", True, False, False)),
                  ("pooling other than the attention pool", self.global_pool != "map"),
                  ("LayerScale", not isinstance(blk.ls1, nn.Identity)),
                  ("qk_norm", not isinstance(blk.attn.q_norm, nn.Identity)),
                  ("layers without biases", blk.attn.qkv.bias is None or blk.attn.proj.bias is None),
                  ("no final norm", isinstance(self.norm, nn.Identity)))
        return [what for what, present in checks if present]

    @property
    def timm_spec(self) -> TimmSpec:
        siglip = self.pos_embed_interp_mode == "bilinear"
        return TimmSpec("NaFlexVit", TIMM_ARGS, "naflexvit_base_patch16_siglip" if siglip else
                        "naflexvit_base_patch16_gap", fixed={"norm_eps": NORM_EPS},
                        dropped=("pos_embed_pad_first", "dynamic_img_size"))  # padded tokens' own outputs, read by
                                                                              # nothing; timm's takes any size

    def __init__(self, img_size=None, patch_size=16, in_chans=3, num_classes=1000, global_pool="map", embed_dim=768,
                 depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, qk_norm=False, proj_bias=True, init_values=None,
                 class_token=False, reg_tokens=0, pos_embed="learned", pos_embed_grid_size=(16, 16),
                 pos_embed_interp_mode="bicubic", pos_embed_ar_preserving=False, pos_embed_antialias=True,
                 pos_embed_align_corners=False, final_norm=True, fc_norm=None, act_layer="gelu", norm_eps=NORM_EPS,
                 use_key_only_attn_mask=False, pos_embed_pad_first=False, dynamic_img_size=True, drop_rate=0.0,
                 pos_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0):
        super().__init__()
        for name, value, accepted in (("global_pool", global_pool, GLOBAL_POOLS), ("pos_embed", pos_embed, POS_EMBEDS),
                                      ("pos_embed_interp_mode", pos_embed_interp_mode, INTERPOLATIONS)):
            if value not in accepted:
                raise VitlabError(f"{name} {value!r} is not accepted; accepted: {', '.join(map(repr, accepted))}")
        if not dynamic_img_size:
            raise VitlabError("a NaFlex ViT takes every input size its patch divides; accepted: dynamic_img_size=True")
        if global_pool == "token" and not class_token:
            raise VitlabError("global_pool='token' needs a class token; accepted: class_token=True, or another pool")
        norm_layer = partial(nn.LayerNorm, eps=norm_eps)
        use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm
        self.num_classes, self.global_pool = num_classes, global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = int(class_token) + reg_tokens
        self.pos_embed_interp_mode, self.pos_embed_antialias = pos_embed_interp_mode, pos_embed_antialias
        self.pos_embed_ar_preserving, self.pos_embed_align_corners = pos_embed_ar_preserving, pos_embed_align_corners
        self.use_key_only_attn_mask, self.pos_embed_pad_first = use_key_only_attn_mask, pos_embed_pad_first
        self.dynamic_img_size = True
        self.embeds = NaFlexEmbeds(img_size, patch_size, in_chans, embed_dim, pos_embed, pos_embed_grid_size,
                                   class_token, reg_tokens)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dpr = drop_path_rates(drop_path_rate, depth)
        act = get_act_layer(act_layer)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, init_values=init_values, drop_path=dpr[i], act_layer=act,
                  norm_layer=norm_layer, proj_bias=proj_bias,
                  attn_layer=partial(Attention, qk_norm=qk_norm, proj_bias=proj_bias, norm_layer=norm_layer))
            for i in range(depth)])
        add_output_layers(self, num_heads, mlp_ratio, norm_layer, act, final_norm and not use_fc_norm,
                          final_norm and use_fc_norm, drop_rate)
        self.init_weights()

    def init_weights(self) -> None:
        """timm's: truncated normal Linear weights, position tables N(0, 0.02), prefix tokens N(0, 1e-6)."""
        self.apply(init_weights_vit)
        e = self.embeds
        for table in (e.pos_embed, e.pos_embed_y, e.pos_embed_x):
            if table is not None:
                nn.init.normal_(table, std=0.02)
        for token in (e.cls_token, e.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)

    # the analyses' names for the pieces timm keeps under ``embeds``
    patch_embed = property(lambda self: self.embeds)
    pos_embed = property(lambda self: self.embeds.pos_embed)  # (1, gh, gw, D) on its own grid
    cls_token = property(lambda self: self.embeds.cls_token)
    reg_token = property(lambda self: self.embeds.reg_token)

    def _resize(self, table: torch.Tensor, size: int, mode: str) -> torch.Tensor:
        """(1, L, D) or (1, gh, gw, D) table -> the same at ``size`` along its grid axes (channels last)."""
        grid = table.float().movedim(-1, 1)
        if tuple(grid.shape[2:]) != tuple(size):
            plain = mode == "linear"  # timm's factorized tables: plain linear, corners not aligned
            grid = F.interpolate(grid, size=size, mode=mode, align_corners=self.pos_embed_align_corners and not plain,
                                 antialias=self.pos_embed_antialias and not plain)
        return grid.movedim(1, -1)

    def grid_pos_embed(self, size: tuple[int, int]) -> torch.Tensor | None:
        """The position entries of an (h, w) grid, (h * w, D), row-major; None without a table."""
        e, (h, w) = self.embeds, size
        side = (max(h, w),) * 2 if self.pos_embed_ar_preserving else (h, w)  # a square, cropped to the grid
        if e.pos_embed is not None:
            pos = self._resize(e.pos_embed, side, self.pos_embed_interp_mode)[0, :h, :w]
        elif e.pos_embed_y is not None:
            ys = self._resize(e.pos_embed_y, side[:1], "linear")[0, :h]
            xs = self._resize(e.pos_embed_x, side[1:], "linear")[0, :w]
            pos = ys[:, None] + xs[None, :]
        else:
            return None
        return pos.reshape(h * w, -1)

    def _prefix(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) patch tokens -> (B, prefix + N, D), then the position dropout."""
        prefix = [t.expand(len(x), -1, -1) for t in (self.embeds.cls_token, self.embeds.reg_token) if t is not None]
        return self.pos_drop(torch.cat(prefix + [x], dim=1))

    def _naflex_pos_embed(self, x: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        """Each image's resized table on its first h * w tokens (the padding: the first entry, or none)."""
        out = torch.zeros_like(x)
        for size in dict.fromkeys(shapes):  # each grid resized once
            pos = self.grid_pos_embed(size)
            if pos is None:
                return x
            rows = [b for b, s in enumerate(shapes) if s == size]
            n = min(x.shape[1], len(pos))
            out[rows, :n] = pos[:n].to(x.dtype)
            if self.pos_embed_pad_first:
                out[rows, n:] = pos[0].to(x.dtype)
        return x + out

    def forward_features(self, x: torch.Tensor | dict[str, Any]) -> torch.Tensor | dict[str, torch.Tensor]:
        """(B, C, H, W) images -> (B, prefix + N, D) tokens after the final norm; a NaFlex batch ->
        {"patches": (B, prefix + N, D), "patch_valid": (B, N)}."""
        if not isinstance(x, dict):
            grid = self.embeds(x)  # (B, h, w, D)
            B, h, w, D = grid.shape
            x = grid.reshape(B, h * w, D)
            pos = self.grid_pos_embed((h, w))
            x = self._prefix(x if pos is None else x + pos.to(x.dtype))
            return self.norm(self.blocks(x))
        patches, valid, shapes = naflex_inputs(x)
        if patches.shape[-1] != self.embeds.proj.in_features:
            raise VitlabError(f"NaFlex patches of {patches.shape[-1]} values; accepted: "
                              f"{self.embeds.proj.in_features} "
                              f"(patch {self.embeds.patch_size}, flattened as ph, pw, C)")
        tokens = self._naflex_pos_embed(self.embeds.proj(patches.to(self.embeds.proj.weight.dtype)), shapes)
        tokens = self._prefix(tokens)
        mask = padding_mask(valid, self.num_prefix_tokens, self.use_key_only_attn_mask, tokens.dtype)
        for blk in self.blocks:
            tokens = blk(tokens, attn_mask=mask)
        return {"patches": self.norm(tokens), "patch_valid": valid}

    def pool(self, x: torch.Tensor, patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens -> (B, D) through fc_norm: the attention pool, the mean patch token or the class token, the padding
        of a NaFlex batch (``patch_valid``) left out."""
        patches = x[:, self.num_prefix_tokens:]
        if self.global_pool == "map":
            mask = None if patch_valid is None else padding_mask(patch_valid, 0, True, x.dtype)
            return self.fc_norm(self.attn_pool(patches, attn_mask=mask))
        if self.global_pool == "avg" and patch_valid is not None:
            weights = patch_valid.to(x.dtype)[..., None]
            return self.fc_norm((patches * weights).sum(1) / weights.sum(1).clamp(min=1))
        return self.fc_norm(super().pool(x)) if self.global_pool else x

    def forward_head(self, x: torch.Tensor | dict[str, torch.Tensor], pre_logits: bool = False) -> torch.Tensor:
        """forward_features' output (tokens, or a NaFlex batch's dict) -> logits (or the pooled features)."""
        pooled = self.pool(x["patches"], x["patch_valid"]) if isinstance(x, dict) else self.pool(x)
        pooled = self.head_drop(pooled)
        return pooled if pre_logits else self.head(pooled)
