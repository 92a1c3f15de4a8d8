"""vitlab's exports read by timm and transformers: does a user of each get vitlab's probabilities on an image file?

For each preprocessing rule (``views.Preprocess``: vitlab's training rule, timm's centre crop, a squash with a crop,
bilinear and bicubic), a small vitlab ViT with noisy weights is exported to a timm folder and a transformers
folder. The peers then read their folder as their users do (timm: ``create_model("local-dir:...")``,
``resolve_data_config`` and ``create_transform`` on the Pillow image; transformers: ``AutoImageProcessor`` and
``AutoModelForImageClassification``), and their probabilities on a 100x50 image are compared with
``vitlab.infer.predict_files``. Run in the reference environment, from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/preprocess_vs_peers.py

Prints one row per rule and peer; exits with status 1 if any differs by more than 1e-4 (timm) or 1e-3
(transformers, whose image processors resample uint8 images with torchvision's kernels: a grey level apart from
Pillow's on a few pixels). A row marked "crop offset" is a rule transformers cannot express: it places a centre
crop at floor((H - h) / 2), timm at round((H - h) / 2) (35 - 32 = 3: one pixel apart); it is shown, not counted.
"""
from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
import timm
import torch
import transformers
from PIL import Image
from timm.data import create_transform, resolve_data_config

import vitlab
from vitlab.export import export
from vitlab.infer.predict import predict_files

TOL = {"timm": 1e-4, "transformers": 1e-3}
RULES = {  # name -> pretrained_cfg entries
    "vitlab training (squash 1.0 bicubic)": dict(crop_mode="squash", crop_pct=1.0, interpolation="bicubic"),
    "timm centre crop 0.875 bicubic": dict(crop_mode="center", crop_pct=0.875, interpolation="bicubic"),
    "centre crop 0.9 bilinear": dict(crop_mode="center", crop_pct=0.9, interpolation="bilinear"),
    "squash 0.8 bilinear": dict(crop_mode="squash", crop_pct=0.8, interpolation="bilinear"),
    "centre crop 0.9 bilinear, floor offset": dict(crop_mode="center", crop_pct=0.9, interpolation="bilinear",
                                                  crop_offset="floor"),
}


def photo(path: Path) -> Path:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:50, 0:100].astype(np.float32)
    base = np.stack([xx / 99 * 255, yy / 49 * 255, ((xx - 60) ** 2 + (yy - 20) ** 2 < 200) * 255.0], -1)
    Image.fromarray(np.clip(base * 0.7 + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)).save(path)
    return path


def main() -> int:
    logging.getLogger("timm").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        image = photo(tmp / "photo.png")
        print(f"{'rule':<40} {'peer':<14} {'max |p - vitlab|':>17}")
        for i, (name, rule) in enumerate(RULES.items()):
            model = vitlab.create_model("vit_nano_patch4_32", depth=2, num_classes=5)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            model.pretrained_cfg.update(rule, mean=(0.45, 0.5, 0.55), std=(0.2, 0.25, 0.3))
            folder = vitlab.save(model, tmp / f"m{i}")
            ours = predict_files(folder, [image], top_k=5, precision="fp32")[0]["top"]
            ours = torch.tensor([next(p["probability"] for p in ours if p["class"] == str(c)) for c in range(5)])
            peers = {}
            t = timm.create_model(f"local-dir:{export(folder, 'timm', tmp / f't{i}')}", pretrained=True).eval()
            x = create_transform(**resolve_data_config(model=t))(Image.open(image).convert("RGB"))[None]
            with torch.no_grad():
                peers["timm"] = t(x).softmax(-1)[0]
            h = export(folder, "hf", tmp / f"h{i}")
            x = transformers.AutoImageProcessor.from_pretrained(h)(Image.open(image), return_tensors="pt")
            hf = transformers.AutoModelForImageClassification.from_pretrained(h).eval()
            with torch.no_grad():
                peers["transformers"] = hf(pixel_values=x["pixel_values"]).logits.softmax(-1)[0]
            for peer, p in peers.items():
                diff = float((p - ours).abs().max())
                offset = rule["crop_mode"] == "center" and (peer == "timm") == (rule.get("crop_offset") == "floor")
                failed |= diff > TOL[peer] and not offset
                print(f"{name:<40} {peer:<14} {diff:>17.2e}{'  crop offset' if offset else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
