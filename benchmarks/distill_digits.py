"""Hard distillation on the embedded digits: a DeiT student alone and with CNN teachers of different strength.

    PYTHONPATH=src python benchmarks/distill_digits.py [--epochs 20] [--teacher-epochs 3,15] [--seeds 0,1,2]

Trains one resnet10_32 teacher per --teacher-epochs value (default digits recipe), measures its test top-1 and how
often its argmax agrees with the label on the student's augmented training batches (hard distillation's targets),
then trains deit_nano_distilled_patch4_32 for --epochs with the default digits recipe for every seed: alone (both
heads on the labels) and with hard distillation from each teacher. Prints one row per run and one per arm: top-1
(the mean of the heads, what the model returns), the class head, the distillation head, and the distillation
head's agreement with its teacher on the test images, as mean +/- standard deviation over the seeds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from vitlab import checkpoint
from vitlab.data.augment import BatchAugment, normalize
from vitlab.data.sources import load_data
from vitlab.train import load_recipe, train

STUDENT, TEACHER = "deit_nano_distilled_patch4_32", "resnet10_32"


def digits():
    r = load_recipe(None, data="digits", model=STUDENT)
    return r, load_data("digits", img_size=32, in_chans=3, seed=0, log=lambda s: None)


@torch.no_grad()
def teacher_agreement(teacher_dir: Path, batches: int = 40, seed: int = 0) -> float:
    """Share of augmented training images (digits recipe) whose teacher argmax equals the label."""
    r, data = digits()
    teacher = checkpoint.load(teacher_dir).eval()
    augment = BatchAugment(r.augment, (32, 32), data.mean, data.std, len(data.classes))
    torch.manual_seed(seed)
    hits = seen = 0
    for _ in range(batches):
        idx = torch.randint(len(data.train.labels), (r.batch_size,))
        x, _ = augment(data.train.images[idx], data.train.labels[idx])
        hits += int((teacher(x).argmax(1) == data.train.labels[idx]).sum())
        seen += len(idx)
    return hits / seen


@torch.no_grad()
def test_predictions(folder: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A run's argmax on the test digits: (returned logits, distillation head or None)."""
    _, data = digits()
    model = checkpoint.load(folder).eval()
    x = normalize(data.test.images, data.mean, data.std)
    if getattr(model, "dist_token", None) is not None:
        _, dist = model.forward_heads(model.forward_features(x))
        return model(x).argmax(1), dist.argmax(1)
    return model(x).argmax(1), None


def run_row(out: Path, arm: str, seed: int, teacher_pred: torch.Tensor | None) -> dict:
    s = json.loads((out / "summary.json").read_text())
    row = {"arm": arm, "seed": seed, "top1": s["top1"], "cls": s["heads"]["cls"], "dist": s["heads"]["dist"]}
    if teacher_pred is not None:
        _, dist = test_predictions(out)
        row["follows"] = float((dist == teacher_pred).double().mean())
    return row


def mean_std(values: list[float]) -> str:
    values = [100 * v for v in values]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} +/- {std:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--teacher-epochs", default="3,15", help="one teacher per value, comma-separated")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=None, help="student learning rate (default: the recipe's)")
    p.add_argument("--teacher-widths", default="32,64,128,256", help="the ResNet's stage widths (timm's: 64-512)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    p.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                   help="train the student alone too (--no-alone: only the distilled arms, e.g. in a second process)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    root = Path(args.out or tempfile.mkdtemp(prefix="distill-digits-"))
    quiet = lambda s: None  # noqa: E731
    lr = {"lr": args.lr} if args.lr else {}

    teachers = {}
    for epochs in (int(e) for e in args.teacher_epochs.split(",")):
        folder = root / f"teacher-{epochs}ep"
        if not (folder / "summary.json").is_file():
            widths = [int(w) for w in args.teacher_widths.split(",")]
            train(load_recipe(None, data="digits", model=TEACHER, model_args={"widths": widths}, epochs=epochs,
                              out=str(folder), threads=args.threads), log=quiet)
        top1 = json.loads((folder / "summary.json").read_text())["top1"]
        agree = teacher_agreement(folder)
        teachers[f"hard, {epochs}-epoch teacher"] = (folder, test_predictions(folder)[0])
        print(f"teacher {TEACHER}, {epochs} epochs: test top-1 {100 * top1:.2f}%, its argmax is the label on "
              f"{100 * agree:.2f}% of the student's augmented training images", flush=True)

    rows = []
    for seed in seeds:
        for arm, (teacher, pred) in {**({"alone": (None, None)} if args.alone else {}), **teachers}.items():
            out = root / f"{arm.split(',')[0]}-{teacher.name if teacher else 'none'}-seed{seed}"
            if not (out / "summary.json").is_file():
                extra = {"teacher": str(teacher), "distill": "hard"} if teacher else {}
                train(load_recipe(None, data="digits", model=STUDENT, epochs=args.epochs, seed=seed, out=str(out),
                                  threads=args.threads, **lr, **extra), log=quiet)
            rows.append(run_row(out, arm, seed, pred))
            print(f"{arm} seed {seed}: top-1 {100 * rows[-1]['top1']:.2f}%", flush=True)

    print(f"\n{STUDENT}, {args.epochs} epochs, default digits recipe, seeds {args.seeds}, runs in {root}\n")
    print("| student | seed | top-1 | class head | distillation head | distillation head = teacher |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        follows = f"{100 * r['follows']:.2f}" if "follows" in r else ""
        print(f"| {r['arm']} | {r['seed']} | {100 * r['top1']:.2f} | {100 * r['cls']:.2f} | {100 * r['dist']:.2f} "
              f"| {follows} |")
    print("\n| student | top-1 | class head | distillation head | distillation head = teacher |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        follows = mean_std([r["follows"] for r in mine]) if "follows" in mine[0] else ""
        print(f"| {arm} | {mean_std([r['top1'] for r in mine])} | {mean_std([r['cls'] for r in mine])} | "
              f"{mean_std([r['dist'] for r in mine])} | {follows} |")


if __name__ == "__main__":
    main()
