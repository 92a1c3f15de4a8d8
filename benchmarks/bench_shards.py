"""Training images/s delivered from WebDataset shards against the store, on this machine.

Generates a folder of JPEG photos (smooth colour fields with noise, ``--side`` pixels, every third one wider:
bench_data.py's), stores it at the training size, packs it as shards twice (``vitlab data pack``): the JPEG files as
they are, and pre-resized (the same photos saved as JPEG at the training size, so a worker decodes without
resizing). Then reads epochs of batches of ``--batch`` through the trainer's feeders, the variants interleaved for
``--rounds`` rounds: the store (a gather of rows; ``BatchFeeder``), and the shards with 1 and 2 DataLoader
workers (``ShardFeeder``: read, shuffle buffer, Pillow decode and resize by the store's rule, stack). Prints the
median images/s of each and its ratio to the store. No model runs: this is the rate the data reaches a step at.

    python benchmarks/bench_shards.py [--images 1200] [--side 320] [--size 224] [--batch 64] [--rounds 3]
        [--root /tmp/vitlab-bench-shards]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from bench_data import make_folder
from PIL import Image

from vitlab.data.pack import pack
from vitlab.data.shards import ShardReader
from vitlab.data.sources import load_data
from vitlab.train.feed import BatchFeeder, EpochPlan, ShardFeeder


def resized_copy(folder: Path, out: Path, size: int) -> None:
    """The folder's photos as JPEG at size x size (squashed, as the store decodes them)."""
    if (out / ".complete").exists():
        return
    for p in sorted(folder.rglob("*.jpg")):
        dest = out / p.relative_to(folder)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(p) as img:
            img.convert("RGB").resize((size, size), Image.Resampling.BICUBIC).save(dest, quality=90)
    (out / ".complete").write_text("1")


def epoch_rate(feeder, n: int, batch: int, seed: int) -> float:
    """Images/s of one epoch of batches from a feeder (every image once)."""
    plan = EpochPlan(n, max(1, n // batch), seed)
    t0 = time.perf_counter()
    seen = sum(len(labels) for _, labels, _ in feeder.epoch(plan))
    assert seen == n, (seen, n)
    return n / (time.perf_counter() - t0)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--side", type=int, default=320)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/tmp/vitlab-bench-shards")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root)
    os.environ.setdefault("VITLAB_CACHE", str(root / "cache"))
    folder, small = root / "photos", root / f"photos-{args.size}"
    make_folder(folder, args.images, args.side, 10, 2)
    resized_copy(folder, small, args.size)
    quiet = lambda s: None  # noqa: E731
    for src, out in ((folder, root / "shards-jpeg"), (small, root / f"shards-{args.size}")):
        if not (out / "_info.json").exists():
            pack(src, out, 64 << 20, val_fraction=0.1, log=quiet)
    store = load_data(folder, img_size=args.size, val_fraction=0.1, log=quiet)
    n = store.num_train
    variants = {"store (gather of rows)": BatchFeeder(store.train.images, store.train.labels, torch.device("cpu"))}
    for name, out in (("JPEG shards", root / "shards-jpeg"), (f"pre-resized {args.size} shards",
                                                               root / f"shards-{args.size}")):
        data = load_data(f"wds:{out}", img_size=args.size, log=quiet)
        assert data.num_train == n
        for workers in (1, 2):
            variants[f"{name}, {workers} worker{'s' if workers > 1 else ''}"] = ShardFeeder(
                ShardReader(data.shards, workers=workers), torch.device("cpu"), workers)
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, feeder in variants.items():
            rates[name].append(epoch_rate(feeder, n, args.batch, r))
    base = statistics.median(rates["store (gather of rows)"])
    print(f"{n} training images, {args.side}px JPEG photos trained at {args.size}x{args.size}, batches of "
          f"{args.batch}, median of {args.rounds} interleaved epochs; {cpu_name()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}")
    print(f"| {'source':<38} | {'img/s':>8} | {'vs store':>8} |")
    print(f"|{'-' * 40}|{'-' * 10}:|{'-' * 10}:|")
    for name, values in rates.items():
        m = statistics.median(values)
        print(f"| {name:<38} | {m:8.0f} | {m / base:7.3f}x |")


if __name__ == "__main__":
    main()
