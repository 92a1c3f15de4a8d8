"""Transfer on CIFAR-10 with few labels: fine-tuning with and without layer decay, linear probe, k-NN, from scratch.

A backbone is trained on five CIFAR-10 classes (airplane, automobile, bird, cat, deer) for a stated budget; it
then meets the other five (dog, frog, horse, ship, truck) with 10% of their training labels (--train-fraction,
the same 500 images a class in every arm) and is judged on their whole test split: fine-tuned without and with
layer-wise lr decay, by `vitlab probe` (DINO's 20-NN and the linear probe on frozen features), and against the
same model trained from scratch on the same images for the same epochs. Every arm is the `vitlab` command a user
runs; the table gives its test top-1 and wall time, with the CPU (or GPU) named.

    python benchmarks/finetune_transfer.py [--tar ../shared/data/cifar10-jpg.tar.gz] [--work DIR]
        [--model vit_nano_patch4_32] [--img-size 16] [--pretrain-minutes 6] [--epochs 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

FIRST = ("airplane", "automobile", "bird", "cat", "deer")   # classes 0-4: the backbone's
SECOND = ("dog", "frog", "horse", "ship", "truck")          # classes 5-9: the new task


def device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def split_tar(tar: Path, work: Path) -> tuple[Path, Path]:
    """Unpack train/<class>/ and test/<class>/ of the archive into two image folders: classes 0-4 and 5-9."""
    a, b = work / "cifar10-0-4", work / "cifar10-5-9"
    if (a / "done").is_file() and (b / "done").is_file():
        return a, b
    with tarfile.open(tar) as t:
        for m in t.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) != 3 or parts[0] not in ("train", "test"):
                continue
            root = a if parts[1] in FIRST else b if parts[1] in SECOND else None
            if root is None:
                raise ValueError(f"{tar}: unexpected class folder {parts[1]!r}")
            dest = root / parts[0] / parts[1] / parts[2]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with t.extractfile(m) as src:
                dest.write_bytes(src.read())
    for root in (a, b):
        (root / "done").write_text("")
    return a, b


def vitlab(*args: str) -> tuple[float, str]:
    """Run a vitlab command; (wall seconds, its stdout). A failure stops the benchmark with its error."""
    cmd = [sys.executable, "-m", "vitlab", *map(str, args)]
    print("$ vitlab " + " ".join(map(str, args)), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"vitlab {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return seconds, proc.stdout


def train_arm(name: str, out: Path, *args: str) -> tuple[str, float, float]:
    """(name, test top-1, wall seconds) of `vitlab train ... --out OUT`; a finished run is read back (its own wall
    time from summary.json), so a benchmark started again continues where it stopped."""
    if (out / "summary.json").is_file():
        summary = json.loads((out / "summary.json").read_text())
        return name, summary["top1"], summary["wall_seconds"]
    seconds, _ = vitlab("train", *args, "--out", out)
    return name, json.loads((out / "summary.json").read_text())["top1"], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tar", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpg.tar.gz")
    ap.add_argument("--work", type=Path, default=Path("runs/finetune_transfer"))
    ap.add_argument("--model", default="vit_nano_patch4_32")
    ap.add_argument("--img-size", type=int, default=16, help="train and test at this size (CIFAR's own: 32)")
    ap.add_argument("--pretrain-minutes", type=float, default=6.0, help="the backbone's time budget on classes 0-4")
    ap.add_argument("--epochs", type=int, default=5, help="epochs of every arm on the 10%% of classes 5-9")
    ap.add_argument("--train-fraction", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-3, help="from scratch; fine-tuning takes half of it")
    ap.add_argument("--layer-decay", type=float, default=0.75)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()

    work = args.work
    a, b = split_tar(args.tar, work)
    runs, cache = work / "runs", work / "cache"
    # light augmentation for short schedules, the same in every arm; --eval-every keeps one evaluation per arm
    common = ["--img-size", args.img_size, "--threads", args.threads, "--device", args.device, "--cache-dir", cache,
              "--precision", "fp32", "--batch-size", 128, "--auto-augment", "none", "--mixup", 0, "--cutmix", 0,
              "--random-erasing", 0]
    target = ["--data", b, "--train-fraction", args.train_fraction, "--epochs", args.epochs,
              "--eval-every", args.epochs]
    backbone = runs / "backbone"
    rows = [train_arm(f"backbone: classes 0-4, all labels, {args.pretrain_minutes:g} min", backbone, "--data", a,
                      "--model", args.model, "--time-budget", args.pretrain_minutes, "--lr", args.lr, *common)]
    arms = [("fine-tuned, no layer decay", "finetune", ["--init", backbone, "--lr", args.lr / 2]),
            (f"fine-tuned, layer decay {args.layer_decay:g}", "finetune-ld", ["--init", backbone, "--lr", args.lr / 2,
                                                                             "--layer-decay", args.layer_decay]),
            ("from scratch", "scratch", ["--model", args.model, "--lr", args.lr])]
    rows += [train_arm(name, runs / folder, *target, *extra, *common) for name, folder, extra in arms]
    vitlab("probe", backbone, "--data", b, "--train-fraction", args.train_fraction, "--threads",
                        args.threads, "--device", args.device, "--cache-dir", cache, "--out", runs / "probe")
    probe = json.loads((runs / "probe" / "probe.json").read_text())
    t = probe["seconds"]  # each classifier with the features it needs (both splits, extracted once)
    rows.append((f"linear probe (frozen, {probe['features']} features)", probe["linear"]["top1"],
                 t["features"] + t["linear"]))
    rows.append(("20-NN (frozen)", probe["knn"]["top1"], t["features"] + t["knn"]))

    print(f"\n{args.model} at {args.img_size}x{args.img_size} on {device_name(args.device)}, {args.threads} thread(s); "
          f"classes 5-9 with {100 * args.train_fraction:g}% of the labels ({probe['num_train']} images), "
          f"{probe['num_test']} test images, {args.epochs} epochs per trained arm\n")
    print("| arm | test top-1 | wall s |")
    print("|---|---:|---:|")
    for name, acc, seconds in rows:
        print(f"| {name} | {100 * acc:.2f}% | {seconds:.0f} |")


if __name__ == "__main__":
    main()
