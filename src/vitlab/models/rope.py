"""Rotary position embedding (RoPE) on a patch grid, shared by EVA02, the RoPE ViTs and DINOv3.

Each query and key channel pair (2i, 2i + 1) of a patch token is rotated by an angle that grows with the patch's
coordinates, so that q . k depends on the offset between the two patches. Three flavours, as timm builds them:

- axial (EVA02, ``rope_type='cat'``): half of the pairs turn with the first grid coordinate, half with the
  second, at frequencies 1 / temperature^(j / (head_dim / 4)), j < head_dim / 4 (the same in every head and
  block); EVA02 rescales coordinates to its pre-training grid (``ref_grid``);
- mixed (Heo et al. 2024, ``rope_type='mixed'``): every pair turns with a learned mix of both coordinates,
  per block and per head (``freqs``, (2, depth, heads, head_dim / 2));
- centred (DINOv3, ``rope_type='dinov3'``): axial, on the patch centres normalised to [-1, 1] whatever the
  grid (coordinates (i + 0.5) / h * 2 - 1), at angles 2 pi x / temperature^(4 j / head_dim), so that every
  input size spans the same range.

The class and register tokens are not rotated. An embedding is (..., N, 2 * head_dim): sines, then cosines.
Two channel layouts, as timm's ``rope_rotate_half``: interleaved (each angle repeated for the channels 2i and
2i + 1 of its pair) or half (channel i paired with i + head_dim / 2, the angles written twice over).
In training, the coordinates may be shifted (uniform in [-s, s]), scaled per axis (log-uniform in [1/J, J])
and scaled together (log-uniform in [1/R, R]): DINOv3's augmentation, timm's ``rope_{shift,jitter,rescale}_coords``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import VitlabError


def grid_coords(grid: tuple[int, int], indexing: str = "ij", offset: float = 0.0,
                ref_grid: tuple[int, int] | None = None, centered: bool = False) -> torch.Tensor:
    """(h * w, 2) float coordinates of the patches, row-major; (row, column) for 'ij', (column, row) for 'xy'.

    ``ref_grid`` rescales them so that the grid spans the reference grid (EVA02 at another size); ``centered``
    gives the patch centres over each side's length, mapped to [-1, 1] (DINOv3).
    """
    h, w = grid
    if centered:
        ys = (torch.arange(0.5, h, dtype=torch.float32) + offset) / h
        xs = (torch.arange(0.5, w, dtype=torch.float32) + offset) / w
    else:
        ys = torch.arange(h, dtype=torch.int64).to(torch.float32) + offset
        xs = torch.arange(w, dtype=torch.int64).to(torch.float32) + offset
    if ref_grid is not None:
        ys, xs = ys / h * ref_grid[0], xs / w * ref_grid[1]
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    coords = torch.stack([yy, xx] if indexing == "ij" else [xx, yy], dim=-1).reshape(-1, 2)
    return 2.0 * coords - 1.0 if centered else coords


@dataclass(frozen=True)
class CoordAugment:
    """Training-time changes of the rotary coordinates (None: off): a shift uniform in [-shift, shift] per axis,
    a scale log-uniform in [1/jitter, jitter] per axis, then one log-uniform in [1/rescale, rescale] for both."""

    shift: float | None = None
    jitter: float | None = None
    rescale: float | None = None

    def __post_init__(self):
        for name, low in (("shift", 0.0), ("jitter", 1.0), ("rescale", 1.0)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
                raise VitlabError(f"rope_{name}_coords={value!r} is not valid; accepted: a finite number >= {low:g}, "
                                  "or None (off)")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.shift, self.jitter, self.rescale))

    def __call__(self, coords: torch.Tensor) -> torch.Tensor:
        """(N, 2) coordinates -> one random transform of them, the same for every patch."""
        axes = coords.shape[-1]
        if self.shift is not None:
            coords = coords + torch.empty(axes, dtype=coords.dtype).uniform_(-self.shift, self.shift)
        if self.jitter is not None:
            span = math.log(self.jitter)
            coords = coords * torch.empty(axes, dtype=coords.dtype).uniform_(-span, span).exp()
        if self.rescale is not None:
            span = math.log(self.rescale)
            coords = coords * torch.empty(1, dtype=coords.dtype).uniform_(-span, span).exp()
        return coords


def sin_cos(angles: torch.Tensor, half: bool = False) -> torch.Tensor:
    """(..., head_dim / 2) angles -> (..., 2 * head_dim): sines then cosines, each repeated for its pair
    (interleaved), or each written twice over (``half``)."""
    sin, cos = angles.sin(), angles.cos()
    if half:
        return torch.cat([sin, sin, cos, cos], dim=-1)
    pairs = lambda t: torch.stack([t, t], dim=-1).flatten(-2)  # repeat_interleave(2, -1), which ONNX can run
    return torch.cat([pairs(sin), pairs(cos)], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]: each pair turned a quarter."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)


def rotate_halves(x: torch.Tensor) -> torch.Tensor:
    """[x0, .., x(d/2 - 1), x(d/2), .., x(d - 1)] -> [-x(d/2), .., -x(d - 1), x0, .., x(d/2 - 1)]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, emb: torch.Tensor, half: bool = False) -> torch.Tensor:
    """Rotate (..., N, head_dim) queries or keys by a (..., N, 2 * head_dim) embedding of the same layout;
    computed in the embedding's precision, returned in x's."""
    sin, cos = emb.chunk(2, dim=-1)
    return (x * cos + (rotate_halves(x) if half else rotate_pairs(x)) * sin).to(x.dtype)


