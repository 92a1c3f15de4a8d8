"""DINO, self-distillation with no labels (Caron et al. 2021): a student and its EMA teacher, each an encoder and a
projection head, on several crops of every image.

Each batch is cut into 2 global crops (random resized crops of 40-100% of the image, at the input size) and
``local_crops`` local crops (5-40%, at about half the input size, a whole number of patches). The teacher sees the
global crops only; the student sees them all. The teacher's output is centred (minus ``center``, an EMA of its batch
means with momentum ``center_momentum``) and sharpened (softmax at the teacher temperature, which rises linearly from
``warmup_teacher_temp`` to ``teacher_temp`` over ``teacher_temp_steps`` training steps); the student's is a
log-softmax at ``student_temp``. The loss is the cross-entropy -sum_k t_k log s_k between every teacher view and
every student view of another crop, averaged over the batch and the pairs.

The projection head is DINO's: an MLP (GELU) to a bottleneck, L2-normalised, then a weight-normalised linear layer
with ``out_dim`` outputs whose rows have norm 1 (the weight-norm gain fixed at 1).

The teacher is not trained: before each training step it moves toward the student by
teacher = m teacher + (1 - m) student, where m follows a cosine from ``momentum`` to 1 over ``momentum_steps``
training steps (and stays at 1 after). The step count, the centre and the teacher are buffers and parameters of
the objective, so a checkpoint holds them all. Flips and colour are the run's own augmentation, applied to the batch
before the crops are cut.
"""
from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from ..models.vit import VisionTransformer
from .encoder import check_encoder, run_blocks

GLOBAL_SCALE = (0.4, 1.0)  # DINO's global and local crop areas, as fractions of the image
LOCAL_SCALE = (0.05, 0.4)
RATIO = (3 / 4, 4 / 3)


class DINOOutput(NamedTuple):
    loss: torch.Tensor  # () cross-entropy between the teacher's and the student's views of different crops
    teacher: torch.Tensor  # (2, B, out_dim) teacher logits of the global crops (before centring)
    student: torch.Tensor  # (2 + local_crops, B, out_dim) student logits of every crop


def cosine_momentum(step: int, total: int, start: float) -> float:
    """DINO's teacher momentum at ``step``: 1 - (1 - start) (cos(pi step / total) + 1) / 2, and 1 from ``total`` on."""
    if step >= total:
        return 1.0
    return 1.0 - (1.0 - start) * (math.cos(math.pi * step / total) + 1.0) / 2.0


def teacher_temperature(step: int, warmup_steps: int, start: float, end: float) -> float:
    """The teacher temperature: linear from ``start`` to ``end`` over ``warmup_steps`` steps, then ``end``."""
    if step >= warmup_steps:
        return end
    return start + (end - start) * step / warmup_steps


def dino_loss(teacher: torch.Tensor, student: torch.Tensor, center: torch.Tensor, teacher_temp: float,
              student_temp: float) -> torch.Tensor:
    """(Vt, B, K) teacher and (Vs, B, K) student logits -> the mean over pairs of views (i != j, teacher view i is
    student view i) of the batch mean of -sum_k softmax((t_i - c) / tt)_k log_softmax(s_j / ts)_k."""
    t = F.softmax((teacher.float() - center) / teacher_temp, dim=-1)
    log_s = F.log_softmax(student.float() / student_temp, dim=-1)
    total, pairs = student.new_zeros((), dtype=torch.float32), 0
    for i in range(t.shape[0]):
        for j in range(log_s.shape[0]):
            if i != j:
                total = total + (-(t[i] * log_s[j]).sum(dim=-1)).mean()
                pairs += 1
    return total / pairs


def crop_size(img_size: int, patch: int, fraction: float) -> int:
    """A side ``fraction`` of ``img_size``, rounded to a whole number of patches (at least one)."""
    return max(patch, round(img_size * fraction / patch) * patch)


