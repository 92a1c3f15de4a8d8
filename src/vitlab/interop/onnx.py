"""ONNX export: a dynamic batch axis (and dynamic height and width for ``dynamic_img_size`` models).

torch's TorchScript-based exporter (``dynamo=False``, deprecated upstream but present in torch 2.13)
is used: it needs no onnxscript, and its ``dynamic_axes`` keep the image size symbolic through the
position-embedding resampling, which ``torch.export`` (``dynamo=True``) specialises to the example's
size (its graph then fails at any other size). Antialiased bicubic and bilinear resampling have no
built-in translation; they map onto ONNX Resize (cubic, a = -0.5, or linear; antialias, exclude_outside),
which is the same filter.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_files, atomic_write_json
from ..data.views import Preprocess
from ..errors import VitlabError

ONNX_FILE, PREPROCESS_FILE = "model.onnx", "preprocess.json"
OPSET = 18
INSTALL_HINT = "pip install 'vitlab[onnx]'"


def _resize_aa(mode: str) -> Callable[..., Any]:
    """aten::_upsample_{bicubic,bilinear}2d_aa as ONNX Resize: PIL-style cubic (a = -0.5) or the triangle filter,
    antialiased (stretched when reducing), edges renormalised."""
    cubic = {"cubic_coeff_a_f": -0.5} if mode == "cubic" else {}

    def symbolic(g, x, output_size, align_corners, *scales):
        shape = g.op("Shape", x)
        batch_chans = g.op("Slice", shape, g.op("Constant", value_t=torch.tensor([0])),
                           g.op("Constant", value_t=torch.tensor([2])))
        size = g.op("Concat", batch_chans, g.op("Cast", output_size, to_i=7), axis_i=0)  # 7: INT64
        empty = g.op("Constant", value_t=torch.tensor([], dtype=torch.float32))
        return g.op("Resize", x, empty, empty, size, mode_s=mode, antialias_i=1, exclude_outside_i=1,
                    coordinate_transformation_mode_s="half_pixel", **cubic)
    return symbolic


def dynamic_size(model: nn.Module) -> bool:
    return bool(getattr(model, "dynamic_img_size", False))


def example_input(model: nn.Module, batch: int = 2, grow: int = 0) -> torch.Tensor:
    """A random batch at the model's input size (``grow`` steps taller, for tracing the resampling path): a step is a
    patch, or the block of patches the model's grid must split into (``grid_multiple``: Qwen3's merger)."""
    c, h, w = model.pretrained_cfg["input_size"]
    step = getattr(getattr(model, "patch_embed", None), "patch_size", (8, 8))
    grow *= getattr(model, "grid_multiple", 1)
    return torch.randn(batch, c, h + grow * step[0], w + grow * step[1])


def export_onnx(model: nn.Module, folder: Path, check: bool = True, atol: float = 1e-4,
                log: Callable[[str], None] = lambda s: None) -> Path:
    """Write folder/model.onnx (input ``images`` (B, C, H, W), output ``logits``) and folder/preprocess.json.

    ``check`` compares onnxruntime's output with PyTorch's at two batch sizes when onnxruntime is installed;
    ``log`` is told the largest difference, or that onnxruntime is missing.
    """
    try:
        import onnx  # noqa: F401  torch's exporter writes the file with it
    except ImportError:
        raise VitlabError(f"exporting to ONNX needs the onnx package, which is not installed: {INSTALL_HINT}") from None
    model = model.eval()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dynamic = dynamic_size(model)
    axes: dict[str, dict[int, str]] = {"images": {0: "batch"}, "logits": {0: "batch"}}
    if dynamic:
        axes["images"].update({2: "height", 3: "width"})
    # a traced model keeps the branch its example took: trace a dynamic model off its own size, so that the
    # position-embedding resampling is in the graph (at the model's own size it resamples to the same grid)
    x = example_input(model, grow=1 if dynamic else 0)
    torch.onnx.register_custom_op_symbolic("aten::_upsample_bicubic2d_aa", _resize_aa("cubic"), OPSET)
    torch.onnx.register_custom_op_symbolic("aten::_upsample_bilinear2d_aa", _resize_aa("linear"), OPSET)  # SigLIP 2
    path = folder / ONNX_FILE
    with warnings.catch_warnings(), torch.no_grad(), atomic_files(path) as tmp:  # never a half-written model.onnx
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it keeps constant
        torch.onnx.export(model, (x,), str(tmp), dynamo=False, opset_version=OPSET, input_names=["images"],
                          output_names=["logits"], dynamic_axes=axes)
    atomic_write_json(folder / PREPROCESS_FILE, preprocess_json(model, dynamic))
    if check:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            log(f"{path} not checked: onnxruntime is not installed ({INSTALL_HINT} to compare it with PyTorch)")
            return path
        worst = max_difference(model, path)
        if worst > atol:
            raise VitlabError(f"{path}: onnxruntime differs from PyTorch by {worst:.2e} (tolerance {atol:g})")
        log(f"{path} checked with onnxruntime: its logits differ from PyTorch's by at most {worst:.1e} "
            f"(tolerance {atol:g})")
    return path


def preprocess_json(model: nn.Module, dynamic: bool) -> dict[str, Any]:
    """preprocess.json: the model's ``views.Preprocess`` in timm's keys, and in words.

    An image file becomes ``images`` as timm's eval transform does with these keys (crop_mode, crop_pct,
    interpolation on the Pillow image, then /255, mean, std): crop_mode ``squash`` resizes the whole image to
    floor(size / crop_pct) and keeps the centre ``size``; ``center`` resizes the shorter side to that, aspect kept.
    """
    pre = model.pretrained_cfg
    prep = Preprocess.from_cfg(pre)
    return {"input": "images", "output": "logits", "input_size": list(pre["input_size"]),
            "dynamic_img_size": dynamic, **prep.to_cfg(), "resize": prep.describe(), "scale": "1/255",
            "label_names": list(pre["label_names"]) if pre.get("label_names") else None}


@torch.no_grad()
def max_difference(model: nn.Module, path: Path, batches: tuple[int, ...] = (1, 3),
                   sizes: list[tuple[int, int]] | None = None) -> float:
    """Largest |onnxruntime - PyTorch| over random batches of the given sizes (and image sizes)."""
    try:
        import onnxruntime
    except ImportError:
        raise VitlabError(f"checking an ONNX export needs onnxruntime: {INSTALL_HINT}") from None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    c, h, w = model.pretrained_cfg["input_size"]
    worst = 0.0
    for n in batches:
        for size in sizes or [(h, w)]:
            x = torch.randn(n, c, *size)
            ref = model.eval()(x)
            out = session.run(None, {"images": x.numpy()})[0]
            worst = max(worst, float((torch.from_numpy(out) - ref).abs().max()))
    return worst
