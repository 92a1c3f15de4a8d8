"""Throughput of vitlab's batched augmentation: images/s per stage and for the full pipeline.

Usage: python benchmarks/bench_augment.py [--batch 256] [--runs 15] [--threads 2] [--device cpu] [--no-kornia]

Each row is the median over --runs timed calls (after warm-up; rows are timed round-robin so that load drift hits
all of them alike) on a batch of random uint8 images, for CIFAR-like 3x32x32 (pad 4) and digits-like 1x8x8 (pad 1).
Stages are timed on the input they see in the pipeline (uint8 for crops, float 0..255 for the auto-augment ops,
normalised float for erasing and mixing). The load average is printed because other processes on a small shared
CPU change the numbers a lot; with 2 threads on a busy machine every multi-threaded op can stall for milliseconds
(compare --threads 1, or run with OMP_WAIT_POLICY=PASSIVE in the environment, which avoids the stalls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from vitlab.data.augment import AugmentConfig, BatchAugment, normalize, smooth_one_hot


def _median_seconds(fns: list[Callable[[], object]], runs: int, device: torch.device) -> list[tuple[float, float]]:
    """(median wall time, median process CPU time) of each fn() over `runs` rounds.

    Rounds visit every fn in turn so load drift hits all alike. CPU time counts every thread of this process, so with
    1 thread it approximates the time on an idle machine; with more threads it includes their busy-waiting.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:  # warm-up
        fn()
        fn()
    sync()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - start_cpu)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def _kornia_pipeline(size: tuple[int, int], padding: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """kornia crop+flip+TrivialAugment+erasing on float 0..1 (note: kornia picks ONE op per batch), or None."""
    try:
        import kornia.augmentation as K
        from kornia.augmentation.auto import TrivialAugment
    except Exception:  # pragma: no cover - optional comparison
        return None
    seq = K.AugmentationSequential(
        K.RandomCrop(size, padding=padding, padding_mode="reflect"),
        K.RandomHorizontalFlip(),
        TrivialAugment(),
        K.RandomErasing(p=0.25),
    )
    return lambda x: seq(x.float().div_(255))


def bench_dataset(name: str, shape: tuple[int, int, int], padding: int, args: argparse.Namespace) -> None:
    """Print one table for images of `shape` (C, H, W)."""
    device = torch.device(args.device)
    c, h, w = shape
    b, k = args.batch, 10
    images = torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, device=device)
    labels = torch.randint(0, k, (b,), device=device)
    mean, std = [0.5] * c, [0.25] * c

    def module(**overrides: object) -> BatchAugment:
        return BatchAugment(AugmentConfig(padding=padding, **overrides), (h, w), mean, std, k)

    default, rrc, rand = module(), module(crop="rrc"), module(auto_augment="rand")
    as_float = images.float()
    normed = normalize(images, mean, std)
    targets = smooth_one_hot(labels, k, 0.1)
    rows: list[tuple[str, Callable[[], object]]] = [
        ("to float + normalise (eval path)", lambda: normalize(images, mean, std)),
        (f"pad-crop ({padding}, reflect) + flip", lambda: default.crop_flip(images)),
        ("random resized crop + flip", lambda: rrc.crop_flip(images)),
        ("TrivialAugment (1 op / image)", lambda: default.auto_augment(as_float)),
        ("RandAugment (2 ops / image, m=9)", lambda: rand.auto_augment(as_float)),
        ("random erasing (p=0.25)", lambda: default.erase(normed.clone())),
        ("mixup/cutmix + smoothing", lambda: default.mix(normed.clone(), targets)),
        ("clone (baseline for the two rows above)", lambda: normed.clone()),
        ("FULL: pad+flip+TA+erase+mix", lambda: default(images, labels)),
        ("FULL: rrc+flip+TA+erase+mix", lambda: rrc(images, labels)),
        ("FULL: pad+flip+RA+erase+mix", lambda: rand(images, labels)),
    ]
    kornia_seq = _kornia_pipeline((h, w), padding) if args.kornia else None
    if kornia_seq is not None:
        rows.append(("kornia crop+flip+TA+erase (ref.)", lambda: kornia_seq(images)))

    print(f"\n{name}: batch {b} x {c}x{h}x{w} uint8 on {device}, median of {args.runs}")
    print(f"{'stage':<42}{'ms/batch':>10}{'images/s':>12}{'cpu ms':>10}")
    medians = _median_seconds([fn for _, fn in rows], args.runs, device)
    for (label, _), (seconds, cpu_seconds) in zip(rows, medians):
        print(f"{label:<42}{seconds * 1e3:>10.2f}{b / seconds:>12,.0f}{cpu_seconds * 1e3:>10.2f}")


def main() -> None:
    """Parse arguments and print the CIFAR and digits tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-kornia", dest="kornia", action="store_false", help="skip the kornia reference row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"torch {torch.__version__}, {args.threads} threads, OMP_WAIT_POLICY={policy}, load average {load:.2f}")
    bench_dataset("CIFAR-like", (3, 32, 32), 4, args)
    bench_dataset("digits-like", (1, 8, 8), 1, args)


if __name__ == "__main__":
    main()
