"""``vitlab export``: a model as ONNX, as a timm Hub folder or as a Hugging Face transformers folder.

    vitlab.export.export("runs/cifar", "onnx", "exported/onnx")
    vitlab export hf-hub:timm/vit_small_patch16_224.augreg_in21k_ft_in1k --to hf --out vit-s-hf

A format that cannot express a model (the hybrid ViT to transformers, say) raises ValueError naming
what is missing. The timm and transformers folders load back with ``vitlab.load`` as well.
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from .atomic import atomic_path, atomic_write_json
from .checkpoint import CONFIG, WEIGHTS, current_args, load
from .errors import VitlabError
from .interop import hf, timm
from .interop.onnx import export_onnx
from .models.registry import check_model, get_spec

FORMATS = ("onnx", "timm", "hf")


def full_args(model: nn.Module) -> dict[str, Any]:
    """Every construction argument of a vitlab model: class defaults, then its registered name's, then its own."""
    cls = type(model)
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if k not in ("self", "kwargs") and p.default is not inspect.Parameter.empty}
    arch = getattr(model, "arch", None)
    registered = dict(get_spec(arch).args) if arch else {}
    return {**defaults, **registered, **current_args(model)}


def _state(model: nn.Module) -> dict:
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def _write_folder(folder: Path, cfg: dict[str, Any], state: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    atomic_write_json(folder / CONFIG, cfg)
    return folder


def export_timm(model: nn.Module, folder: str | os.PathLike) -> Path:
    """A timm Hub folder: config.json (architecture, model_args, pretrained_cfg) + model.safetensors, timm's keys."""
    cfg = timm.export_config(model, full_args(model))
    return _write_folder(Path(folder), cfg, timm.export_state_dict(model, _state(model)))


def export_hf(model: nn.Module, folder: str | os.PathLike) -> Path:
    """A transformers folder: ViTForImageClassification or DeiTForImageClassificationWithTeacher, id2label."""
    cfg = hf.export_config(model, full_args(model))
    folder = _write_folder(Path(folder), cfg, hf.export_state_dict(_state(model), cfg))
    atomic_write_json(folder / hf.PREPROCESSOR, hf.image_processor(model.pretrained_cfg, cfg))
    return folder


def export(model: nn.Module | str | os.PathLike, to: str, out: str | os.PathLike, check: bool = True,
           log: Callable[[str], None] = lambda s: None) -> Path:
    """Export a model (or anything vitlab.load reads) to ``to`` (onnx, timm or hf) in folder ``out``.

    ``check`` (ONNX) compares onnxruntime's output with PyTorch's when onnxruntime is installed, and tells ``log``
    the largest difference (or that onnxruntime is missing). Returns the written file (ONNX) or folder.
    """
    if to not in FORMATS:
        raise VitlabError(f"unknown export format {to!r}; accepted: {', '.join(FORMATS)}")
    if not isinstance(model, nn.Module):
        model = load(model)
    check_model(model, "export")
    model = model.eval()
    if to == "onnx":
        return export_onnx(model, Path(out), check=check, log=log)
    return export_timm(model, out) if to == "timm" else export_hf(model, out)
