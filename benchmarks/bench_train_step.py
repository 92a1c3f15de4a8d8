"""Training throughput: vitlab's whole step against the bare model step, float32 and bf16.

The whole step is the trainer's own `train_step`: uint8 batch -> batched augmentation
(pad-crop, flip, TrivialAugment, random erasing, mixup/cutmix, label smoothing) -> forward ->
soft-target loss -> backward -> gradient clipping -> AdamW. The bare step is forward, cross-entropy,
backward and AdamW on pre-made float tensors. Variants are interleaved in one process and the
median of several rounds is reported, because the machine is shared and noisy.

    python benchmarks/bench_train_step.py [--model vit_tiny_patch4_32] [--batch 128] [--rounds 7]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import vitlab
from vitlab.data.augment import AugmentConfig, BatchAugment
from vitlab.devices import autocast
from vitlab.train.optim import param_groups
from vitlab.train.step import Batch, Stepper, train_step
from vitlab.train.tasks.supervised import HeadsLoss


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    have = set(flags.split(":", 1)[1].split())
    return ", ".join(f"{f}={'yes' if f in have else 'no'}" for f in wanted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit_tiny_patch4_32")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = vitlab.create_model(args.model).train()
    c, h, w = model.pretrained_cfg["input_size"]
    k = model.num_classes
    images = torch.randint(0, 256, (args.batch, c, h, w), dtype=torch.uint8)
    labels = torch.randint(0, k, (args.batch,))
    x = torch.randn(args.batch, c, h, w)
    augment = BatchAugment(AugmentConfig(), (h, w), model.pretrained_cfg["mean"], model.pretrained_cfg["std"], k)
    loss_fn = HeadsLoss()
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-4)

    def whole(precision: str):
        stepper = Stepper(model, augment, loss_fn, optimizer, precision, clip_grad=1.0)
        return lambda: train_step(stepper, Batch(images, labels))

    def bare(precision: str):
        def step():
            with autocast(x.device, precision):
                loss = F.cross_entropy(model(x), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return step

    variants = {(kind, p): (whole if kind == "whole" else bare)(p)
                for kind in ("bare", "whole") for p in ("fp32", "bf16")}
    for fn in variants.values():  # warm up
        fn()
        fn()
    times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[v].append(time.perf_counter() - t)
    rate = {v: args.batch / statistics.median(ts) for v, ts in times.items()}

    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"CPU: {cpu_flags()}")
    print(f"{'precision':<10}{'bare img/s':>12}{'whole img/s':>13}{'whole/bare':>12}")
    for p in ("fp32", "bf16"):
        print(f"{p:<10}{rate[('bare', p)]:>12.0f}{rate[('whole', p)]:>13.0f}"
              f"{rate[('whole', p)] / rate[('bare', p)]:>12.2f}")
    print(f"bf16/fp32: bare {rate[('bare', 'bf16')] / rate[('bare', 'fp32')]:.2f}x, "
          f"whole {rate[('whole', 'bf16')] / rate[('whole', 'fp32')]:.2f}x")


if __name__ == "__main__":
    main()
