"""The pre-training curve: each method's frozen encoder and its fine-tunes against pre-training minutes, beside
training from scratch for the same total time; prints the tables and draws the figure.

It reads the run folders and probe.json files that the commands in docs/pretraining.md write under WORK:

    WORK/runs/METHOD-Mmin                     a pre-training run of M (calibrated) minutes
    WORK/probes/METHOD-Mmin/probe.json        `vitlab probe` of its encoder on 10% of the labels
    WORK/probes/untrained/probe.json          the same architecture, untrained
    WORK/runs/METHOD-Mmin-ftP-sS              its fine-tune on P% of the labels (10 or 100), seed S
    WORK/runs/scratch-Tmin-P-sS               from scratch for T minutes (the pre-training's and the fine-tune's)
    WORK/runs/TASK_...                        a second task (e.g. distillation's: classes 5-9): the same names
                                              with the task's prefix, e.g. five_scratch-3min-10-s0

A point's fine-tunes are compared with the scratch runs of the same total time, mean +/- sample std over their
seeds, and called separated as the studies call it (vitlab.studies.claims.separated: the gap at least twice the two
spreads combined, sqrt(s1^2 + s2^2)); a scratch point with one seed takes the spread of the nearest scratch point
with several.

    python benchmarks/pretrain_curve.py WORK [--finetune-minutes 1.5] [--png docs/pretraining-curve.png]
    python benchmarks/pretrain_curve.py WORK --split ../shared/data/cifar10-jpg.tar.gz   # the two class folders
    python benchmarks/pretrain_curve.py WORK --guidance "a 2-core Intel Xeon with AMX, one thread per run, float32"

``--guidance CPU`` also writes the CIFAR-10 encoders' 20-NN against the untrained one's into
src/vitlab/objectives/knn_measured.json (the table `vitlab pretrain` says its first line from), as measured on CPU:
a point of the same method, minutes, model and CPU is replaced, the others kept.

``--split TAR`` first unpacks the archive into WORK/cifar10-0-4 and WORK/cifar10-5-9 (train/ and test/ of classes
0-4 and 5-9), the distillation teacher's data and its students' task, as benchmarks/finetune_transfer.py splits it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

from vitlab.studies.claims import separated

PRETRAIN = re.compile(r"^(?:(?P<task>[a-z0-9]+)_)?(?P<method>[a-z]+)-(?P<minutes>[0-9.]+)min$")
FINETUNE = re.compile(r"^(?:(?P<task>[a-z0-9]+)_)?(?P<method>[a-z]+)-(?P<minutes>[0-9.]+)min-ft(?P<share>\d+)-s\d+$")
SCRATCH = re.compile(r"^(?:(?P<task>[a-z0-9]+)_)?scratch-(?P<minutes>[0-9.]+)min-(?P<share>\d+)-s\d+$")


def top1(run: Path) -> float | None:
    """A finished run's test top-1 in percent (None while it trains)."""
    path = run / "summary.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("top1")
    return None if value is None else 100 * value


def probe(path: Path) -> tuple[float, float] | None:
    """(20-NN, linear probe) top-1 in percent from a probe.json."""
    if not path.is_file():
        return None
    p = json.loads(path.read_text())
    return 100 * p["knn"]["top1"], 100 * p["linear"]["top1"]


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None


def collect(work: Path) -> dict:
    """Every finished run under WORK/runs, grouped: fine-tunes and scratch runs by (task, share, minutes)."""
    tuned, scratch, pretrained = defaultdict(list), defaultdict(list), {}
    for run in sorted((work / "runs").iterdir()) if (work / "runs").is_dir() else []:
        if not run.is_dir():
            continue
        if m := FINETUNE.match(run.name):
            if (t := top1(run)) is not None:
                tuned[(m["task"] or "", int(m["share"]), m["method"], float(m["minutes"]))].append(t)
        elif m := SCRATCH.match(run.name):
            if (t := top1(run)) is not None:
                scratch[(m["task"] or "", int(m["share"]), float(m["minutes"]))].append(t)
        elif m := PRETRAIN.match(run.name):
            pretrained[(m["task"] or "", m["method"], float(m["minutes"]))] = probe(
                work / "probes" / run.name / "probe.json")
    return {"tuned": tuned, "scratch": scratch, "pretrained": pretrained,
            "untrained": probe(work / "probes" / "untrained" / "probe.json")}


