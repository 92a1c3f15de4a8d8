"""DeiT distillation from a teacher: the task and its loss.

hard: (1 - alpha) * CE(class head, targets) + alpha * CE(distillation head, teacher argmax)
soft: (1 - alpha) * CE(class head, targets) + alpha * tau^2 * KL(softmax(teacher / tau) || softmax(student / tau))

``targets`` are the (mixed, smoothed) soft targets of the batch; the teacher sees the same
augmented images, at their full size under progressive resizing (the student may see them smaller).
With ``teacher_once`` it sees instead every training image and its mirror image once, before the first step, and
the mean of its two logits is looked up for each image of a batch (its crop and flip not seen): the student then
trains at its own speed, as the relabelled-ImageNet and fast knowledge distillation work does, at the price of
DeiT's consistent views.
A student without a distillation token is distilled through its class head.
The KL term is averaged over the batch (DeiT's code divides its sum by batch x classes instead).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import checkpoint
from ...data.augment import normalize
from ...devices import to_device
from ...errors import VitlabError
from ...metrics import head_logits
from ...models.groups import patch_embedding
from ...progress import Progress
from ..step import has_conv_stages
from .supervised import Supervised, heads_loss, soft_target_cross_entropy

if TYPE_CHECKING:
    from ...data.sources import ImageSet
    from ..recipe import Recipe


class TrainLoss(nn.Module):
    """The distillation loss (``kind`` hard or soft) of the class and distillation heads' outputs; with kind 'none',
    no teacher, the supervised loss of both heads."""

    def __init__(self, teacher: nn.Module | None = None, kind: str = "none", tau: float = 1.0, alpha: float = 0.5,
                 student_norm: tuple[Sequence[float], Sequence[float]] | None = None,
                 teacher_norm: tuple[Sequence[float], Sequence[float]] | None = None,
                 teacher_channels_last: bool = False):
        super().__init__()
        if kind not in ("none", "hard", "soft"):
            raise VitlabError(f"distillation type {kind!r} is not one of none, hard, soft")
        if kind != "none" and teacher is None:
            raise VitlabError(f"{kind} distillation needs a teacher")
        self.kind, self.tau, self.alpha = kind, tau, alpha
        self.teacher = teacher
        self.kept: torch.Tensor | None = None  # the teacher's logits by training image, where made once
        if teacher is not None:
            teacher.eval().requires_grad_(False)
            if teacher_channels_last:
                teacher.to(memory_format=torch.channels_last)
        self.teacher_channels_last = teacher_channels_last  # the teacher and its input in channels-last order
        self.renorm = None
        self.teacher_chans = None
        if teacher is not None:
            input_size = getattr(teacher, "pretrained_cfg", {}).get("input_size")
            self.teacher_chans = int(input_size[0]) if input_size else None
        if teacher is not None and student_norm and teacher_norm and \
                (tuple(student_norm[0]), tuple(student_norm[1])) != (tuple(teacher_norm[0]), tuple(teacher_norm[1])):
            s_mean, s_std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in student_norm)
            t_mean, t_std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in teacher_norm)
            self.renorm = (s_mean, s_std, t_mean, t_std)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()  # the teacher always runs in eval mode
        return self

    def teacher_input(self, x: torch.Tensor) -> torch.Tensor:
        """The student's normalised batch, re-normalised, converted in channels and resized for the teacher."""
        t_chans = self.teacher_chans
        if self.renorm is not None or (t_chans and t_chans != x.shape[1]):
            s_mean, s_std, t_mean, t_std = (t.to(x.device) for t in self.renorm)
            x = x * s_std + s_mean  # back to [0, 1]
            if t_chans and t_chans != x.shape[1]:  # grey <-> colour, as image decoding does
                x = x.mean(1, keepdim=True).expand(-1, t_chans, -1, -1)
            x = (x - t_mean) / t_std
        size = getattr(patch_embedding(self.teacher), "img_size", None)
        if size is not None and not getattr(patch_embedding(self.teacher), "dynamic_img_size", False) \
                and tuple(x.shape[-2:]) != tuple(size):
            x = F.interpolate(x, size=tuple(size), mode="bicubic", align_corners=False)
        return x.contiguous(memory_format=torch.channels_last) if self.teacher_channels_last else x

    @torch.no_grad()
    def predict_once(self, images: torch.Tensor, mean: Sequence[float], std: Sequence[float], batch_size: int,
                     view: Callable | None = None) -> None:
        """The teacher's logits for every image of ``images`` (uint8, the training set), the mean over it and its
        mirror image, kept for ``forward`` to look up by index (``teacher_once``)."""
        device = next(self.teacher.parameters()).device
        quiet = torch.distributed.is_initialized() and torch.distributed.get_rank() != 0
        kept = []
        with Progress(total=len(images), desc="the teacher's predictions", unit="img", disable=quiet) as bar:
            for start in range(0, len(images), batch_size):
                batch = to_device(images[start:start + batch_size], device)
                x = normalize(view(batch) if view is not None else batch, mean, std)
                kept.append(head_logits(self.teacher, self.teacher_input(x), tta=True)["logits"].float())
                bar.update(len(batch))
        self.kept = torch.cat(kept)

    def teacher_logits(self, images: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """The teacher's logits for the batch: looked up by ``index`` where they were made once, else made now."""
        kept = self.kept
        if kept is None:
            return self.teacher(self.teacher_input(images)).float()
        if index is None:
            raise VitlabError("the teacher's predictions were made once, by training image: the loss needs the "
                              "batch's index in the training set")
        return kept.index_select(0, to_device(index, kept.device))

    def forward(self, images: torch.Tensor, outputs, targets: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(outputs, tuple):
            cls, dist = outputs
        else:
            cls = dist = outputs
        if self.kind == "none":
            return heads_loss(outputs, targets)
        base = soft_target_cross_entropy(cls, targets)
        with torch.no_grad():
            teacher_logits = self.teacher_logits(images, index)
        if self.kind == "hard":
            kd = F.cross_entropy(dist, teacher_logits.argmax(dim=1))
        else:
            t = self.tau
            kd = F.kl_div(F.log_softmax(dist.float() / t, dim=1), F.log_softmax(teacher_logits / t, dim=1),
                          reduction="batchmean", log_target=True) * (t * t)
        return (1 - self.alpha) * base + self.alpha * kd


def teacher_fit(logits: torch.Tensor, labels: torch.Tensor, tau: float = 1.0) -> dict[str, float]:
    """How a teacher's logits (N, classes) fit the labels (N,): ``match``, the fraction whose argmax is the label, and
    ``off_label``, the mean probability that softmax(logits / tau) puts on the other classes (0 for targets that are
    the labels themselves; the soft targets' information beyond them)."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise VitlabError(f"teacher_fit needs logits (N, classes) and labels (N,), got {tuple(logits.shape)} and "
                          f"{tuple(labels.shape)}")
    labels = labels.to(logits.device).long()
    probs = F.softmax(logits.float() / tau, dim=1)
    return {"match": (logits.argmax(1) == labels).float().mean().item(),
            "off_label": 1 - probs.gather(1, labels.view(-1, 1)).mean().item()}


class Distillation(Supervised):
    """Supervised training with a teacher (--teacher, --distill hard|soft): the teacher's predictions on the same
    augmented batch are a second target, through a distillation head where the student has one."""

    name = "distillation"

    @classmethod
    def wanted(cls, recipe: Recipe) -> bool:
        return bool(recipe.teacher)

    def make_loss(self, device: torch.device, classes: Sequence[str], mean: tuple, std: tuple) -> nn.Module:
        """The loss with the recipe's teacher loaded on the device; a teacher of other classes is refused."""
        recipe = self.recipe
        teacher = checkpoint.load(recipe.teacher).to(device)
        if teacher.num_classes != len(classes):
            raise VitlabError(f"teacher {recipe.teacher} predicts {teacher.num_classes} classes, the data has "
                              f"{len(classes)}")
        self.log(f"teacher: {recipe.teacher} ({type(teacher).__name__}), {recipe.distill} distillation")
        teacher_norm = (teacher.pretrained_cfg["mean"], teacher.pretrained_cfg["std"])
        self.loss = TrainLoss(teacher, recipe.distill, recipe.tau, recipe.alpha, student_norm=(mean, std),
                              teacher_norm=teacher_norm, teacher_channels_last=has_conv_stages(teacher))
        self.mean, self.std = mean, std
        return self.loss

    def prepare(self, train: ImageSet, view: Callable | None, batch_size: int,
                now: Callable[[], float]) -> float:
        """With ``teacher_once``, the teacher's predictions on every training image, made now, and how well they fit
        the labels; their seconds."""
        if not self.recipe.teacher_once:
            return 0.0
        t0 = now()
        self.loss.predict_once(train.images, self.mean, self.std, batch_size, view)
        seconds = now() - t0
        self.log(f"the teacher's predictions on {len(train.images)} training images and their mirror images, made "
                 f"once in {seconds:.0f} s (counted as training time)")
        fit = teacher_fit(self.loss.kept, train.labels, self.loss.tau)
        self.log(f"the teacher's predictions match {fit['match']:.2%} of the training labels and put "
                 f"{fit['off_label']:.3f} of their probability (at temperature {self.loss.tau:g}) on the other "
                 f"classes, on average")
        return seconds
