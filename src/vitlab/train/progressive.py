"""Progressive resizing, all of it: the input size as the schedule goes (smaller first, the full size from
``progressive_until`` on), the model made to take other sizes for the run and restored at its end, and the
augmented batch resized to the step's size."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import VitlabError
from ..models.groups import patch_embedding


def progressive_size(progress: float, full: tuple[int, int], start_scale: float, until: float,
                     step: int) -> tuple[int, int]:
    """Training input size at ``progress`` under progressive resizing.

    The size grows linearly from ``start_scale`` x ``full`` at the start to ``full`` at ``until``
    (a share of the schedule), rounded down to multiples of ``step`` (the model's patch size);
    from ``until`` on, and always when ``start_scale`` is 1, it is ``full``.
    """
    if start_scale >= 1 or progress >= until:
        return tuple(full)
    scale = start_scale + (1.0 - start_scale) * max(progress, 0.0) / until
    return tuple(min(f, max(step, int(f * scale) // step * step)) for f in full)


def any_size(model: nn.Module) -> dict[nn.Module, bool]:
    """Let a model take inputs of other sizes (dynamic_img_size on every module that has it).

    Returns the previous flags; ``restore_size_flags`` puts them back. A model that cannot (``fixed_size``)
    raises ValueError saying why.
    """
    if getattr(model, "fixed_size", ""):
        raise VitlabError(f"{getattr(model, 'arch', None) or type(model).__name__} takes one input size only "
                          f"({model.fixed_size}): train it without progressive resizing (--progressive-scale 1)")
    flags = {m: m.dynamic_img_size for m in model.modules() if isinstance(getattr(m, "dynamic_img_size", None), bool)}
    for m in flags:
        m.dynamic_img_size = True
    return flags


def restore_size_flags(flags: dict[nn.Module, bool]) -> None:
    for m, v in flags.items():
        m.dynamic_img_size = v


def size_step(model: nn.Module) -> int:
    """The granularity of input sizes a model takes: its patch size (a CNN's: 8)."""
    pe = patch_embedding(model)
    return int(max(pe.patch_size)) if pe is not None else 8


def resize(x: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
    """The augmented batch at ``size`` (None, or its own size: unchanged), antialiased bilinear."""
    if size is None or tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)


class ProgressiveResize:
    """A run's progressive resizing: ``size_at(progress)`` is the step's input size (None: the full size, no
    resizing), said when it changes; ``last`` is the latest step's; ``restore()`` gives the model back the size it
    was built for. With ``start_scale`` 1 it is off and changes nothing."""

    def __init__(self, model: nn.Module, full: tuple[int, int], start_scale: float, until: float,
                 log: Callable[[str], None]):
        self.full, self.start_scale, self.until, self.log = tuple(full), start_scale, until, log
        self.on = start_scale < 1
        self.step = size_step(model)
        self.flags = any_size(model) if self.on else {}  # every vitlab model takes other sizes this way
        self.last: tuple[int, int] | None = None

    def size_at(self, progress: float) -> tuple[int, int] | None:
        if not self.on:
            return None
        size = progressive_size(progress, self.full, self.start_scale, self.until, self.step)
        if size != self.last:
            self.log(f"training input size {size[0]}x{size[1]}")
            self.last = size
        return size

    def restore(self) -> None:
        """The saved model takes the size it was trained for (an EMA copy never changed)."""
        restore_size_flags(self.flags)
