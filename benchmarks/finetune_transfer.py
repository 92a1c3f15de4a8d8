"""Transfer on CIFAR-10 with few labels: fine-tuning (with and without layer decay, LoRA), linear probe, k-NN, scratch.

A backbone is trained on five CIFAR-10 classes (airplane, automobile, bird, cat, deer) for a stated budget; it
then meets the other five (dog, frog, horse, ship, truck) with 10% of their training labels (--train-fraction,
the same 500 images a class in every arm) and is judged on their whole test split: fine-tuned in full without and
with layer-wise lr decay, with LoRA adapters (`--lora`, the rest frozen), by `vitlab probe` (DINO's 20-NN and the
linear probe on frozen features), and against the same model trained from scratch on the same images for the same
epochs. Every arm is the `vitlab` command a user runs, once per seed of --seeds (the backbone once, seed 0); the
table gives each arm's test top-1 (mean and sample standard deviation over the seeds, and each seed's) and wall
time, with the CPU (or GPU) named. A finished run is read back, so the script started again continues.

    python benchmarks/finetune_transfer.py [--tar ../shared/data/cifar10-jpg.tar.gz] [--work DIR]
        [--model vit_nano_patch4_32] [--img-size 16] [--pretrain-minutes 6] [--epochs 5] [--threads 1]
        [--arms finetune,finetune-ld,lora,scratch,probe] [--seeds 0,1,2] [--lora-rank 8] [--lora-lr LR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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


ARMS = ("finetune", "finetune-ld", "lora", "scratch", "probe")


def arm_args(args: argparse.Namespace, backbone: Path) -> dict[str, tuple[str, list]]:
    """Each trained arm's row name and the `vitlab train` options that make it."""
    lora = ["--init", backbone, "--lr", args.lora_lr if args.lora_lr is not None else args.lr,
            "--lora", args.lora_rank, "--lora-targets", args.lora_targets]
    return {"finetune": ("fine-tuned, no layer decay", ["--init", backbone, "--lr", args.lr / 2]),
            "finetune-ld": (f"fine-tuned, layer decay {args.layer_decay:g}",
                            ["--init", backbone, "--lr", args.lr / 2, "--layer-decay", args.layer_decay]),
            "lora": (f"LoRA r{args.lora_rank} on {args.lora_targets}, head in full", lora),
            "scratch": ("from scratch", ["--model", args.model, "--lr", args.lr])}


def probe_arm(args: argparse.Namespace, backbone: Path, b: Path, out: Path, seed: int) -> dict:
    """`vitlab probe` of the frozen backbone (its probe.json read back when the folder has one)."""
    if not (out / "probe.json").is_file():
        vitlab("probe", backbone, "--data", b, "--train-fraction", args.train_fraction, "--seed", seed, "--threads",
               args.threads, "--device", args.device, "--cache-dir", args.work / "cache", "--out", out)
    return json.loads((out / "probe.json").read_text())


def cell(values: list[float], fmt: str) -> str:
    """Mean, with the sample standard deviation when there is more than one value."""
    mean = statistics.fmean(values)
    return f"{mean:{fmt}} ± {statistics.stdev(values):{fmt}}" if len(values) > 1 else f"{mean:{fmt}}"


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
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-targets", default="qkv,proj,fc1,fc2")
    ap.add_argument("--lora-lr", type=float, default=None,
                    help="the LoRA arm's lr (default: --lr, twice fine-tuning's)")
    ap.add_argument("--arms", default="finetune,finetune-ld,scratch,probe",
                    help=f"comma-separated, in table order, of: {', '.join(ARMS)}")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds of every arm after the backbone (seed 0)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not arms or any(arm not in ARMS for arm in arms):
        ap.error(f"--arms {args.arms!r}: accepted, comma-separated: {', '.join(ARMS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: accepted: comma-separated integers, e.g. 0,1,2")

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
    _, top1, seconds = train_arm("backbone", backbone, "--data", a, "--model", args.model, "--time-budget",
                                 args.pretrain_minutes, "--lr", args.lr, *common)
    rows = [(f"backbone: classes 0-4, all labels, {args.pretrain_minutes:g} min, seed 0", [top1], [seconds])]
    trained, probe = arm_args(args, backbone), None
    for arm in arms:
        if arm != "probe":
            name, extra = trained[arm]
            done = [train_arm(name, runs / f"{arm}-seed{s}", *target, *extra, "--seed", s, *common) for s in seeds]
            rows.append((name, [d[1] for d in done], [d[2] for d in done]))
            continue
        probes = [probe_arm(args, backbone, b, runs / f"probe-seed{s}", s) for s in seeds]
        probe = probes[0]
        # each classifier with the features it needs (both splits, extracted once and cached)
        rows.append((f"linear probe (frozen, {probe['features']} features)", [p["linear"]["top1"] for p in probes],
                     [p["seconds"]["features"] + p["seconds"]["linear"] for p in probes]))
        rows.append(("20-NN (frozen)", [p["knn"]["top1"] for p in probes],
                     [p["seconds"]["features"] + p["seconds"]["knn"] for p in probes]))

    print(f"\n{args.model} at {args.img_size}x{args.img_size} on {device_name(args.device)}, {args.threads} thread(s); "
          f"classes 5-9 with {100 * args.train_fraction:g}% of the labels, {args.epochs} epochs per trained arm; "
          f"seeds {args.seeds} (mean ± sample std over seeds)\n")
    print("| arm | test top-1 | per seed | wall s |")
    print("|---|---:|---:|---:|")
    for name, accs, walls in rows:
        per_seed = " / ".join(f"{100 * x:.2f}" for x in accs)
        print(f"| {name} | {cell([100 * x for x in accs], '.2f')}% | {per_seed} | {cell(walls, '.0f')} |")


if __name__ == "__main__":
    main()
