"""Seconds to judge a frozen ViT-S on a new data set: feature extraction, DINO's 20-NN and a linear probe.

Random weights and synthetic 224x224 images (10 classes), so the accuracies mean nothing; the
times are what a user waits for. Prints a table with the device's name: wall seconds, and the
process's CPU seconds (what the steps cost when other programs share the CPU).

    python benchmarks/bench_probe.py [--images 5000] [--model vit_small_patch16_224] [--device cpu]
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time

import torch

import vitlab
from vitlab.probe import extract_features, knn_classify, linear_probe
from vitlab.probe.classifiers import accuracy


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    t1 = clock()
    return t1[0] - t0[0], t1[1] - t0[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = vitlab.create_model(args.model, num_classes=10)
    size = model.pretrained_cfg["input_size"]
    images = torch.randint(0, 256, (args.images, *size), dtype=torch.uint8)
    labels = torch.arange(args.images) % 10
    n_train = args.images * 4 // 5
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        t0 = clock()
        feats = extract_features(model, images, args.batch_size, device, progress=True, precision=args.precision,
                                 cache_dir=cache)
        rows.append((f"features, {args.images} images", since(t0)))
        t0 = clock()
        extract_features(model, images, args.batch_size, device, progress=False, precision=args.precision,
                         cache_dir=cache)
        rows.append(("features again (cache; hashing included)", since(t0)))
    feats = feats.to(device)
    t0 = clock()
    pred = knn_classify(feats[:n_train], labels[:n_train], feats[n_train:], k=20, temperature=0.07)
    knn_acc = accuracy(pred, labels[n_train:])
    rows.append((f"20-NN, {args.images - n_train} queries over {n_train}", since(t0)))
    t0 = clock()
    probe = linear_probe(feats[:n_train], labels[:n_train], feats[n_train:], labels[n_train:], num_classes=10)
    rows.append((f"linear probe (L-BFGS, {feats.shape[1]} features)", since(t0)))

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"\n{args.model} (random weights), {size[1]}x{size[2]}, batch {args.batch_size}, {args.precision}; "
          f"{device_name}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'step':<48} {'seconds':>8} {'CPU s':>8}")
    print(f"{'-' * 48} {'-' * 8} {'-' * 8}")
    for name, (seconds, cpu) in rows:
        print(f"{name:<48} {seconds:>8.2f} {cpu:>8.2f}")
    per_image = rows[0][1][0] / args.images
    print(f"\nextraction: {1 / per_image:.1f} images/s ({5000 * per_image / 60:.1f} min for 5,000 images); "
          f"accuracies on random data (meaningless): k-NN {knn_acc:.3f}, linear {probe.test_accuracy:.3f}")


if __name__ == "__main__":
    main()
