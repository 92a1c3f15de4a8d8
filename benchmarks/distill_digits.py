"""Hard distillation on the embedded digits: a DeiT student with and without a CNN teacher.

    PYTHONPATH=src python benchmarks/distill_digits.py [--epochs 20] [--seeds 0,1] [--lrs 5e-3,1e-3]

Trains a resnet10_32 teacher (default digits recipe), measures how often its argmax agrees with
the labels on the student's augmented training batches (hard distillation's targets), then trains
deit_nano_distilled_patch4_32 for --epochs with the default digits recipe at each learning rate and
seed, without a teacher and with hard distillation, and prints a table: top-1 (mean of the heads),
class head, distillation head and the final training loss, per run and averaged over seeds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from vitlab import checkpoint
from vitlab.data.augment import BatchAugment
from vitlab.data.sources import load_data
from vitlab.train import load_recipe, train

STUDENT, TEACHER = "deit_nano_distilled_patch4_32", "resnet10_32"


def teacher_agreement(teacher_dir: Path, batches: int = 40, seed: int = 0) -> float:
    """Share of augmented training images (digits recipe) whose teacher argmax equals the label."""
    r = load_recipe(None, data="digits", model=STUDENT)
    teacher = checkpoint.load(teacher_dir).eval()
    data = load_data("digits", img_size=32, in_chans=3, seed=0)
    augment = BatchAugment(r.augment, (32, 32), data.mean, data.std, len(data.classes))
    torch.manual_seed(seed)
    hits = seen = 0
    with torch.no_grad():
        for _ in range(batches):
            idx = torch.randint(len(data.train.labels), (r.batch_size,))
            x, targets = augment(data.train.images[idx], data.train.labels[idx])
            hits += int((teacher(x).argmax(1) == data.train.labels[idx]).sum())
            seen += len(idx)
    return hits / seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--teacher-epochs", type=int, default=30)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--lrs", default="5e-3,1e-3", help="student learning rates (5e-3 is the digits default)")
    p.add_argument("--teacher-widths", default="32,64,128,256", help="the ResNet's stage widths (timm's: 64-512)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    lrs = [float(v) for v in args.lrs.split(",")]
    root = Path(args.out or tempfile.mkdtemp(prefix="distill-digits-"))
    quiet = lambda s: None  # noqa: E731

    teacher_dir = root / "teacher"
    if not (teacher_dir / "summary.json").is_file():
        widths = [int(w) for w in args.teacher_widths.split(",")]
        train(load_recipe(None, data="digits", model=TEACHER, model_args={"widths": widths},
                          epochs=args.teacher_epochs, out=str(teacher_dir), threads=args.threads), log=quiet)
    teacher_top1 = json.loads((teacher_dir / "summary.json").read_text())["top1"]
    agree = teacher_agreement(teacher_dir)
    print(f"teacher {TEACHER}: test top-1 {100 * teacher_top1:.2f}%, agrees with the label on "
          f"{100 * agree:.2f}% of augmented training images")

    rows = []
    for lr in lrs:
        for arm in ("none", "hard"):
            for seed in seeds:
                out = root / f"{arm}-lr{lr:g}-seed{seed}"
                if not (out / "summary.json").is_file():
                    extra = {"teacher": str(teacher_dir), "distill": "hard"} if arm == "hard" else {}
                    train(load_recipe(None, data="digits", model=STUDENT, epochs=args.epochs, lr=lr, seed=seed,
                                      out=str(out), threads=args.threads, **extra), log=quiet)
                s = json.loads((out / "summary.json").read_text())
                last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
                rows.append({"lr": lr, "arm": arm, "seed": seed, "top1": s["top1"], "cls": s["heads"]["cls"],
                             "dist": s["heads"]["dist"], "loss": last["train_loss"]})
                print(f"lr {lr:g} {arm} seed {seed}: top-1 {100 * s['top1']:.2f}%", flush=True)

    print(f"\n{STUDENT}, {args.epochs} epochs, default digits recipe (batch 32), runs in {root}\n")
    print("| lr | teacher | seed | top-1 | class head | distillation head | last train loss |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['lr']:g} | {r['arm']} | {r['seed']} | {100 * r['top1']:.2f} | {100 * r['cls']:.2f} | "
              f"{100 * r['dist']:.2f} | {r['loss']:.3f} |")
    for lr in lrs:
        for arm in ("none", "hard"):
            mine = [r for r in rows if r["lr"] == lr and r["arm"] == arm]
            print(f"| {lr:g} | {arm} | mean | {100 * statistics.fmean(r['top1'] for r in mine):.2f} | "
                  f"{100 * statistics.fmean(r['cls'] for r in mine):.2f} | "
                  f"{100 * statistics.fmean(r['dist'] for r in mine):.2f} | |")


if __name__ == "__main__":
    main()
