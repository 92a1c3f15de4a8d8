"""Feature distillation from a frozen backbone: a student encoder learns to reproduce a teacher's features on
unlabelled images, as LightlyTrain's distillation pre-trains a small model from a large one.

The teacher (any model ``vitlab.load`` reads) sees the student's batch at its own input size and normalisation: the
student's normalised images are brought back to [0, 1], to the teacher's channels, resized (bicubic) to the
teacher's input size and normalised with the teacher's mean and std. It runs frozen, in eval mode, under
``torch.inference_mode`` (in bf16 where the run decides it pays for the teacher). Two small heads on the student
map its features to the teacher's width: one its pooled feature onto the teacher's pooled (pre-logits) feature, one
each patch token onto the teacher's patch feature at that place, the teacher's grid of patch features resampled
(bilinear) to the student's grid. The loss is ``pooled + patch_weight x patch``, each 1 - cosine similarity averaged
over the images (and patches), or with ``loss='smooth_l1'`` the smooth L1 distance to the teacher's features
standardised per vector (layer norm without a gain).

The teacher is not part of the objective's state: the run keeps its folder (and the sha256 of its files), the
objective only the facts about it that build the heads (``teacher_dim``, ``teacher_patch_dim``) and show the batch as
the teacher sees it (``teacher_mean``, ``teacher_std``, ``teacher_size``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from ..models.groups import patch_embedding
from ..models.vit import VisionTransformer
from .encoder import check_encoder, no_weight_decay, output_norm, set_aside_head


class DistillOutput(NamedTuple):
    loss: torch.Tensor  # () pooled + patch_weight x patch loss
    pooled: torch.Tensor  # () the pooled features' loss
    patch: torch.Tensor  # () the patch features' loss


def feature_head(in_dim: int, out_dim: int, hidden_dim: int) -> nn.Module:
    """A linear map, or with hidden_dim an MLP (Linear-GELU-Linear), from the student's width to the teacher's."""
    if not hidden_dim:
        return nn.Linear(in_dim, out_dim)
    return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, out_dim))


def feature_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """(..., D) student and teacher features -> the mean over vectors of 1 - cos(s, t) ('cosine'), or of the smooth
    L1 distance to the teacher's vectors standardised each ('smooth_l1')."""
    s, t = student.float(), teacher.float()
    if kind == "cosine":
        return (1 - F.cosine_similarity(s, t, dim=-1)).mean()
    return F.smooth_l1_loss(s, F.layer_norm(t, t.shape[-1:]))


def teacher_view(x: torch.Tensor, mean: Sequence[float], std: Sequence[float], teacher_mean: Sequence[float],
                 teacher_std: Sequence[float], teacher_size: Sequence[int]) -> torch.Tensor:
    """(B, C, H, W) images normalised by (mean, std) -> as the teacher takes them: ``teacher_size`` (C, H, W),
    normalised by (teacher_mean, teacher_std); grey to colour and back as image decoding does."""
    def per_channel(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=x.dtype, device=x.device).view(1, -1, 1, 1)

    pixels = x * per_channel(std) + per_channel(mean)  # [0, 1]
    chans = int(teacher_size[0])
    if pixels.shape[1] != chans:
        pixels = pixels.mean(1, keepdim=True).expand(-1, chans, -1, -1)
    if tuple(pixels.shape[-2:]) != tuple(teacher_size[1:]):
        pixels = F.interpolate(pixels, size=tuple(int(s) for s in teacher_size[1:]), mode="bicubic",
                               align_corners=False)
    return (pixels - per_channel(teacher_mean)) / per_channel(teacher_std)


def model_features(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's (B, D) pooled pre-logits feature and (B, D, h, w) patch features: the output tokens after the
    prefix (class, distillation, register) tokens laid on the patch grid, or a convolutional model's feature map."""
    feats = model.forward_features(x)
    pooled = model.forward_head(feats, pre_logits=True)
    if feats.ndim == 4:
        return pooled, feats
    tokens = feats[:, getattr(model, "num_prefix_tokens", 0):]
    h, w = patch_grid(model, x, tokens.shape[1])
    return pooled, tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)


def patch_grid(model: nn.Module, x: torch.Tensor, n: int) -> tuple[int, int]:
    """The (h, w) grid of a model's n patch tokens on images x: its patch embedding's, else a square."""
    patch = getattr(patch_embedding(model), "patch_size", None)
    if patch is not None:
        h, w = x.shape[-2] // patch[0], x.shape[-1] // patch[1]
        if h * w == n:
            return h, w
    side = round(n ** 0.5)
    if side * side != n:
        raise VitlabError(f"{type(model).__name__} gives {n} patch tokens on {tuple(x.shape[-2:])} images, not a grid "
                          "vitlab can place; accepted as a teacher: a model whose patch tokens form its patch grid")
    return side, side


