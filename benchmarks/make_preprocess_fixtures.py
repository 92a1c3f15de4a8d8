"""Write tests/fixtures/preprocess/: tiny random-weight checkpoints with their own preprocessing, an image that is
not square, and the probabilities their own library gives for that image file.

Each folder is written by the peer library (timm ``save_for_hf``, transformers ``save_pretrained`` with its image
processor) and holds ``io.safetensors``: ``pixels`` (the normalised (1, C, H, W) input the peer's preprocessing
made of ``image.png``) and ``probabilities`` (the softmax of the peer's eval-mode output on it). What the peer does
with the file is the peer's own pipeline: timm's ``resolve_data_config`` + ``create_transform`` on the Pillow
image, transformers' ``AutoImageProcessor``.

Runs only in the reference environment, from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/make_preprocess_fixtures.py
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform, resolve_data_config
from timm.models import save_for_hf

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "preprocess"
NOISE = 0.1
TINY = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0, img_size=16, patch_size=4, num_classes=5)
HF_TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16,
               patch_size=4)

# name -> pretrained_cfg entries timm's eval transform reads
TIMM = {
    "timm_center_crop09_bicubic": dict(crop_pct=0.9, crop_mode="center", interpolation="bicubic",
                                       mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3)),
    "timm_squash_crop09_bilinear": dict(crop_pct=0.9, crop_mode="squash", interpolation="bilinear"),
}
# name -> (transformers class, config class, config, image processor class, its arguments)
HF = {
    "hf_vit_exact_bilinear": ("ViTForImageClassification", "ViTConfig", dict(HF_TINY, num_labels=5),
                              "ViTImageProcessor", dict(size={"height": 16, "width": 16}, resample=2,
                                                        image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4])),
    "hf_clip_shortest_edge_crop": ("CLIPVisionModelWithProjection", "CLIPVisionConfig",
                                   dict(HF_TINY, projection_dim=6), "CLIPImageProcessor",
                                   dict(size={"shortest_edge": 18}, crop_size={"height": 16, "width": 16},
                                        resample=3)),
}

# name -> transformers class of a one-channel ViT saved with a 3-value mean and std
GREY = {"hf_vit_grey_rgb_mean_classifier": "ViTForImageClassification", "hf_vit_grey_rgb_mean_model": "ViTModel"}
GREY_STAT = [0.5, 0.5, 0.5]


def image() -> Image.Image:
    """A 61x37 (W x H) image with structure at every scale: a gradient, a disc, noise."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:37, 0:61].astype(np.float32)
    base = np.stack([xx / 60 * 255, yy / 36 * 255, ((xx - 30) ** 2 + (yy - 18) ** 2 < 150) * 255.0], -1)
    pixels = np.clip(base * 0.7 + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * NOISE)
    return model.eval()


def write_io(folder: Path, pixels: torch.Tensor, out: torch.Tensor | None, picture: Image.Image | None = None,
             **more: torch.Tensor) -> None:
    (picture or image()).save(folder / "image.png")
    probabilities = {} if out is None else {"probabilities": out.float().softmax(-1).contiguous()}
    save_file({"pixels": pixels.contiguous(), **probabilities, **{k: v.contiguous() for k, v in more.items()}},
              folder / "io.safetensors")


def timm_folder(name: str, pre: dict[str, Any]) -> None:
    folder = OUT / name
    ref = perturb(timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY))
    ref.pretrained_cfg = {**ref.pretrained_cfg, **pre, "input_size": (3, 16, 16)}
    save_for_hf(ref, folder, model_args=TINY, safe_serialization=True)
    back = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()  # the folder as timm's users read it
    config = resolve_data_config(model=back)
    for k, v in pre.items():
        assert (list(config[k]) if isinstance(v, tuple) else config[k]) == (list(v) if isinstance(v, tuple) else v), k
    pixels = create_transform(**config)(image())[None]
    with torch.no_grad():
        write_io(folder, pixels, back(pixels))


def hf_folder(name: str, cls: str, config_cls: str, config: dict[str, Any], processor: str,
              processor_args: dict[str, Any]) -> None:
    folder = OUT / name
    ref = perturb(getattr(transformers, cls)(getattr(transformers, config_cls)(**config)))
    ref.save_pretrained(folder)
    getattr(transformers, processor)(**processor_args).save_pretrained(folder)
    back = getattr(transformers, cls).from_pretrained(folder).eval()
    pixels = transformers.AutoImageProcessor.from_pretrained(folder)(image(), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = back(pixel_values=pixels)
        write_io(folder, pixels, out.logits if hasattr(out, "logits") else out.image_embeds)


def hf_grey_folder(name: str, cls: str) -> None:
    folder = OUT / name
    config = transformers.ViTConfig(**HF_TINY, num_channels=1, **({"num_labels": 5} if "Classification" in cls else {}))
    ref = perturb(getattr(transformers, cls)(config))
    ref.save_pretrained(folder)
    processor = transformers.ViTImageProcessor(size={"height": 16, "width": 16}, resample=2, image_mean=GREY_STAT,
                                               image_std=GREY_STAT)
    processor.save_pretrained(folder)
    saved = json.loads((folder / "preprocessor_config.json").read_text())
    assert saved["image_mean"] == saved["image_std"] == GREY_STAT, saved
    back = getattr(transformers, cls).from_pretrained(folder).eval()
    grey = image().convert("L")
    loaded = transformers.AutoImageProcessor.from_pretrained(folder)
    try:  # the statistic as saved, three values for one channel: transformers' processor refuses it
        loaded(grey, return_tensors="pt")
        raise AssertionError(f"{name}: transformers now normalises one channel by three values")
    except (RuntimeError, ValueError):
        pass
    pixels = loaded(grey, image_mean=GREY_STAT[0], image_std=GREY_STAT[0], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 1, 16, 16), pixels.shape
    with torch.no_grad():
        classifier = "Classification" in cls
        hidden = (back.vit if classifier else back)(pixel_values=pixels).last_hidden_state
        write_io(folder, pixels, back(pixel_values=pixels).logits if classifier else None, grey, features=hidden)


def main() -> int:
    logging.getLogger("timm").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    only = sys.argv[1:]
    for seed, (name, spec) in enumerate({**TIMM, **HF, **GREY}.items()):
        if only and name not in only:
            continue
        torch.manual_seed(seed)
        shutil.rmtree(OUT / name, ignore_errors=True)
        if name in TIMM:
            timm_folder(name, spec)
        elif name in GREY:
            hf_grey_folder(name, spec)
        else:
            hf_folder(name, *spec)
        cfg = json.loads((OUT / name / "config.json").read_text())
        print(f"{name:<30} {cfg.get('architecture') or cfg['architectures'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
