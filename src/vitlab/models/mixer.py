"""MLP-Mixer (Tolstikhin et al. 2021): the ViT with attention replaced by an MLP across the tokens.

Each block mixes the patches with one MLP applied to every channel's row of N token values
(``mlp_tokens``, weights (N * r_t, N)), then the channels with another applied to every token
(``mlp_channels``), each pre-norm and residual. There is no class token and no position embedding
(the token MLP's weights are tied to positions, so the grid size is fixed); the head reads the
mean token. timm's names (``stem.proj``, ``blocks.N.mlp_tokens.fc1``, ``norm``, ``head``) are kept.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import VitlabError
from .base import Model, TimmSpec
from .layers import DropPath, Mlp, PatchEmbed, to_2tuple

TIMM_ARGS = ("img_size", "in_chans", "patch_size", "num_blocks", "embed_dim", "mlp_ratio", "num_classes",
             "global_pool", "drop_rate", "proj_drop_rate", "drop_path_rate", "stem_norm")


class MixerBlock(nn.Module):
    """x + token-mixing MLP over the N tokens (per channel), then x + channel MLP (per token)."""

    def __init__(self, dim: int, seq_len: int, mlp_ratio=(0.5, 4.0), drop: float = 0.0, drop_path: float = 0.0):
        super().__init__()
        tokens_dim, channels_dim = (int(r * dim) for r in mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = Mlp(seq_len, tokens_dim, drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = Mlp(dim, channels_dim, drop=drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        return x + self.drop_path(self.mlp_channels(self.norm2(x)))


class PatchTokens(PatchEmbed):
    """Patch embedding that returns the (B, N, D) sequence, with timm's optional LayerNorm (``stem_norm``)."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim, stem_norm: bool = False):
        super().__init__(img_size, patch_size, in_chans, embed_dim)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if stem_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x).flatten(1, 2))  # (B, N, D)


class MlpMixer(Model):
    family = "MLP-Mixer (token-mixing MLPs, no attention)"
    global_pools = ("avg", "")
    no_weight_decay_names = ()
    num_prefix_tokens = 0
    timm_names = frozenset(f"mixer_{s}{p}_224" for s in "sbl" for p in (16, 32))
    timm_spec = TimmSpec("MlpMixer", TIMM_ARGS, "mixer_s16_224")
    hf_model_type = None
    no_hf = "an MLP-Mixer (transformers has none)"
    no_pretrain = ("its token-mixing MLP takes exactly the grid's N tokens, so an encoder cannot run on the "
                   "visible ones alone")
    fixed_size = "its token-mixing MLP is as wide as the patch grid, so the grid (and the input size) is fixed"
    no_attention = ("an MLP-Mixer mixes its tokens with a fixed MLP, not attention; its token-mixing weights are "
                    "drawn instead")

    def __init__(self, img_size=224, in_chans=3, patch_size=16, num_blocks=8, embed_dim=512, mlp_ratio=(0.5, 4.0),
                 num_classes=1000, global_pool="avg", drop_rate=0.0, proj_drop_rate=0.0, drop_path_rate=0.0,
                 stem_norm=False):
        super().__init__()
        if global_pool not in self.global_pools:
            raise VitlabError(f"global_pool {global_pool!r} is not one of {self.global_pools}")
        self.num_classes, self.global_pool = num_classes, global_pool
        self.num_features = self.embed_dim = embed_dim
        self.mlp_ratio = tuple(mlp_ratio) if isinstance(mlp_ratio, (list, tuple)) else (mlp_ratio, mlp_ratio)
        self.stem = PatchTokens(img_size, patch_size, in_chans, embed_dim, stem_norm)
        self.blocks = nn.Sequential(*[MixerBlock(embed_dim, self.stem.num_patches, self.mlp_ratio, proj_drop_rate,
                                                 drop_path_rate) for _ in range(num_blocks)])  # timm: one rate
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @property
    def patch_embed(self) -> PatchTokens:
        """The stem under the name every vitlab model's patch grid is read from."""
        return self.stem

    def init_weights(self) -> None:
        """timm's init: Xavier-uniform linears (tiny normal biases in the MLPs), a zero head, LeCun-normal stem
        (truncated normal of std sqrt(1 / fan_in), rescaled for the truncation)."""
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name.startswith("head"):
                    nn.init.zeros_(m.weight)
                    nn.init.zeros_(m.bias)
                else:
                    nn.init.xavier_uniform_(m.weight)
                    nn.init.normal_(m.bias, std=1e-6) if "mlp" in name else nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                nn.init.trunc_normal_(m.weight, std=(1.0 / fan_in) ** 0.5 / 0.8796256610342398)
                nn.init.zeros_(m.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D) tokens after the final norm."""
        return self.norm(self.blocks(self.stem(x)))

    def token_mixing_weights(self, block: int) -> torch.Tensor:
        """The first token-mixing layer of a block as maps: (hidden, grid_h, grid_w), one per hidden unit."""
        h, w = to_2tuple(self.stem.grid_size)
        return self.blocks[block].mlp_tokens.fc1.weight.detach().reshape(-1, h, w)