def random_crops(x: torch.Tensor, size: tuple[int, int], scale: tuple[float, float],
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, *size): a random resized crop of each image (area in ``scale``, aspect ratio in 3/4-4/3,
    bilinear), drawn per image on the CPU generator so that the crops are the same on any device."""
    B = x.shape[0]
    u = torch.rand(B, 4, generator=generator)
    area = scale[0] + (scale[1] - scale[0]) * u[:, 0]
    log_r = math.log(RATIO[0]) + (math.log(RATIO[1]) - math.log(RATIO[0])) * u[:, 1]
    w = (area * log_r.exp()).sqrt().clamp(max=1.0)  # fractions of the image's width and height
    h = (area / log_r.exp()).sqrt().clamp(max=1.0)
    cx = (1 - w) * (2 * u[:, 2] - 1)  # the centre, in affine_grid's [-1, 1] coordinates, inside the image
    cy = (1 - h) * (2 * u[:, 3] - 1)
    zero = torch.zeros(B)
    theta = torch.stack([torch.stack([w, zero, cx], 1), torch.stack([zero, h, cy], 1)], 1).to(x.device, x.dtype)
    grid = F.affine_grid(theta, [B, x.shape[1], *size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def pooled_features(encoder: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) images of any whole number of patches -> (B, D) the encoder's pooled features (the position
    embedding resampled to the grid)."""
    return encoder.pool(encoded_tokens(encoder, x))


def encoded_tokens(encoder: VisionTransformer, x: torch.Tensor, mask: torch.Tensor | None = None,
                   mask_token: torch.Tensor | None = None) -> torch.Tensor:
    """(B, C, H, W) images of any whole number of patches -> (B, prefix + h w, D) output tokens; with a (B, h w)
    ``mask`` (1 = masked) the masked patches' embeddings are ``mask_token`` (1, 1, D) before the position embedding."""
    grid = encoder.patch_embed.proj(x).permute(0, 2, 3, 1)  # (B, h, w, D)
    if mask is not None:
        hidden = mask.reshape(grid.shape[:3])[..., None].to(grid.dtype)
        grid = grid * (1 - hidden) + mask_token.to(grid.dtype).reshape(1, 1, 1, -1) * hidden
    return run_blocks(encoder, encoder._pos_embed(grid))