def spread(scratch: dict, key: tuple) -> float | None:
    """The scratch point's own std, else that of the nearest point of its task and share with several seeds."""
    own = mean_std(scratch[key])[1]
    if own is not None:
        return own
    near = [(abs(k[2] - key[2]), mean_std(v)[1]) for k, v in scratch.items() if k[:2] == key[:2] and len(v) > 1]
    return min(near)[1] if near else None


def fmt(xs: list[float]) -> str:
    m, s = mean_std(xs)
    return f"{m:.2f} +/- {s:.2f} (n={len(xs)})" if s is not None else f"{m:.2f} (n=1)"


def report(data: dict, ft_minutes: float) -> list[str]:
    """The tables, as Markdown lines."""
    lines = ["| encoder | 20-NN top-1, 10% labels | linear probe top-1, 10% labels |", "|---|---:|---:|"]
    if data["untrained"]:
        lines.append("| untrained | {:.2f} | {:.2f} |".format(*data["untrained"]))
    for (task, method, minutes), p in sorted(data["pretrained"].items()):
        if p:
            lines.append(f"| {task + ': ' if task else ''}{method} {minutes:g} min | {p[0]:.2f} | {p[1]:.2f} |")
    lines += ["", "| task, labels | pre-training | fine-tuned top-1 | scratch, same total time | gap | separated |",
              "|---|---|---:|---:|---:|---|"]
    for (task, share, method, minutes), xs in sorted(data["tuned"].items()):
        total = round(minutes + ft_minutes, 3)
        key = (task, share, total)
        label = f"{task or 'cifar10'}, {share}%"
        if key not in data["scratch"]:
            lines.append(f"| {label} | {method} {minutes:g} min | {fmt(xs)} | not trained ({total:g} min) | | |")
            continue
        ys = data["scratch"][key]
        gap = statistics.fmean(xs) - statistics.fmean(ys)
        s1, s2 = mean_std(xs)[1], spread(data["scratch"], key)
        noise = math.hypot(s1, s2) if s1 is not None and s2 is not None else None
        sep = "n/a" if noise is None else ("yes" if separated(gap, noise) else "no")
        lines.append(f"| {label} | {method} {minutes:g} min | {fmt(xs)} | {fmt(ys)} ({total:g} min) | "
                     f"{gap:+.2f}" + (f" +/- {noise:.2f}" if noise is not None else "") + f" | {sep} |")
    return lines


TASKS = {"": "CIFAR-10", "five": "classes 5-9 (teacher: 0-4)"}
COLOURS = {"mae": "tab:red", "mpp": "tab:purple", "dino": "tab:blue", "ibot": "tab:green", "distill": "tab:orange",
           "teacher": "tab:brown"}
TICKS = (1.5, 3, 6, 15, 30, 60, 120)


