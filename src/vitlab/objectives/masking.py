"""Random token masking, per sample, as MAE does it: a shuffle by the argsort of uniform noise.

Every sample keeps exactly ``num_visible(N, ratio)`` of its N patch tokens; ``ids_restore``
undoes the shuffle, so ``x[i, ids_shuffle[i]][ids_restore[i]] == x[i]``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import VitlabError


class Masking(NamedTuple):
    """One draw of per-sample masks over N patch tokens."""

    ids_keep: torch.Tensor  # (B, V) indices of the visible tokens, in shuffled order
    ids_restore: torch.Tensor  # (B, N) position of each token in the shuffled order (argsort of the shuffle)
    mask: torch.Tensor  # (B, N) float, 1 = masked, 0 = visible, in the original token order


def num_visible(num_tokens: int, mask_ratio: float) -> int:
    """How many of num_tokens stay visible at mask_ratio (MAE's int(N * (1 - ratio)), at least 1)."""
    if not 0.0 <= mask_ratio < 1.0:
        raise VitlabError(f"mask ratio {mask_ratio} must lie in [0, 1)")
    keep = int(num_tokens * (1.0 - mask_ratio) + 1e-6)  # 1e-6: 10 * (1 - 0.8) is 1.9999999999999996
    if keep < 1:
        raise VitlabError(f"mask ratio {mask_ratio} leaves no visible token out of {num_tokens}; "
                          f"use a ratio below {1 - 1 / num_tokens:.4f}")
    return keep


def uniform_noise(batch: int, num_tokens: int, device: torch.device | str | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, N) uniform noise, from the generator when one is given (then on its device), moved to device."""
    noise = torch.rand(batch, num_tokens, generator=generator,
                       device=generator.device if generator is not None else device)
    return noise.to(device) if device is not None else noise


def random_masking(batch: int, num_tokens: int, mask_ratio: float = 0.75, device: torch.device | str | None = None,
                   generator: torch.Generator | None = None) -> Masking:
    """Per-sample random masks: keep the num_visible tokens with the smallest noise, mask the rest."""
    keep = num_visible(num_tokens, mask_ratio)
    noise = uniform_noise(batch, num_tokens, device, generator)  # (B, N)
    ids_shuffle = noise.argsort(dim=1)  # ascending: the first `keep` are kept
    ids_restore = ids_shuffle.argsort(dim=1)  # (B, N)
    mask = torch.ones(batch, num_tokens, device=noise.device)
    mask[:, :keep] = 0
    mask = mask.gather(1, ids_restore)  # back to the original order
    return Masking(ids_shuffle[:, :keep], ids_restore, mask)


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, N, D) tokens, (B, K) indices -> (B, K, D), the tokens at those indices per sample."""
    return x.gather(1, ids[..., None].expand(-1, -1, x.shape[-1]))


def restore_tokens(x: torch.Tensor, fill: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
    """(B, V, D) visible tokens + a (1, 1, D) fill for the masked ones -> (B, N, D) in the original order."""
    B, V, D = x.shape
    N = ids_restore.shape[1]
    x = torch.cat([x, fill.to(x.dtype).expand(B, N - V, D)], dim=1)  # (B, N, D), shuffled order
    return gather_tokens(x, ids_restore)
