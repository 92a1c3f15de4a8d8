"""`vitlab predict` of a ViT-B/16 in bf16 against float32 on this machine: wall time and whether each image gets
the same top-1 class.

The model is a vitlab, timm or Hugging Face folder (--model), or by default a ViT-B/16 at 224 with vitlab's own
random initialisation and ten classes; the images are the first --images files of the CIFAR-10 test set (JPEG
archive, resized to 224 by the model's rule as predict does). Each precision runs what the command
`vitlab predict MODEL IMAGES... --precision P` runs, ``vitlab.infer.predict_files`` (the model folder loaded, the
files decoded, the forward pass), in this process, so that the interpreter's start-up, the same for both, is left
out; fp32 and bf16 alternate for --rounds rounds, and the median time of each and their ratio are printed, with
the images whose top-1 class differs. --commands times the whole command instead, `python -m vitlab predict ...`
in a process of its own (the interpreter's start-up and the imports included), as a user runs it.

    python benchmarks/predict_precision.py --data ../shared/data/cifar10-jpg.tar.gz [--images 32] [--rounds 2]
        [--commands] [--batch-size 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import vitlab
from vitlab.devices import BF16_CPU_FLAG, PREDICT_BATCH, cpu_flags, cpu_name
from vitlab.infer.predict import predict_files


def test_images(archive: Path, n: int, folder: Path) -> list[Path]:
    """The first ``n`` test JPEGs of the archive, the classes in turn, written to ``folder``."""
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and "/test/" in f"/{m.name}"),
                         key=lambda m: m.name)
        by_class: dict[str, list] = {}
        for m in members:
            by_class.setdefault(Path(m.name).parent.name, []).append(m)
        picked = [m for group in zip(*by_class.values()) for m in group][:n]
        paths = []
        for i, m in enumerate(picked):
            path = folder / f"{i:03d}_{Path(m.name).parent.name}.jpg"
            path.write_bytes(tar.extractfile(m).read())
            paths.append(path)
    return paths


def predict(model: str, images: list[Path], precision: str, batch: int) -> tuple[float, list[list[dict]]]:
    """Seconds of one ``predict_files`` call (what `vitlab predict` runs) and each image's top two classes."""
    t = time.perf_counter()
    results = predict_files(model, images, top_k=2, device="cpu", precision=precision, batch_size=batch)
    return time.perf_counter() - t, [r["top"] for r in results]


def predict_command(model: str, images: list[Path], precision: str, threads: int,
                    batch: int) -> tuple[float, list[list[dict]]]:
    """Seconds of the whole command `vitlab predict MODEL IMAGES... --precision P` in a new process, and each
    image's top two classes."""
    cmd = [sys.executable, "-m", "vitlab", "predict", model, *map(str, images), "--top-k", "2", "--json",
           "--device", "cpu", "--precision", precision, "--threads", str(threads),
           "--batch-size", str(batch)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"vitlab predict failed:\n{proc.stderr[-2000:]}")
    return seconds, [r["top"] for r in json.loads(proc.stdout)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the CIFAR-10 JPEG archive (cifar10-jpg.tar.gz)")
    ap.add_argument("--model", help="a model folder (default: a random-weights ViT-B/16 at 224, ten classes)")
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=PREDICT_BATCH, help="images per forward pass (predict's own)")
    ap.add_argument("--commands", action="store_true", help="time whole `vitlab predict` commands, one process each")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = args.model
        if model is None:
            torch.manual_seed(0)
            model = str(vitlab.save(vitlab.create_model("vit_base_patch16_224", num_classes=10), folder / "vit_b16"))
        images = test_images(Path(args.data), args.images, folder)
        seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}
        tops: dict[str, list[list[dict]]] = {}
        for _ in range(args.rounds):
            for precision in seconds:
                s, tops[precision] = (predict_command(model, images, precision, args.threads, args.batch_size)
                                       if args.commands else predict(model, images, precision, args.batch_size))
                seconds[precision].append(s)
    amx = "AMX (amx_bf16)" if BF16_CPU_FLAG in cpu_flags() else "no AMX"
    fp32, bf16 = statistics.median(seconds["fp32"]), statistics.median(seconds["bf16"])
    differ = [i for i, (a, b) in enumerate(zip(tops["fp32"], tops["bf16"])) if a[0]["class"] != b[0]["class"]]
    margin = [a[0]["probability"] - a[1]["probability"] for a in tops["fp32"]]  # float32's top-1 over its second
    moved = max(abs(a[0]["probability"] - next(p["probability"] for p in b if p["class"] == a[0]["class"]))
                for a, b in zip(tops["fp32"], tops["bf16"]) if any(p["class"] == a[0]["class"] for p in b))
    print(f"CPU: {cpu_name()}, {amx}; torch {torch.__version__}; {args.threads} threads; model: "
          f"{args.model or 'vit_base_patch16_224 (random weights, 10 classes)'}; {len(images)} CIFAR-10 test images, "
          f"{args.batch_size} a forward pass")
    what = "whole command" if args.commands else "predict_files in one process"
    print(f"| precision | `vitlab predict`'s seconds ({what}, median of {args.rounds}) | img/s |")
    print("|---|---|---|")
    for name, s in (("float32", fp32), ("bf16", bf16)):
        print(f"| {name} | {s:.1f} | {len(images) / s:.2f} |")
    included = "start-up, imports, " if args.commands else ""
    print(f"bf16 / float32 speed: {fp32 / bf16:.2f}x ({included}loading the folder and decoding the files included); "
          f"same top-1 class: {len(images) - len(differ)} of {len(images)}"
          + (" (differ: " + "; ".join(f"{images[i].name}, float32's top-1 ahead of its second by {margin[i]:.4f}"
                                      for i in differ) + ")" if differ else ""))
    print(f"float32's top-1 is ahead of its second by {statistics.median(margin):.4f} (median over the images); bf16 "
          f"moves a top-1 probability by {moved:.4f} at most")


if __name__ == "__main__":
    main()
