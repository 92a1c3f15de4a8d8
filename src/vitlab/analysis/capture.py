"""Read the attention probabilities of every vitlab ViT family through forward hooks on ``attn_map``.

Each attention module passes its probabilities through ``attn_map`` (an ``nn.Identity``).
MHSA, class attention and SigLIP's attention-pool head only do so on their slow path, so ``fused_attn``
is switched off while capturing; GPSA and talking-heads attention always do. Everything is put back after.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import VitlabError
from ..models.cait import ClassAttn, TalkingHeadAttn
from ..models.convit import GPSA
from ..models.layers import Attention, AttentionPoolLatent

# attention module class -> block kind
ATTENTION_KINDS: dict[type[nn.Module], str] = {
    Attention: "mhsa", GPSA: "gpsa", TalkingHeadAttn: "talking_heads", ClassAttn: "class_attn",
    AttentionPoolLatent: "attn_pool"}
# kinds with one query: CaiT's class token over [cls, patches]; the attention-pool head's learned latent over every
# token (the model's readout, as the class token's row is in a ViT)
ONE_QUERY = ("class_attn", "attn_pool")
TOKENS = ("cls", "dist")  # the tokens a map can be read from


@dataclass
class AttentionMap:
    """One attention block's probabilities for a batch of images, and what its tokens are."""

    name: str  # block name in the model, e.g. "blocks.3" or "blocks_token_only.0"
    kind: str  # "mhsa" | "gpsa" | "talking_heads" | "class_attn" | "attn_pool"
    attn: torch.Tensor  # (B, heads, queries, keys); class_attn has one query, the class token; attn_pool its latent
    prefix_tokens: tuple[str, ...]  # the non-patch tokens at the start of the keys, e.g. ("cls", "dist")
    grid_size: tuple[int, int]  # patch grid (h, w): keys = len(prefix_tokens) + h * w
    patch_size: tuple[int, int] = (1, 1)  # pixels per patch (h, w)

    @property
    def num_prefix(self) -> int:
        """How many prefix (class, distillation, register) tokens the keys carry."""
        return len(self.prefix_tokens)

    @property
    def num_heads(self) -> int:
        return self.attn.shape[1]


def attention_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(block name, kind, module) of every attention module, in forward order; ValueError if there is none."""
    found = []
    for name, module in model.named_modules():
        kind = next((k for cls, k in ATTENTION_KINDS.items() if isinstance(module, cls)), None)
        if kind is not None and hasattr(module, "attn_map"):
            found.append((name.removesuffix(".attn"), kind, module))
    if not found:
        raise VitlabError(f"{type(model).__name__} has no attention: attention analyses need a Vision Transformer "
                          "(VisionTransformer/DeiT, ConVit, Cait or HybridVisionTransformer), not a CNN")
    return found


def prefix_token_names(model: nn.Module) -> list[str]:
    """Names of the model's prefix tokens in sequence order: "cls", "dist", then one "reg" per register."""
    names = []
    if getattr(model, "cls_token", None) is not None:
        names.append("cls")
    if getattr(model, "dist_token", None) is not None:
        names.append("dist")
    reg = getattr(model, "reg_token", None)
    if reg is not None:
        names += ["reg"] * reg.shape[1]
    return names


@contextmanager
def capture_attention(model: nn.Module, keep_graph: bool = False) -> Iterator[list[AttentionMap]]:
    """Within the block, each forward appends every attention block's map to the yielded list, in forward order.

    The model runs in eval mode with ``fused_attn`` off; on exit the hooks are removed and every
    flag and train/eval mode is restored. With keep_graph=True the maps stay in the autograd graph.
    """
    modules = attention_modules(model)
    prefix = prefix_token_names(model)
    patch_size = tuple(int(p) for p in model.patch_embed.patch_size)
    records: list[AttentionMap] = []
    grid: list[tuple[int, int]] = [tuple(model.patch_embed.grid_size)]
    handles = []

    def grid_hook(module, inputs, out):  # patch_embed: (B, h, w, D) -> remember the grid of this input
        grid[0] = (out.shape[1], out.shape[2])

    def make_hook(name: str, kind: str):
        def hook(module, inputs, out):  # out: (B, heads, queries, keys)
            h, w = grid[0]
            num_prefix = out.shape[-1] - h * w
            if not 0 <= num_prefix <= len(prefix):
                raise RuntimeError(f"{name}: {out.shape[-1]} keys do not fit a {h}x{w} grid with prefix {prefix}")
            attn = out if keep_graph else out.detach()
            records.append(AttentionMap(name, kind, attn, tuple(prefix[:num_prefix]), (h, w), patch_size))
        return hook

    with explicit_attention(model):
        try:
            handles.append(model.patch_embed.register_forward_hook(grid_hook))
            for name, kind, m in modules:
                handles.append(m.attn_map.register_forward_hook(make_hook(name, kind)))
            yield records
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def explicit_attention(model: nn.Module) -> Iterator[None]:
    """Within the block the model runs in eval mode with ``fused_attn`` off, so that every attention module
    passes its probabilities through ``attn_map``; flags and train/eval modes are put back on exit."""
    flags = {m: m.fused_attn for _, _, m in attention_modules(model) if hasattr(m, "fused_attn")}
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        for m in flags:
            m.fused_attn = False
        yield
    finally:
        for m, flag in flags.items():
            m.fused_attn = flag
        for m, training in modes.items():
            m.training = training


def attention_maps(model: nn.Module, images: torch.Tensor) -> list[AttentionMap]:
    """Every attention block's map for a batch of normalised images (B, C, H, W), in forward order."""
    with torch.no_grad(), capture_attention(model) as maps:
        model(images)
    return maps


def maps_of(maps_or_model: Sequence[AttentionMap] | nn.Module, images: torch.Tensor | None,
            caller: str) -> list[AttentionMap]:
    """Captured maps as given, or captured from a model on normalised images."""
    if isinstance(maps_or_model, nn.Module):
        if images is None:
            raise VitlabError(f"{caller}(model, images): images are needed when a model is given")
        return attention_maps(maps_or_model, images)
    return list(maps_or_model)


def token_index(prefix: Sequence[str], token: str) -> int | None:
    """Index of the chosen token in the full sequence, or None to average over the patch queries."""
    if token not in TOKENS:
        raise VitlabError(f"token {token!r} is not one of {TOKENS}")
    if token in prefix:
        return list(prefix).index(token)
    if token == "dist":
        raise VitlabError("token='dist' needs a distilled model (DeiT with a distillation token); "
                          f"this model's prefix tokens are {tuple(prefix) or 'none'}")
    return None  # no class token: average over patch queries
