"""Throughput of vitlab's BEiT, EVA02 and RoPE ViT against timm's on the same weights, float32 on the CPU.

Each family is built in timm at a small ImageNet-like size (96x96, patch 16 or 14, width 192, depth 6), written
with timm's ``save_for_hf`` and read back by ``vitlab.load``; then inference (eval, ``inference_mode``) and a
training step (forward, backward, AdamW) of the two models alternate in one process, and the median of the
per-pair time ratios is printed (timm / vitlab: above 1 means vitlab is faster).

Run in the reference environment (timm), from the repository root:

    PYTHONPATH=src ~/.cache/vitlab-reference/venv/bin/python benchmarks/speed_vs_timm_families.py [NAME ...]
"""
from __future__ import annotations

import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch
from timm.models import save_for_hf

import vitlab

SMALL = dict(img_size=96, embed_dim=192, depth=6, num_heads=3, num_classes=10)
CASES = {  # label -> (timm name, arguments)
    "beit": ("beit_base_patch16_224", SMALL),
    "beitv2": ("beitv2_base_patch16_224", SMALL),
    "eva02": ("eva02_tiny_patch14_224", dict(SMALL, img_size=98)),
    "vit_rope_axial": ("vit_small_patch16_rope_224", SMALL),
    "vit_rope_mixed": ("vit_small_patch16_rope_mixed_224", SMALL),
}
BATCH = 32


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def stepper(model, x, y, train):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    model.train(train)

    def step():
        if not train:
            with torch.inference_mode():
                model(x)
            return
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def ratio(ref, ours, x, y, train: bool, pairs: int) -> float:
    s_ref, s_ours = stepper(ref, x, y, train), stepper(ours, x, y, train)
    for _ in range(2):
        s_ref(), s_ours()
    ratios = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        s_ref()
        t1 = time.perf_counter()
        s_ours()
        ratios.append((t1 - t0) / (time.perf_counter() - t1))
    return statistics.median(ratios)


def main(argv: list[str]) -> int:
    logging.getLogger("timm").setLevel(logging.ERROR)
    names = argv or list(CASES)
    print(f"vitlab {vitlab.__version__} vs timm {timm.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {cpu_name()}; batch {BATCH}, float32\n")
    print(f"{'family':<16} {'timm name':<34} {'infer':>7} {'train':>7}")
    worst = float("inf")
    for name in names:
        arch, args = CASES[name]
        torch.manual_seed(0)
        ref = timm.create_model(arch, **args)
        with tempfile.TemporaryDirectory() as d:
            save_for_hf(ref, d, model_args=args, safe_serialization=True)
            ours = vitlab.load(d)
        x = torch.randn(BATCH, 3, *ours.patch_embed.img_size)
        y = torch.randint(0, 10, (BATCH,))
        infer, train = ratio(ref, ours, x, y, False, 9), ratio(ref, ours, x, y, True, 5)
        worst = min(worst, infer, train)
        print(f"{name:<16} {arch:<34} {infer:>6.2f}x {train:>6.2f}x", flush=True)
    print(f"\nworst ratio {worst:.2f}x (timm time / vitlab time; >= 0.95 is the target)")
    return 0 if worst >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