def draw(data: dict, ft_minutes: float, png: Path) -> None:
    """Two rows: CIFAR-10 (the encoders' 20-NN, then the fine-tunes on 10% and 100% of the labels), and the second
    task (the encoders' linear probe, then its fine-tunes); every method a colour, scratch in black."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for row, (index, what) in enumerate(((0, "20-NN"), (1, "linear probe"))):
        ax = axes[row][0]
        for task, method in sorted({(t, m) for t, m, _ in data["pretrained"]}):
            pts = sorted((mi, p[index]) for (t, m, mi), p in data["pretrained"].items() if (t, m) == (task, method)
                         and p)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLOURS.get(method), label=method)
        if data["untrained"]:
            ax.axhline(data["untrained"][index], color="grey", linestyle="--", label="untrained")
        ax.set(xlabel="pre-training minutes", ylabel=f"{what} top-1 (%)",
               title="frozen encoder, CIFAR-10, 10% of the labels")
    for row, task in enumerate(TASKS):
        for ax, share in zip(axes[row][1:], (10, 100)):
            for method in sorted({k[2] for k in data["tuned"] if k[:2] == (task, share)}):
                pts = sorted((k[3] + ft_minutes, *mean_std(v)) for k, v in data["tuned"].items()
                             if k[:3] == (task, share, method))
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] or 0 for p in pts], marker="o",
                            capsize=3, color=COLOURS.get(method), label=f"{method}, then {ft_minutes:g} min")
            pts = sorted((k[2], *mean_std(v)) for k, v in data["scratch"].items() if k[:2] == (task, share))
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] or 0 for p in pts], marker="s",
                            color="black", capsize=3, label="from scratch")
            ax.set(xlabel="total minutes (pre-training + fine-tuning)", ylabel="test top-1 (%)",
                   title=f"{TASKS[task]}, {share}% of the labels")
    for ax in axes.flat:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(TICKS, [f"{t:g}" for t in TICKS])
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


GUIDANCE = Path(__file__).resolve().parents[1] / "src" / "vitlab" / "pretrain" / "knn_measured.json"


def guidance_points(work: Path, data: dict, cpu: str) -> list[dict]:
    """The CIFAR-10 encoders' points for the guidance table: each pre-training run's 20-NN top-1 beside the untrained
    encoder's, with its images, model, minutes and the rate at which it saw images (images seen over its minutes)."""
    if not data["untrained"]:
        return []
    points = []
    for (task, method, minutes), probed in sorted(data["pretrained"].items()):
        summary = work / "runs" / f"{method}-{minutes:g}min" / "summary.json"
        if task or not probed or not summary.is_file():
            continue
        s = json.loads(summary.read_text())
        points.append({"method": method, "data": s["data"], "images": s["num_train"], "model": s["model"],
                       "minutes": minutes, "rate": round(s["images"] / (minutes * 60), 2), "knn": round(probed[0], 2),
                       "untrained": round(data["untrained"][0], 2), "cpu": cpu})
    return points


def write_guidance(points: list[dict], path: Path = GUIDANCE) -> None:
    """Merge ``points`` into the guidance table at ``path``: one of the same method, minutes, model and CPU replaced."""
    doc = json.loads(path.read_text()) if path.is_file() else {"about": "", "points": []}
    key = lambda p: (p["method"], p["minutes"], p["model"], p["cpu"])  # noqa: E731
    new = {key(p): p for p in points}
    kept = [new.pop(key(p), p) for p in doc["points"]]
    rows = [json.dumps(p) for p in [*kept, *new.values()]]
    path.write_text("{\n" + f' "about": {json.dumps(doc["about"])},\n "points": [\n  ' + ",\n  ".join(rows)
                    + "\n ]\n}\n")
    print(f"wrote {len(points)} points into {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--finetune-minutes", type=float, default=1.5)
    ap.add_argument("--png", type=Path, default=None, help="where to draw the figure (default WORK/curve.png)")
    ap.add_argument("--split", type=Path, default=None, help="CIFAR-10 archive to split into classes 0-4 and 5-9")
    ap.add_argument("--guidance", metavar="CPU", default=None,
                    help="write the encoders' 20-NN into vitlab's guidance table, as measured on CPU")
    args = ap.parse_args()
    if args.split:
        from finetune_transfer import split_tar  # the sibling benchmark's split, so both tasks are the same
        print("split into", *split_tar(args.split, args.work))
    data = collect(args.work)
    print("\n".join(report(data, args.finetune_minutes)))
    draw(data, args.finetune_minutes, args.png or args.work / "curve.png")
    if args.guidance:
        write_guidance(guidance_points(args.work, data, args.guidance))


if __name__ == "__main__":
    main()