class FeatureDistillation(nn.Module):
    """A student encoder (``self.encoder``, the run's model) with two heads to a frozen teacher's width; the teacher
    is attached with ``attach_teacher`` (kept out of the state dict)."""

    method = "distill"
    run_options = ("teacher_dim", "teacher_patch_dim", "teacher_mean", "teacher_std", "teacher_size")  # the run's

    def __init__(self, encoder: nn.Module, teacher_dim: int, teacher_patch_dim: int, teacher_mean: list[float],
                 teacher_std: list[float], teacher_size: list[int], mean: list[float] | None = None,
                 std: list[float] | None = None, loss: Literal["cosine", "smooth_l1"] = "cosine", hidden_dim: int = 0,
                 patch_weight: float = 1.0):
        super().__init__()
        check_encoder(encoder, "distill")
        if min(teacher_dim, teacher_patch_dim) < 1 or hidden_dim < 0 or patch_weight < 0:
            raise VitlabError(f"teacher_dim {teacher_dim} and teacher_patch_dim {teacher_patch_dim} must be "
                              f"at least 1, hidden_dim {hidden_dim} and "
                              f"patch_weight {patch_weight} at least 0")
        if loss not in ("cosine", "smooth_l1"):
            raise VitlabError(f"distill loss {loss!r} is not valid; accepted: cosine, smooth_l1")
        set_aside_head(encoder)
        self.encoder: VisionTransformer = encoder
        chans = patch_embedding(encoder).proj.in_channels
        self.mean, self.std = list(mean or [0.0] * chans), list(std or [1.0] * chans)
        self.teacher_mean, self.teacher_std, self.teacher_size = list(teacher_mean), list(teacher_std), teacher_size
        self.loss_kind, self.patch_weight = loss, patch_weight
        if getattr(encoder, "fc_norm", None) is not None:
            encoder.fc_norm.requires_grad_(True)  # the pooled feature is what the teacher's is compared with
        self.pooled_head = feature_head(encoder.num_features, teacher_dim, hidden_dim)
        self.patch_norm = output_norm(encoder)  # GAP encoders end without a norm on their tokens
        self.patch_head = feature_head(encoder.embed_dim, teacher_patch_dim, hidden_dim)
        self._teacher: tuple[nn.Module, bool] | None = None  # (model, bf16): not a submodule, not in the state

    def no_weight_decay(self) -> set[str]:
        return no_weight_decay(self)

    @staticmethod
    def teacher_facts(teacher: nn.Module) -> dict[str, Any]:
        """The options a teacher sets (its feature widths, from one blank image, its input size and normalisation)."""
        cfg = teacher.pretrained_cfg
        size = [int(s) for s in cfg["input_size"]]
        first = next(teacher.parameters())
        with torch.inference_mode():
            pooled, patches = model_features(teacher.eval(), torch.zeros(1, *size, device=first.device))
        return {"teacher_dim": pooled.shape[-1], "teacher_patch_dim": patches.shape[1],
                "teacher_mean": list(cfg["mean"]), "teacher_std": list(cfg["std"]), "teacher_size": size}

    def attach_teacher(self, teacher: nn.Module, bf16: bool = False) -> None:
        """The frozen teacher (on the student's device), run in bf16 when ``bf16``."""
        teacher.eval().requires_grad_(False)
        self._teacher = (teacher, bf16)

    @torch.inference_mode()
    def teacher_features(self, x: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's (B, Dt) pooled and (B, h, w, Dt) patch features of the student's batch x, its patch grid
        resampled to the student's ``grid`` (inference tensors: clone before autograd keeps them)."""
        if self._teacher is None:
            raise VitlabError("this distillation objective has no teacher attached: attach_teacher(model) first")
        teacher, bf16 = self._teacher
        x = teacher_view(x.float(), self.mean, self.std, self.teacher_mean, self.teacher_std, self.teacher_size)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            pooled, patches = model_features(teacher, x)
        if tuple(patches.shape[-2:]) != tuple(grid):
            patches = F.interpolate(patches.float(), size=grid, mode="bilinear", align_corners=False)
        return pooled.float(), patches.float().permute(0, 2, 3, 1)

    def forward(self, imgs: torch.Tensor, generator: torch.Generator | None = None) -> DistillOutput:
        e = self.encoder
        ph, pw = patch_embedding(e).patch_size
        B, h, w = imgs.shape[0], imgs.shape[-2] // ph, imgs.shape[-1] // pw
        tokens = e.forward_features(imgs)  # (B, P + h w, D)
        t_pooled, t_patches = (t.clone() for t in self.teacher_features(imgs, (h, w)))
        pooled = self.pooled_head(e.pool(tokens))  # (B, Dt)
        patches = self.patch_head(self.patch_norm(tokens[:, e.num_prefix_tokens:])).reshape(B, h, w, -1)
        pooled_loss = feature_loss(pooled, t_pooled, self.loss_kind)
        patch_loss = feature_loss(patches, t_patches, self.loss_kind)
        return DistillOutput(pooled_loss + self.patch_weight * patch_loss, pooled_loss, patch_loss)
