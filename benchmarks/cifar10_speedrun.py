"""CIFAR-10 time-to-accuracy: the speed-run CNN and the speed-run hybrid ViT under one budget on one machine.

Runs ``vitlab train`` with recipes/cifar10_airbench.yaml (airbench_32) and then with
recipes/cifar10_hybrid_speedrun.yaml (the hybrid ViT), one after the other, each under a budget of ``--budget``
minutes of training with an evaluation after every epoch, and prints one table: the training time at which each
first reached 80, 85, 90, 93 and 94% test top-1, and its final top-1, with the CPU (or GPU) named. Training time
is what speed runs time: the run's clock from its first step, evaluations not counted (``--budget-counts
training``); the wall time of each arm is longer by its evaluations.

``--ablations`` trains the hybrid under the budget once as it is and once without each piece of the speed run,
evaluated at the end only (one view), then evaluates the whole recipe's model again with mirror and with mirror +
translate test-time augmentation, and prints each piece's gain. The whole recipe also runs with another seed: the
difference between the two is the noise the gains are read against. The eight arms pair up under ``--jobs 2``
(an arm left to run alone would have the machine to itself and train faster than the others).

    python benchmarks/cifar10_speedrun.py --budget 30 [--data ../shared/data/cifar10-jpg.tar.gz] [--out runs/speedrun]
    python benchmarks/cifar10_speedrun.py --ablations --budget 4 --jobs 2 --threads 1 --out runs/speedrun-ablations
    python benchmarks/cifar10_speedrun.py --table-only --out runs/speedrun   # tabulate finished runs again

Any other option goes to every ``vitlab train`` (e.g. ``--threads 2``, ``--tta-translate 0`` for mirror TTA only).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from vitlab.runs.format import is_finished, read_history, read_summary

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"cnn": ROOT / "recipes/cifar10_airbench.yaml", "hybrid": ROOT / "recipes/cifar10_hybrid_speedrun.yaml"}
THRESHOLDS = (0.80, 0.85, 0.90, 0.93, 0.94)
# the hybrid without one piece of the speed run at a time: (row label, vitlab train options)
ABLATIONS = {
    "full": ("the whole recipe", []),
    "full-seed1": ("the whole recipe, seed 1 (the noise between two runs)", ["--seed", "1"]),
    "no-whiten": ("- whitening init (the first conv trained from PyTorch's init)",
                  ["--model-arg", "whiten_from_data=false"]),
    "no-altflip": ("- alternating flips (random flips instead)", ["--no-alternating-flip"]),
    "no-lookahead": ("- lookahead", ["--lookahead-every", "0"]),
    "no-smoothing": ("- label smoothing 0.2", ["--label-smoothing", "0"]),
    "no-bnbias": ("- BatchNorm biases at a higher lr", ["--bn-bias-lr-scale", "1"]),
    "no-progressive": ("- progressive resizing (32x32 throughout)", ["--progressive-scale", "1"]),
}
ONE_VIEW = ["--no-tta", "--tta-translate", "0", "--eval-every", "100000"]


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


def arm_command(recipe: Path, out: Path, data: str, budget: float, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "vitlab", "train", "--config", str(recipe), "--data", data, "--out", str(out),
            "--time-budget", f"{budget:g}", "--budget-counts", "training", "--eval-every", "1", *extra]


def run_arms(commands: dict[str, list[str]], jobs: int) -> None:
    """Run the arms' commands, ``jobs`` at a time (each alone on the machine with 1), and say how each ended."""
    waiting, running = list(commands.items()), []
    while waiting or running:
        while waiting and len(running) < jobs:
            name, cmd = waiting.pop(0)
            print("$", " ".join(cmd), flush=True)
            running.append((name, subprocess.Popen(cmd), time.perf_counter()))
        time.sleep(1)
        for item in [r for r in running if r[1].poll() is not None]:
            name, proc, t0 = item
            running.remove(item)
            print(f"{name}: exit {proc.returncode}{' (vitlab train failed)' if proc.returncode else ''}, "
                  f"{(time.perf_counter() - t0) / 60:.1f} min of wall time", flush=True)


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
    epochs = summary.steps / rows[0].step if len(rows) > 1 else summary.epochs  # the last epoch may be cut short
    return [name, summary.model, f"{epochs:.1f}", f"{summary.images_per_second:.0f}", *reached,
            f"{100 * summary.top1:.2f}%", fmt_time(summary.train_seconds)]


