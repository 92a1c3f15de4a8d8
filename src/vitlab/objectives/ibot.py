"""iBOT, image BERT pre-training with an online tokenizer (Zhou et al. 2022): DINO's self-distillation of the class
token plus a masked-patch token loss.

Everything DINO does (objectives/dino.py) happens as there: multi-crop, the EMA teacher, the centred and sharpened
class-token outputs, the schedules. Besides, a random ``mask_ratio`` of each global crop's patches is masked for the
student (per image and crop, as vitlab's MAE draws its masks: objectives/masking.py): their patch embeddings become a
learned ``mask_token`` before the position embedding. The teacher sees the global crops unmasked. Every output patch
token of both goes through the projection head (shared with the class token, as iBOT's ViT-S/B runs share it); the
student's token at each masked patch predicts the teacher's distribution at that patch of the same crop: the
cross-entropy -sum_k t_k log s_k, the teacher's patch outputs centred by their own EMA centre (``patch_center``) and
sharpened at their own temperature (``warmup_teacher_patch_temp`` to ``teacher_patch_temp`` over
``teacher_temp_steps``), averaged over each image's masked patches, then over the images and the two global crops.
The loss is DINO's + ``patch_weight`` x this one (iBOT's lambda1 = lambda2 = 1). Local crops are not masked and take
part in the class-token loss only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from .dino import DINO, dino_loss, encoded_tokens, teacher_temperature
from .encoder import no_weight_decay, output_norm
from .masking import random_masking


class IBOTOutput(NamedTuple):
    loss: torch.Tensor  # () class-token loss + patch_weight x masked-patch loss
    cls_loss: torch.Tensor  # () DINO's, between the class tokens of different crops
    patch_loss: torch.Tensor  # () on the masked patches of each global crop
    mask: torch.Tensor  # (2, B, N) the student's masks, 1 = masked


def masked_patch_loss(teacher: torch.Tensor, student: torch.Tensor, mask: torch.Tensor, center: torch.Tensor,
                      teacher_temp: float, student_temp: float) -> torch.Tensor:
    """(V, B, N, K) teacher and student patch logits of the same V crops, (V, B, N) masks -> the mean over crops and
    images of the mean over each image's masked patches of -sum_k softmax((t - c) / tt)_k log_softmax(s / ts)_k."""
    t = F.softmax((teacher.float() - center) / teacher_temp, dim=-1)
    per_patch = -(t * F.log_softmax(student.float() / student_temp, dim=-1)).sum(dim=-1)  # (V, B, N)
    m = mask.float()
    return ((per_patch * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)).mean()


class IBOT(DINO):
    """DINO's student and EMA teacher, with a mask token for the student's masked patches and a patch centre."""

    method = "ibot"

    def __init__(self, encoder: nn.Module, out_dim: int = 1024, hidden_dim: int = 512, bottleneck_dim: int = 128,
                 local_crops: int = 4, local_size: float = 0.5, student_temp: float = 0.1,
                 teacher_temp: float = 0.07, warmup_teacher_temp: float = 0.04, teacher_temp_steps: int = 300,
                 momentum: float = 0.996, momentum_steps: int = 3000, center_momentum: float = 0.9,
                 mask_ratio: float = 0.3, patch_weight: float = 1.0, teacher_patch_temp: float = 0.07,
                 warmup_teacher_patch_temp: float = 0.04):
        super().__init__(encoder, out_dim, hidden_dim, bottleneck_dim, local_crops, local_size, student_temp,
                         teacher_temp, warmup_teacher_temp, teacher_temp_steps, momentum, momentum_steps,
                         center_momentum)
        if not 0 < mask_ratio < 1 or patch_weight < 0 or min(teacher_patch_temp, warmup_teacher_patch_temp) <= 0:
            raise VitlabError(f"mask_ratio {mask_ratio} must lie in (0, 1), patch_weight {patch_weight} be >= 0, "
                              "teacher_patch_temp and warmup_teacher_patch_temp > 0")
        self.mask_ratio, self.patch_weight = mask_ratio, patch_weight
        self.teacher_patch_temp, self.warmup_teacher_patch_temp = teacher_patch_temp, warmup_teacher_patch_temp
        self.mask_token = nn.Parameter(torch.zeros(1, 1, encoder.embed_dim))
        self.patch_norm = output_norm(encoder)  # GAP encoders end without a norm on their tokens
        self.teacher_patch_norm = output_norm(encoder).requires_grad_(False)
        self.register_buffer("patch_center", torch.zeros(out_dim))

    def no_weight_decay(self) -> set[str]:
        return no_weight_decay(self)

    @torch.no_grad()
    def update_teacher(self, m: float) -> None:
        super().update_teacher(m)
        for ps, pt in zip(self.patch_norm.parameters(), self.teacher_patch_norm.parameters()):
            pt.mul_(m).add_(ps.detach(), alpha=1 - m)

    def outputs(self, encoder: nn.Module, head: nn.Module, norm: nn.Module, x: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K) class-token and (B, N, K) patch outputs of the head on the encoder's tokens of images x."""
        tokens = encoded_tokens(encoder, x, mask, self.mask_token)
        return head(encoder.pool(tokens)), head(norm(tokens[:, encoder.num_prefix_tokens:]))

    def forward(self, imgs: torch.Tensor, generator: torch.Generator | None = None) -> IBOTOutput:
        step = self.advance()
        global_crops, local_crops = self.crops(imgs, generator)
        B, g = imgs.shape[0], torch.cat(global_crops)
        ph, pw = self.encoder.patch_embed.patch_size
        N = (g.shape[-2] // ph) * (g.shape[-1] // pw)
        mask = random_masking(2 * B, N, self.mask_ratio, g.device, generator).mask  # (2B, N)
        with torch.no_grad():
            t_cls, t_patch = self.outputs(self.teacher_encoder, self.teacher_head, self.teacher_patch_norm, g)
        s_cls, s_patch = self.outputs(self.encoder, self.head, self.patch_norm, g, mask)
        student = [s_cls]
        if local_crops:
            student.append(self.head(self.encoder.pool(encoded_tokens(self.encoder, torch.cat(local_crops)))))
        student = torch.cat(student).reshape(2 + self.local_crops, B, -1)
        t_cls, t_patch, s_patch = t_cls.reshape(2, B, -1), t_patch.reshape(2, B, N, -1), s_patch.reshape(2, B, N, -1)
        temp = teacher_temperature(step, self.teacher_temp_steps, self.warmup_teacher_temp, self.teacher_temp)
        patch_temp = teacher_temperature(step, self.teacher_temp_steps, self.warmup_teacher_patch_temp,
                                         self.teacher_patch_temp)
        cls_loss = dino_loss(t_cls, student, self.center, temp, self.student_temp)
        mask = mask.reshape(2, B, N)
        patch_loss = masked_patch_loss(t_patch, s_patch, mask, self.patch_center, patch_temp, self.student_temp)
        if self.training:
            self.update_center(t_cls)
            self.update_center(t_patch.flatten(1, 2), self.patch_center)
        return IBOTOutput(cls_loss + self.patch_weight * patch_loss, cls_loss, patch_loss, mask)
