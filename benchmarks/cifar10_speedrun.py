"""CIFAR-10 time-to-accuracy: the speed-run CNN and the speed-run hybrid ViT under one budget on one machine.

Runs ``vitlab train`` with recipes/cifar10_airbench.yaml (airbench_32) and then with
recipes/cifar10_hybrid_speedrun.yaml (vit_nano_airbench_32), one after the other, each under a wall-clock budget
of ``--budget`` minutes with an evaluation after every epoch, and prints one table: the training time (the run's
budget clock: from its first step, evaluations included) at which each first reached 80, 85, 90, 93 and 94% test
top-1, and its final top-1, with the CPU (or GPU) named.

    python benchmarks/cifar10_speedrun.py --budget 30 [--data ../shared/data/cifar10-jpg.tar.gz] [--out runs/speedrun]
    python benchmarks/cifar10_speedrun.py --table-only --out runs/speedrun   # tabulate finished runs again
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from vitlab.runs.format import is_finished, read_history, read_summary

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"cnn": ROOT / "recipes/cifar10_airbench.yaml", "hybrid": ROOT / "recipes/cifar10_hybrid_speedrun.yaml"}
THRESHOLDS = (0.80, 0.85, 0.90, 0.93, 0.94)


def machine() -> str:
    """The CPU's model name and its AVX-512 / AMX flags, and the GPU when torch sees one."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "amx_tile"))
    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{name} ({isa}), {torch.get_num_threads()} threads{gpu}"


def run_arm(recipe: Path, out: Path, data: str, budget: float, extra: list[str]) -> int:
    cmd = [sys.executable, "-m", "vitlab", "train", "--config", str(recipe), "--data", data, "--out", str(out),
           "--time-budget", f"{budget:g}", "--eval-every", "1", *extra]
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def fmt_time(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def arm_row(name: str, folder: Path) -> list[str]:
    """One table row: the model, epochs, img/s, time to each threshold, final top-1."""
    if not is_finished(folder):
        return [name, "(not finished)"] + [""] * (len(THRESHOLDS) + 4)
    rows, summary = read_history(folder), read_summary(folder)
    reached = []
    for t in THRESHOLDS:
        hit = next((r.elapsed_seconds for r in rows if r.test_top1 is not None and r.test_top1 >= t), None)
        reached.append(fmt_time(hit))
    return [name, summary.model, str(summary.epochs), f"{summary.images_per_second:.0f}", *reached,
            f"{100 * summary.top1:.2f}%", fmt_time(summary.train_seconds)]


def table(out: Path, arms: list[str]) -> str:
    head = ["arm", "model", "epochs", "img/s", *[f"to {100 * t:.0f}%" for t in THRESHOLDS], "final top-1", "trained"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(arm_row(a, out / a)) + " |" for a in arms]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=30.0, help="minutes per arm (default 30)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/cifar10-jpg.tar.gz"))
    ap.add_argument("--out", default="runs/speedrun", help="folder of the arms' run folders")
    ap.add_argument("--arms", default="cnn,hybrid", help="which to run, in order (default cnn,hybrid)")
    ap.add_argument("--table-only", action="store_true", help="tabulate the run folders under --out, train nothing")
    args, extra = ap.parse_known_args()  # anything else goes to vitlab train (e.g. --threads 2)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if args.budget <= 0 or unknown:
        ap.error(f"--budget must be > 0 and --arms a list of {', '.join(ARMS)}")
    out = Path(args.out)
    if not args.table_only:
        for arm in arms:
            if run_arm(ARMS[arm], out / arm, args.data, args.budget, extra) != 0:
                print(f"{arm}: vitlab train failed", file=sys.stderr)
    print(f"\nCIFAR-10 time-to-accuracy, budget {args.budget:g} min per arm, on {machine()}\n")
    print(table(out, arms))


if __name__ == "__main__":
    main()
