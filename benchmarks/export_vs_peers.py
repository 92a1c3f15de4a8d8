"""vitlab's timm and transformers exports, loaded by timm and transformers themselves: same logits?

Each case builds a small vitlab model with Gaussian noise (std 0.05) on every parameter, so that every
parameter matters, exports it with ``vitlab.export`` and loads the folder with the peer's own loader:

- timm, twice: ``timm.create_model(architecture, pretrained=True, pretrained_cfg_overlay=dict(file=...),
  **model_args)`` (the weights file given by hand) and ``timm.create_model("local-dir:FOLDER",
  pretrained=True)`` (timm's Hub loader reading config.json: architecture, model_args, pretrained_cfg);
- transformers: ``AutoModelForImageClassification.from_pretrained(FOLDER)``.

It compares eval-mode logits on one random batch, float32 on the CPU. Run with the reference environment
(timm, transformers), from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/export_vs_peers.py [SUBSTRING ...]

Prints one row per case and loader; exits with status 1 if any differs by more than 1e-5 or fails to load.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
import transformers
from torch import nn

import vitlab
from vitlab.export import export

TOL = 1e-5
NOISE_STD = 0.05
BATCH = 2
PARITY = Path(__file__).resolve().parents[1].parent / "shared" / "parity"


@dataclass
class Case:
    name: str
    model: str  # a registered vitlab name, or a folder vitlab.load reads
    args: dict[str, Any] = field(default_factory=dict)
    formats: tuple[str, ...] = ("timm",)

    def build(self) -> nn.Module:
        if Path(self.model).is_dir():
            model = vitlab.load(self.model)
        else:
            model = vitlab.create_model(self.model, **self.args)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * NOISE_STD)
        return model.eval()


SMALL = dict(depth=2)
CASES = [
    Case("vit (cifar preset)", "vit_nano_patch4_32", SMALL, ("timm", "hf")),
    Case("vit_tiny_patch16_224 (timm name)", "vit_tiny_patch16_224", dict(depth=2, img_size=64), ("timm", "hf")),
    Case("vit qkv_bias=False gelu_tanh", "vit_nano_patch4_32", dict(SMALL, qkv_bias=False, act_layer="gelu_tanh"),
         ("timm", "hf")),
    Case("vit sincos position embedding", "vit_tiny_sincos_patch4_32", SMALL, ("timm", "hf")),
    Case("vit LayerScale", "vit_nano_patch4_32", dict(SMALL, init_values=0.1)),
    Case("vit avg pool, no class token", "vit_tiny_avg_patch4_32", SMALL),
    Case("vit register tokens, no_embed_class", "vit_nano_patch4_32", dict(SMALL, reg_tokens=2, no_embed_class=True)),
    Case("vit in_chans=1 (digits preset)", "vit_micro_patch2_8", {}, ("timm",)),
    Case("vit dynamic_img_size", "vit_nano_patch4_32", dict(SMALL, dynamic_img_size=True)),
    Case("deit distilled", "deit_nano_distilled_patch4_32", SMALL, ("timm", "hf")),
    Case("deit_tiny_distilled_patch16_224 (timm name)", "deit_tiny_distilled_patch16_224",
         dict(depth=2, img_size=64), ("timm", "hf")),
    Case("cait", "cait_xxs_patch4_32", dict(SMALL, depth_token_only=1)),
    Case("cait_xxs24_224 (timm name)", "cait_xxs24_224", dict(depth=2, img_size=64)),
    Case("convit", "convit_tiny_patch4_32", dict(depth=3, local_up_to_layer=2)),
    Case("convit_tiny (timm name)", "convit_tiny", dict(depth=3, local_up_to_layer=2, img_size=64)),
    Case("resnet18", "resnet18", dict(num_classes=10, img_size=64)),
    Case("resnet34", "resnet34", dict(num_classes=10, img_size=64)),
    Case("hf fixture ViT (layer_norm_eps 1e-12)", str(PARITY / "hf_vit"), {}, ("hf",)),
    Case("hf fixture DeiT distilled", str(PARITY / "hf_deit_distilled"), {}, ("hf",)),
    Case("timm fixture CaiT", str(PARITY / "timm_cait"), {}, ("timm",)),
]


def timm_by_file(folder: Path) -> nn.Module:
    cfg = json.loads((folder / "config.json").read_text())
    overlay = dict(file=str(folder / "model.safetensors"), num_classes=cfg["num_classes"])
    return timm.create_model(cfg["architecture"], pretrained=True, pretrained_cfg_overlay=overlay,
                             **cfg["model_args"])


def timm_by_hub_loader(folder: Path) -> nn.Module:
    return timm.create_model(f"local-dir:{folder}", pretrained=True)


class HfLogits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def hf_from_pretrained(folder: Path) -> nn.Module:
    return HfLogits(transformers.AutoModelForImageClassification.from_pretrained(folder))


LOADERS = {"timm": [("timm file=", timm_by_file), ("timm local-dir:", timm_by_hub_loader)],
           "hf": [("transformers", hf_from_pretrained)]}


def run_case(case: Case, seed: int) -> list[tuple[str, float, str | None]]:
    torch.manual_seed(seed)
    model = case.build()
    x = torch.randn(BATCH, *model.pretrained_cfg["input_size"])
    with torch.no_grad():
        ours = model(x)
    rows = []
    for fmt in case.formats:
        with tempfile.TemporaryDirectory() as tmp:
            folder = export(model, fmt, Path(tmp) / fmt)
            for label, loader in LOADERS[fmt]:
                try:
                    peer = loader(folder).eval()
                    with torch.no_grad():
                        diff = float((peer(x) - ours).abs().max())
                    rows.append((label, diff, None))
                except Exception as e:  # noqa: BLE001 - a loader failure is a result, reported in the table
                    rows.append((label, float("nan"), f"{type(e).__name__}: {e}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run only the cases whose name contains one of these")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("timm").setLevel(logging.ERROR)
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    print(f"vitlab {vitlab.__version__} exports vs timm {timm.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}; tolerance {TOL:g}\n")
    width = max(len(c.name) for c in cases)
    print(f"{'case':<{width}}  {'loaded by':<16}  {'max |diff|':>10}  pass")
    t0, failures, total = time.perf_counter(), [], 0
    for seed, case in enumerate(cases):
        for label, diff, error in run_case(case, seed):
            total += 1
            ok = error is None and diff <= TOL
            if not ok:
                failures.append(f"{case.name} / {label}: {error or f'{diff:.2e}'}")
            print(f"{case.name:<{width}}  {label:<16}  {diff:>10.2e}  {'yes' if ok else 'NO'}", flush=True)
    print(f"\n{total - len(failures)}/{total} loads match ({time.perf_counter() - t0:.0f} s)")
    for f in failures:
        print(f"  FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
