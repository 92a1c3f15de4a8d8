"""Inference throughput of vitlab against timm on the same weights, per family, float32 on the CPU.

Each case builds timm's model, writes it with ``save_for_hf``, loads that folder with ``vitlab.load`` and times
both on one batch, interleaved in one process (timm, vitlab, timm, ...) so that the machine's load hits both
alike; the ratio is the median over rounds of timm's time / vitlab's (above 1: vitlab is faster).

Run in the reference environment (timm), from the repository root:

    PY=$(../shared/tools/reference-env.sh) && PYTHONPATH=src $PY benchmarks/speed_families_vs_timm.py [--threads 1]
"""
from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time

import timm
import torch
from timm.models import save_for_hf

import vitlab

# label -> (timm name, model_args, batch)
CASES = {
    "R+ViT-Ti/16 hybrid (vit_tiny_r_s16_p8_224)": ("vit_tiny_r_s16_p8_224", {}, 16),
    "R26+ViT-S/32 hybrid at 128 (vit_small_r26_s32_224)": ("vit_small_r26_s32_224", dict(img_size=128), 8),
    "R50+ViT-B/16 hybrid, 4 blocks, at 128 (vit_base_r50_s16_224)": ("vit_base_r50_s16_224",
                                                                      dict(img_size=128, depth=4), 4),
    "MLP-Mixer S/16 (mixer_s16_224)": ("mixer_s16_224", {}, 8),
    "MLP-Mixer B/32 (mixer_b32_224)": ("mixer_b32_224", {}, 8),
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def ratio(arch: str, args: dict, batch: int, rounds: int) -> tuple[float, float]:
    """(median timm seconds / vitlab seconds, vitlab's median seconds per batch)."""
    ref = timm.create_model(arch, **args).eval()
    with tempfile.TemporaryDirectory() as d:
        save_for_hf(ref, d, model_args=args, safe_serialization=True)
        ours = vitlab.load(d).eval()
    size = ref.pretrained_cfg["input_size"][1:] if "img_size" not in args else (args["img_size"],) * 2
    x = torch.randn(batch, 3, *size)
    with torch.inference_mode():
        assert (ref(x) - ours(x)).abs().max() < 1e-4, arch
        ratios, ours_s = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            ref(x)
            t1 = time.perf_counter()
            ours(x)
            t2 = time.perf_counter()
            ratios.append((t1 - t0) / (t2 - t1))
            ours_s.append(t2 - t1)
    return statistics.median(ratios), statistics.median(ours_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run only the cases whose label contains one of these")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    logging.getLogger("timm").setLevel(logging.ERROR)
    print(f"vitlab {vitlab.__version__} vs timm {timm.__version__}, torch {torch.__version__}, float32 inference, "
          f"{cpu_name()}, {a.threads} thread(s), median of {a.rounds} interleaved rounds\n")
    print(f"{'case':<64} {'batch':>5} {'vitlab s':>9} {'timm/vitlab':>11}")
    ok = True
    for label, (arch, args, batch) in CASES.items():
        if a.only and not any(s in label for s in a.only):
            continue
        r, s = ratio(arch, args, batch, a.rounds)
        ok &= r >= 0.95
        print(f"{label:<64} {batch:>5} {s:>9.3f} {r:>10.2f}x", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