class ProjectionHead(nn.Module):
    """DINO's head: Linear-GELU-Linear-GELU-Linear to a bottleneck, L2-normalised, then a weight-normalised linear
    layer without bias whose rows are unit vectors."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, bottleneck_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.last = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.last, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.mlp(x), dim=-1)
        return F.linear(z, F.normalize(self.last, dim=-1))


class DINO(nn.Module):
    """A student encoder (``self.encoder``, the run's model) with its head, and the EMA teacher of both."""

    method = "dino"

    def __init__(self, encoder: nn.Module, out_dim: int = 1024, hidden_dim: int = 512, bottleneck_dim: int = 128,
                 local_crops: int = 4, local_size: float = 0.5, student_temp: float = 0.1,
                 teacher_temp: float = 0.07, warmup_teacher_temp: float = 0.04, teacher_temp_steps: int = 300,
                 momentum: float = 0.996, momentum_steps: int = 3000, center_momentum: float = 0.9):
        super().__init__()
        check_encoder(encoder, "dino")
        if out_dim < 2 or hidden_dim < 1 or bottleneck_dim < 1:
            raise VitlabError(f"out_dim {out_dim} must be at least 2, hidden_dim {hidden_dim} and bottleneck_dim "
                              f"{bottleneck_dim} at least 1")
        if local_crops < 0 or not 0 < local_size <= 1:
            raise VitlabError(f"local_crops {local_crops} must be >= 0 and local_size {local_size} in (0, 1]")
        if min(student_temp, teacher_temp, warmup_teacher_temp) <= 0:
            raise VitlabError("student_temp, teacher_temp and warmup_teacher_temp must be > 0")
        if not (0 <= momentum <= 1 and 0 <= center_momentum < 1) or momentum_steps < 1 or teacher_temp_steps < 0:
            raise VitlabError(f"momentum {momentum} must lie in [0, 1], center_momentum {center_momentum} in [0, 1), "
                              f"momentum_steps >= 1 and teacher_temp_steps >= 0")
        for name in ("head", "head_dist"):  # an encoder: no classifier reached
            module = getattr(encoder, name, None)
            if module is not None:
                module.requires_grad_(False)
        self.encoder: VisionTransformer = encoder
        self.local_crops, self.local_size = local_crops, local_size
        self.student_temp, self.teacher_temp, self.warmup_teacher_temp = student_temp, teacher_temp, warmup_teacher_temp
        self.teacher_temp_steps, self.momentum, self.momentum_steps = teacher_temp_steps, momentum, momentum_steps
        self.center_momentum = center_momentum
        self.head = ProjectionHead(encoder.num_features, out_dim, hidden_dim, bottleneck_dim)
        self.teacher_encoder = copy.deepcopy(encoder).requires_grad_(False)
        self.teacher_head = copy.deepcopy(self.head).requires_grad_(False)
        self.register_buffer("center", torch.zeros(out_dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # training steps taken

    def no_weight_decay(self) -> set[str]:
        return set(self.encoder.no_weight_decay())

    def train(self, mode: bool = True) -> DINO:
        super().train(mode)
        self.teacher_encoder.eval()  # the teacher never drops paths
        return self

    @torch.no_grad()
    def update_teacher(self, m: float) -> None:
        """teacher = m teacher + (1 - m) student, over the encoder's and the head's parameters."""
        for student, teacher in ((self.encoder, self.teacher_encoder), (self.head, self.teacher_head)):
            for ps, pt in zip(student.parameters(), teacher.parameters()):
                pt.mul_(m).add_(ps.detach(), alpha=1 - m)

    @torch.no_grad()
    def update_center(self, teacher: torch.Tensor, center: torch.Tensor | None = None) -> None:
        """center = c_m center + (1 - c_m) batch mean of the teacher's (V, B, K) logits (over every process);
        ``center``: another centre than the class token's (iBOT's patch tokens')."""
        center = self.center if center is None else center
        mean = teacher.float().sum(dim=(0, 1))
        count = torch.tensor(float(teacher.shape[0] * teacher.shape[1]), device=mean.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(mean)
            dist.all_reduce(count)
        center.mul_(self.center_momentum).add_(mean / count, alpha=1 - self.center_momentum)

    def crops(self, imgs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list, list]:
        """(global crops, local crops) of a batch."""
        H, W = imgs.shape[-2:]
        ph, pw = self.encoder.patch_embed.patch_size
        local = (crop_size(H, ph, self.local_size), crop_size(W, pw, self.local_size))
        g = [random_crops(imgs, (H, W), GLOBAL_SCALE, generator) for _ in range(2)]
        return g, [random_crops(imgs, local, LOCAL_SCALE, generator) for _ in range(self.local_crops)]

    def advance(self) -> int:
        """The steps taken before this one; in training, the teacher's update that follows the previous step's
        optimiser step, and one more step counted."""
        step = int(self.steps)
        if self.training:
            if step > 0:
                self.update_teacher(cosine_momentum(step - 1, self.momentum_steps, self.momentum))
            self.steps += 1
        return step

    def forward(self, imgs: torch.Tensor, generator: torch.Generator | None = None) -> DINOOutput:
        step = self.advance()
        global_crops, local_crops = self.crops(imgs, generator)
        B = imgs.shape[0]
        with torch.no_grad():
            teacher = self.teacher_head(pooled_features(self.teacher_encoder, torch.cat(global_crops)))
        student = [self.head(pooled_features(self.encoder, torch.cat(global_crops)))]
        if local_crops:
            student.append(self.head(pooled_features(self.encoder, torch.cat(local_crops))))
        student = torch.cat(student).reshape(2 + self.local_crops, B, -1)
        teacher = teacher.reshape(2, B, -1)
        temp = teacher_temperature(step, self.teacher_temp_steps, self.warmup_teacher_temp, self.teacher_temp)
        loss = dino_loss(teacher, student, self.center, temp, self.student_temp)
        if self.training:
            self.update_center(teacher)
        return DINOOutput(loss, teacher, student)