class AxialRope(nn.Module):
    """EVA02's axial RoPE: no parameters; called with a grid, the (N, 2 * head_dim) embedding."""

    centered = False  # coordinates: patch indices (EVA02), or patch centres in [-1, 1] (DINOv3)

    def __init__(self, head_dim: int, temperature: float = 10000.0, indexing: str = "ij", offset: float = 0.0,
                 ref_grid: tuple[int, int] | None = None, half: bool = False, augment: CoordAugment = CoordAugment()):
        super().__init__()
        if head_dim % 4:
            raise VitlabError(f"axial RoPE needs a head width divisible by 4, got {head_dim}")
        self.head_dim, self.temperature, self.indexing, self.offset = head_dim, float(temperature), indexing, offset
        self.ref_grid = tuple(ref_grid) if ref_grid is not None else None
        self.half, self.augment = half, augment

    def coords(self, grid: tuple[int, int]) -> torch.Tensor:
        """(N, 2) coordinates of the grid's patches, changed by ``augment`` in training."""
        coords = grid_coords(grid, self.indexing, self.offset, self.ref_grid, self.centered)
        return self.augment(coords) if self.training and self.augment.active else coords

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        bands = self.head_dim // 4
        freqs = 1.0 / self.temperature ** (torch.arange(0, bands, dtype=torch.int64).to(torch.float32) / bands)
        return sin_cos((self.coords(grid)[:, :, None] * freqs).flatten(1), self.half)  # (N, 2 coords x bands)


class CenteredRope(AxialRope):
    """DINOv3's RoPE (timm's RotaryEmbeddingDinoV3): axial, on patch centres in [-1, 1]; no parameters."""

    centered = True

    def __init__(self, head_dim: int, temperature: float = 100.0, indexing: str = "ij", offset: float = 0.0,
                 half: bool = True, augment: CoordAugment = CoordAugment()):
        super().__init__(head_dim, temperature, indexing, offset, None, half, augment)

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        bands = self.head_dim // 4
        periods = self.temperature ** (2.0 * torch.arange(bands, dtype=torch.float32) / (self.head_dim // 2))
        return sin_cos((2 * math.pi * self.coords(grid)[:, :, None] / periods).flatten(1), self.half)


class MixedRope(nn.Module):
    """RoPE-Mixed: learned frequencies per block and head; called with a grid, (depth, heads, N, 2 * head_dim)."""

    def __init__(self, head_dim: int, depth: int, num_heads: int, temperature: float = 10.0, indexing: str = "xy",
                 augment: CoordAugment = CoordAugment()):
        super().__init__()
        if head_dim % 4:
            raise VitlabError(f"mixed RoPE needs a head width divisible by 4, got {head_dim}")
        self.indexing, self.augment = indexing, augment
        # the paper's init: axial magnitudes, each head's pair of axes turned by a random angle
        mag = 1.0 / temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
        angles = torch.rand(depth, num_heads, 1) * 2 * math.pi
        fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + math.pi / 2)], dim=-1)
        fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + math.pi / 2)], dim=-1)
        self.freqs = nn.Parameter(torch.stack([fx, fy]))  # (2, depth, heads, head_dim / 2)

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        coords = grid_coords(grid, self.indexing)
        if self.training and self.augment.active:
            coords = self.augment(coords)
        coords, freqs = coords.to(self.freqs.device), self.freqs.float()
        angles = coords[:, 0, None] * freqs[0].unsqueeze(-2) + coords[:, 1, None] * freqs[1].unsqueeze(-2)
        return sin_cos(angles).to(self.freqs.dtype)
