"""Rotary position embedding (RoPE) on a patch grid, shared by EVA02 and the RoPE ViTs.

Each query and key channel pair (2i, 2i + 1) of a patch token is rotated by an angle that grows with the patch's
coordinates, so that q . k depends on the offset between the two patches. Two flavours, as timm builds them:

- axial (EVA02, ``rope_type='cat'``): half of the pairs turn with the first grid coordinate, half with the
  second, at frequencies 1 / temperature^(j / (head_dim / 4)), j < head_dim / 4 (the same in every head and
  block); EVA02 rescales coordinates to its pre-training grid (``ref_grid``);
- mixed (Heo et al. 2024, ``rope_type='mixed'``): every pair turns with a learned mix of both coordinates,
  per block and per head (``freqs``, (2, depth, heads, head_dim / 2)).

The class and register tokens are not rotated. An embedding is (..., N, 2 * head_dim): sines, then cosines,
each repeated for the two channels of its pair.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def grid_coords(grid: tuple[int, int], indexing: str = "ij", offset: float = 0.0,
                ref_grid: tuple[int, int] | None = None) -> torch.Tensor:
    """(h * w, 2) float coordinates of the patches, row-major; (row, column) for 'ij', (column, row) for 'xy'.

    ``ref_grid`` rescales them so that the grid spans the reference grid (EVA02 at another size).
    """
    h, w = grid
    ys = torch.arange(h, dtype=torch.int64).to(torch.float32) + offset
    xs = torch.arange(w, dtype=torch.int64).to(torch.float32) + offset
    if ref_grid is not None:
        ys, xs = ys / h * ref_grid[0], xs / w * ref_grid[1]
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([yy, xx] if indexing == "ij" else [xx, yy], dim=-1).reshape(-1, 2)


def sin_cos(angles: torch.Tensor) -> torch.Tensor:
    """(..., head_dim / 2) angles -> (..., 2 * head_dim): sines then cosines, each repeated for its pair."""
    sin, cos = angles.sin(), angles.cos()
    pairs = lambda t: torch.stack([t, t], dim=-1).flatten(-2)  # repeat_interleave(2, -1), which ONNX can run
    return torch.cat([pairs(sin), pairs(cos)], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]: each pair turned a quarter."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)


def apply_rope(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """Rotate (..., N, head_dim) queries or keys by a (..., N, 2 * head_dim) embedding."""
    sin, cos = emb.chunk(2, dim=-1)
    return x * cos + rotate_pairs(x) * sin


class AxialRope(nn.Module):
    """EVA02's axial RoPE: no parameters; called with a grid, the (N, 2 * head_dim) embedding."""

    def __init__(self, head_dim: int, temperature: float = 10000.0, indexing: str = "ij", offset: float = 0.0,
                 ref_grid: tuple[int, int] | None = None):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"axial RoPE needs a head width divisible by 4, got {head_dim}")
        self.head_dim, self.temperature, self.indexing, self.offset = head_dim, float(temperature), indexing, offset
        self.ref_grid = tuple(ref_grid) if ref_grid is not None else None

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        bands = self.head_dim // 4
        freqs = 1.0 / self.temperature ** (torch.arange(0, bands, dtype=torch.int64).to(torch.float32) / bands)
        coords = grid_coords(grid, self.indexing, self.offset, self.ref_grid)
        return sin_cos((coords[:, :, None] * freqs).flatten(1))  # (N, 2 coords x bands) angles


class MixedRope(nn.Module):
    """RoPE-Mixed: learned frequencies per block and head; called with a grid, (depth, heads, N, 2 * head_dim)."""

    def __init__(self, head_dim: int, depth: int, num_heads: int, temperature: float = 10.0, indexing: str = "xy"):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"mixed RoPE needs a head width divisible by 4, got {head_dim}")
        self.indexing = indexing
        # the paper's init: axial magnitudes, each head's pair of axes turned by a random angle
        mag = 1.0 / temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
        angles = torch.rand(depth, num_heads, 1) * 2 * math.pi
        fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + math.pi / 2)], dim=-1)
        fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + math.pi / 2)], dim=-1)
        self.freqs = nn.Parameter(torch.stack([fx, fy]))  # (2, depth, heads, head_dim / 2)

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        coords = grid_coords(grid, self.indexing).to(self.freqs.device)
        freqs = self.freqs.float()
        angles = coords[:, 0, None] * freqs[0].unsqueeze(-2) + coords[:, 1, None] * freqs[1].unsqueeze(-2)
        return sin_cos(angles).to(self.freqs.dtype)
