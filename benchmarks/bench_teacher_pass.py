"""The distillation teacher's forward pass, contiguous against channels-last: the pass that `--teacher-once` makes
over the training set (each image and its mirror image), timed through the trainer's own `TrainLoss.predict_once`.

Teachers with convolutional stages run channels-last (`has_conv_stages`); this script shows what that buys on the
box at hand. The two layouts are interleaved round by round in one process and the median round is reported,
because the machine is shared and noisy. Random weights and random images: the arithmetic is that of a trained
teacher on CIFAR-10.

    python benchmarks/bench_teacher_pass.py [--models airbench_32,resnet18_32,vit_nano_airbench_32] \
        [--images 2048] [--batch 256] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from cifar10_speedrun import machine  # the benchmarks folder is the script's own

import vitlab
from vitlab.train.step import has_conv_stages
from vitlab.train.tasks.distillation import TrainLoss


def pass_seconds(loss: TrainLoss, images: torch.Tensor, batch: int, clock=time.perf_counter) -> float:
    """Seconds of one teacher pass over ``images`` (uint8) and their mirror images."""
    t0 = clock()
    loss.predict_once(images, loss.teacher.pretrained_cfg["mean"], loss.teacher.pretrained_cfg["std"], batch)
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="airbench_32,resnet18_32,vit_nano_airbench_32")
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if min(args.images, args.batch, args.rounds, args.threads) < 1:
        ap.error("--images, --batch, --rounds and --threads: accepted: whole numbers >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    images = torch.randint(0, 256, (args.images, 3, 32, 32), dtype=torch.uint8)
    print(f"The teacher's pass over {args.images} images and their mirror images, batch {args.batch}, median of "
          f"{args.rounds} rounds, on {machine()}")
    print("| teacher | convolutional stages | contiguous (images/s, each with its mirror) | channels-last | ratio |")
    print("|---|---|---|---|---|")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        layouts = {cl: TrainLoss(vitlab.create_model(name, num_classes=10), "soft", teacher_channels_last=cl)
                   for cl in (False, True)}
        for loss in layouts.values():
            pass_seconds(loss, images[:args.batch], args.batch)  # warm-up: the kernels' first choice
        seconds = {cl: [] for cl in layouts}
        for _ in range(args.rounds):
            for cl, loss in layouts.items():
                seconds[cl].append(pass_seconds(loss, images, args.batch))
        rate = {cl: args.images / statistics.median(s) for cl, s in seconds.items()}
        print(f"| {name} | {'yes' if has_conv_stages(layouts[False].teacher) else 'no'} | {rate[False]:.0f} | "
              f"{rate[True]:.0f} | {rate[True] / rate[False]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