def table(out: Path, arms: list[str]) -> str:
    head = ["arm", "model", "epochs", "img/s", *[f"to {100 * t:.0f}%" for t in THRESHOLDS], "final top-1", "trained"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(arm_row(a, out / a)) + " |" for a in arms]
    return "\n".join(lines)


def ablation_table(out: Path, tta: dict[str, float | None]) -> str:
    """One row per arm of ``ABLATIONS`` (final one-view top-1 and its difference from the whole recipe), then the
    whole recipe's model with mirror and mirror + translate TTA."""
    lines = ["| arm | epochs | img/s | top-1 | gain of the piece |", "|---|---|---|---|---|"]
    full = read_summary(out / "full").top1 if is_finished(out / "full") else None
    for arm, (label, _) in ABLATIONS.items():
        if not is_finished(out / arm):
            lines.append(f"| {label} | (not finished) | | | |")
            continue
        s = read_summary(out / arm)
        sign = -1 if label.startswith("-") else 1  # a piece taken away gained what the arm lost
        gain = "" if arm == "full" or full is None else f"{100 * sign * (s.top1 - full):+.2f}"
        epochs = s.images_per_second * s.train_seconds / s.num_train  # images seen: the arms' budgets cut an epoch
        lines.append(f"| {label} | {epochs:.2f} | {s.images_per_second:.0f} | {100 * s.top1:.2f}% | {gain} |")
    for label, top1 in tta.items():
        if top1 is not None and full is not None:
            lines.append(f"| the whole recipe {label} | | | {100 * top1:.2f}% | {100 * (top1 - full):+.2f} |")
    return "\n".join(lines)


def tta_figures(folder: Path, data: str) -> dict[str, float | None]:
    """The finished model of ``folder`` evaluated with mirror TTA and with mirror + translate TTA."""
    from vitlab.infer.eval import evaluate_folder
    if not is_finished(folder):
        return {}
    return {"+ mirror TTA": evaluate_folder(folder, data, tta=True)["top1"],
            "+ mirror + translate TTA": evaluate_folder(folder, data, tta=True, tta_translate=1)["top1"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=30.0, help="minutes of training per arm (default 30)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/cifar10-jpg.tar.gz"))
    ap.add_argument("--out", default="runs/speedrun", help="folder of the arms' run folders")
    ap.add_argument("--arms", default="cnn,hybrid", help="which to run, in order (default cnn,hybrid)")
    ap.add_argument("--ablations", action="store_true", help="the hybrid without each piece of the speed run")
    ap.add_argument("--jobs", type=int, default=1, help="arms trained side by side (give --threads too; default 1)")
    ap.add_argument("--table-only", action="store_true", help="tabulate the run folders under --out, train nothing")
    args, extra = ap.parse_known_args()  # anything else goes to vitlab train (e.g. --threads 2)
    arms = list(ABLATIONS) if args.ablations else [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS and not args.ablations]
    if args.budget <= 0 or unknown or args.jobs < 1:
        ap.error(f"--budget must be > 0, --jobs >= 1 and --arms a list of {', '.join(ARMS)}")
    out = Path(args.out)
    if not args.table_only:
        commands = {}
        for arm in arms:
            recipe, options = (ARMS["hybrid"], ABLATIONS[arm][1] + ONE_VIEW) if args.ablations else (ARMS[arm], [])
            commands[arm] = arm_command(recipe, out / arm, args.data, args.budget, options + extra)
        run_arms(commands, args.jobs)
    what = "ablations of the hybrid" if args.ablations else "time-to-accuracy"
    print(f"\nCIFAR-10 {what}, budget {args.budget:g} min of training per arm, on {machine()}\n")
    print(ablation_table(out, tta_figures(out / "full", args.data)) if args.ablations
          else table(out, arms))


if __name__ == "__main__":
    main()
