"""Seconds per image of each explanation method (and of ROAD's imputation) on this CPU.

    PYTHONPATH=src python benchmarks/explain_speed.py RUN_OR_MODEL [--images 64] [--batch-size 32] [--repeats 3]

Times explain() for every method of the model (from the class token) on random normalised images of its input
size (a method's cost does not depend on what the image shows), and noisy_linear_imputation of half the patches;
prints the median over the repeats of CPU seconds (process time, all threads) and wall seconds per image.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vitlab
from vitlab.analysis.explain import REGISTRY, explain
from vitlab.analysis.faithfulness import patch_mask, random_order
from vitlab.analysis.road import noisy_linear_imputation


def timed(fn, images: torch.Tensor, batch: int, repeats: int) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) per image of fn over the images in batches."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(0, len(images), batch):
            fn(images[i:i + batch])
        cpu.append((time.process_time() - c0) / len(images))
        wall.append((time.perf_counter() - w0) / len(images))
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a run folder or a registered model name")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_pretrain import cpu_name  # one CPU name for every benchmark
    model = (vitlab.load(args.model) if Path(args.model).exists() else vitlab.create_model(args.model)).eval()
    C, H, W = model.pretrained_cfg["input_size"]
    images = torch.randn(args.images, C, H, W, generator=torch.Generator().manual_seed(0))
    grid = tuple(model.patch_embed.grid_size)
    print(f"{args.model}: {args.images} images {C}x{H}x{W}, batches of {args.batch_size}, "
          f"{torch.get_num_threads()} thread(s), {cpu_name()}; median of {args.repeats}")
    print("| method | CPU s / image | wall s / image |\n| --- | ---: | ---: |")
    for name, m in REGISTRY.items():
        cpu, wall = timed(lambda x, name=name: explain(model, x, name, 0, discard_ratio=0.9), images, args.batch_size,
                          args.repeats)
        print(f"| {m.label} | {cpu:.4f} | {wall:.4f} |")

    def road(x):
        order = random_order(len(x), grid[0] * grid[1], torch.Generator().manual_seed(0))
        noisy_linear_imputation(x, patch_mask(order, grid[0] * grid[1] // 2, grid, (H, W)))
    cpu, wall = timed(road, images, args.batch_size, args.repeats)
    print(f"| ROAD imputation of half the patches (one fraction, one order) | {cpu:.4f} | {wall:.4f} |")


if __name__ == "__main__":
    main()
