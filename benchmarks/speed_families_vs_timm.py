"""Throughput of vitlab against timm on the same weights, per family, float32 on the CPU.

Each case builds timm's model with random weights, writes it with ``save_for_hf``, reads that folder with
``vitlab.load`` (outputs checked equal within 1e-4), then times inference (eval, ``inference_mode``) and a training
step (forward, backward, AdamW) of the two models in turn in one process (timm, vitlab, timm, ...), so that the
machine's load hits both alike. A ratio is the median over rounds of timm's time / vitlab's: above 1, vitlab is
faster; the target is at least 0.95 for every family.

The transformer families are built small (width 192, depth 6, 3 heads, 96x96 inputs; EVA02's patch 14 takes 98);
the hybrids and Mixers keep their own widths at a small batch.

Run in the reference environment (timm), from the repository root:

    PY=$(../shared/tools/reference-env.sh)
    PYTHONPATH=src $PY benchmarks/speed_families_vs_timm.py [--threads 2] [CASE ...]
"""
from __future__ import annotations

import argparse
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
CASES = {  # label -> (timm name, model arguments, batch)
    "BEiT": ("beit_base_patch16_224", SMALL, 32),
    "BEiT v2": ("beitv2_base_patch16_224", SMALL, 32),
    "EVA02": ("eva02_tiny_patch14_224", dict(SMALL, img_size=98), 32),
    "RoPE ViT, axial": ("vit_small_patch16_rope_224", SMALL, 32),
    "RoPE ViT, mixed": ("vit_small_patch16_rope_mixed_224", SMALL, 32),
    "ViT-22B parallel block": ("vit_pwee_patch16_reg1_gap_256", SMALL, 32),
    "DINOv3": ("vit_small_patch16_dinov3", SMALL, 32),
    "DINOv3 S/16 at 224": ("vit_small_patch16_dinov3", dict(img_size=224, num_classes=10), 8),
    "Perception Encoder Core": ("vit_pe_core_tiny_patch16_384", SMALL, 32),
    "PE-Core S/16 at 224": ("vit_pe_core_small_patch16_384", dict(img_size=224, num_classes=10), 8),
    "PE-Core B/16 at 224": ("vit_pe_core_base_patch16_224", dict(num_classes=10), 4),
    "NaFlex ViT, SigLIP 2": ("naflexvit_base_patch16_siglip", SMALL, 32),
    "NaFlex ViT, GAP + registers": ("naflexvit_base_patch16_gap", SMALL, 32),
    "RMSNorm ViT (_xp_)": ("vit_base_patch16_xp_224", SMALL, 32),
    "SwiGLU giant (DINOv2)": ("vit_giant_patch14_dinov2", dict(SMALL, img_size=98), 32),
    "EVA-CLIP-E post-norm": ("eva02_enormous_patch14_clip_224", dict(SMALL, img_size=98), 32),
    "LingBot": ("vit_small_patch16_lingbot", SMALL, 32),
    "Sapiens2 (grouped-query)": ("vit_base_patch16_sapiens2", dict(SMALL, num_heads=6, num_kv_heads=(6, 6, 3, 3, 6, 6)),
                                 32),
    "AIMv2": ("aimv2_large_patch14_224", dict(SMALL, img_size=98), 32),
    "Qwen3-VL ViT": ("qwen3_vit_88m", dict(SMALL, pos_embed_grid_size=6), 32),
    "Qwen3-VL ViT, merger": ("qwen3_vit_88m_merge", dict(SMALL, pos_embed_grid_size=6, out_features=192), 32),
    "DeepSeek ViT": ("deepseek_vit_412m", dict(SMALL, img_size=98), 32),
    "DeepSeek ViT, aligner": ("deepseek_vit_412m_align", dict(SMALL, img_size=98, out_features=192), 32),
    "Gemma 4 ViT": ("gemma4_vit_167m", dict(SMALL, head_dim=64, intermediate_size=768, position_embedding_size=64), 32),
    "R+ViT-Ti/16 hybrid": ("vit_tiny_r_s16_p8_224", dict(num_classes=10), 16),
    "R26+ViT-S/32 hybrid, at 128": ("vit_small_r26_s32_224", dict(img_size=128, num_classes=10), 8),
    "R50+ViT-B/16 hybrid, 4 blocks, at 128": ("vit_base_r50_s16_224", dict(img_size=128, depth=4, num_classes=10), 4),
    "MLP-Mixer S/16": ("mixer_s16_224", dict(num_classes=10), 8),
    "MLP-Mixer B/32": ("mixer_b32_224", dict(num_classes=10), 8),
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def stepper(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, train: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    model.train(train)

    def step() -> None:
        if not train:
            with torch.inference_mode():
                model(x)
            return
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def ratio(ref: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, train: bool,
          rounds: int) -> tuple[float, float]:
    """(median of timm's time / vitlab's over ``rounds`` interleaved pairs, vitlab's median seconds per step)."""
    s_ref, s_ours = stepper(ref, x, y, train), stepper(ours, x, y, train)
    for _ in range(2):  # warm-up
        s_ref(), s_ours()
    ratios, ours_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        s_ref()
        t1 = time.perf_counter()
        s_ours()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
        ours_s.append(t2 - t1)
    return statistics.median(ratios), statistics.median(ours_s)


def case(arch: str, args: dict, batch: int, rounds: int) -> tuple[float, float, float]:
    """(inference ratio, training-step ratio, vitlab's seconds per training step) for one timm model."""
    torch.manual_seed(0)
    ref = timm.create_model(arch, **args).eval()
    with tempfile.TemporaryDirectory() as d:
        save_for_hf(ref, d, model_args=args, safe_serialization=True)
        ours = vitlab.load(d).eval()
    size = ref.pretrained_cfg["input_size"][1:] if "img_size" not in args else (args["img_size"],) * 2
    x, y = torch.randn(batch, 3, *size), torch.randint(0, 10, (batch,))
    with torch.inference_mode():
        gap = (ref(x) - ours(x)).abs().max().item()
    if gap > 1e-4:
        raise SystemExit(f"{arch}: vitlab's outputs differ from timm's by {gap:.2e} (> 1e-4)")
    infer, _ = ratio(ref, ours, x, y, False, rounds)
    train, step_s = ratio(ref, ours, x, y, True, max(3, rounds // 2))
    return infer, train, step_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run only the cases whose label contains one of these")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved inference pairs (training: half)")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    logging.getLogger("timm").setLevel(logging.ERROR)
    print(f"vitlab {vitlab.__version__} vs timm {timm.__version__}, torch {torch.__version__}, float32, {cpu_name()}, "
          f"{a.threads} thread(s); timm time / vitlab time, medians of interleaved rounds\n")
    print("| family | timm name | batch | inference | training step | vitlab s/step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    worst = float("inf")
    for label, (arch, args, batch) in CASES.items():
        if a.only and not any(s.lower() in label.lower() for s in a.only):
            continue
        infer, train, step_s = case(arch, args, batch, a.rounds)
        worst = min(worst, infer, train)
        print(f"| {label} | `{arch}` | {batch} | {infer:.2f}x | {train:.2f}x | {step_s:.3f} |", flush=True)
    print(f"\nworst ratio {worst:.2f}x (>= 0.95 is the target)")
    return 0 if worst >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
