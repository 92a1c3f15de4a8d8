"""How distillation teachers fit their training images: what their soft targets hold beyond the labels.

For each finished run folder given, the model's predictions on every training image and its mirror image (the mean
of the two logits, made as ``--teacher-once`` makes them, through the trainer's own `TrainLoss.predict_once`), and
on the test images the same way; then one table: the teacher's test top-1, the share of training images whose
prediction is the label, and the mean probability it puts on the other classes at temperature 1 and 3
(`teacher_fit`). A teacher that fits its training images with confidence gives soft targets close to the labels
themselves, and a soft student then learns little from it that the labels do not say. Label smoothing's own
probability off the label is printed beside, for the recipe's smoothing.

    python benchmarks/teacher_fit.py runs/speedrun/cnn runs/speedrun-60/cnn \
        [--data ../shared/data/cifar10-jpg.tar.gz] [--smoothing 0.2] [--threads 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from cifar10_speedrun import machine  # the benchmarks folder is the script's own

import vitlab
from vitlab.data.sources import ImageSet, load_data
from vitlab.train.step import has_conv_stages
from vitlab.train.tasks.distillation import TrainLoss, teacher_fit


def fits(folder: Path, train: ImageSet, test: ImageSet, taus=(1.0, 3.0), batch: int = 500) -> dict[str, float]:
    """The teacher in ``folder`` on ``train`` and ``test``: test top-1 and, per temperature, the training fit."""
    teacher = vitlab.load(folder)
    classes = int(max(train.labels.max(), test.labels.max())) + 1
    if teacher.num_classes < classes:
        raise ValueError(f"{folder}: a teacher of {teacher.num_classes} classes, the data has {classes}")
    loss = TrainLoss(teacher, "soft", teacher_channels_last=has_conv_stages(teacher))
    mean, std = teacher.pretrained_cfg["mean"], teacher.pretrained_cfg["std"]
    loss.predict_once(test.images, mean, std, batch)
    row = {"test_top1": teacher_fit(loss.kept, test.labels)["match"]}
    loss.predict_once(train.images, mean, std, batch)
    row["train_top1"] = teacher_fit(loss.kept, train.labels)["match"]
    row.update({f"off_label_t{tau:g}": teacher_fit(loss.kept, train.labels, tau)["off_label"] for tau in taus})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished run folders of the teachers")
    ap.add_argument("--data", default="cifar10")
    ap.add_argument("--smoothing", type=float, default=0.2, help="the student's label smoothing, for comparison")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.threads < 1 or not 0 <= args.smoothing < 1:
        ap.error("--threads: a whole number >= 1; --smoothing: accepted 0 <= s < 1")
    missing = [str(r) for r in args.runs if not (r / "model.safetensors").is_file()]
    if missing:
        ap.error(f"not a finished run folder (no model.safetensors): {', '.join(missing)}")
    torch.set_num_threads(args.threads)
    data = load_data(args.data)
    classes = len(data.classes)
    print(f"The teachers' fit on {len(data.train.labels)} training images (each the mean with its mirror image), "
          f"on {machine()}")
    print(f"label smoothing {args.smoothing:g} puts {args.smoothing * (classes - 1) / classes:.3f} of the target's "
          f"probability on the other classes\n")
    print("| teacher | test top-1 (mirror) | training images predicted as labelled | off the label, temperature 1 | "
          "temperature 3 |")
    print("|---|---|---|---|---|")
    for folder in args.runs:
        try:
            row = fits(folder, data.train, data.test)
        except ValueError as e:
            ap.error(str(e))
        print(f"| {folder} | {row['test_top1']:.2%} | {row['train_top1']:.2%} | {row['off_label_t1']:.3f} | "
              f"{row['off_label_t3']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
