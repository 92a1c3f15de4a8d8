"""``vitlab study NAME``: a paper's claim as a family of runs that differ in one factor, under one budget.

Every arm is an ordinary training run (a run folder under ``OUT/runs/``), named after what it
changes, so a study that is stopped and started again skips the finished arms, resumes the
unfinished ones from their checkpoints, and two studies that need the same arm (``locality``
and ``data-scale``) train it once. The study then writes ``OUT/NAME.json`` (every arm and seed),
``OUT/NAME.md`` (the table and the measured answer to the claim) and ``OUT/NAME.png``.

Budget: ``--budget MIN`` minutes of training per arm (equal compute in wall-clock terms), or
``--epochs N``. ``--jobs N`` trains N arms side by side, each on cores/N threads (or ``--threads``),
which keeps the arms' conditions equal. ``--quick`` is a smoke run on the embedded digits (a fifth of them,
one epoch at 16x16).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .compare import read_run
from .recipe import Recipe, load_recipe

# One recipe for every arm: the 30-minute CIFAR recipe's optimiser and augmentation, no compile
# (its warm-up would eat a short budget), one evaluation at the end.
BASE: dict[str, Any] = dict(
    batch_size=64, lr=1.5e-3, min_lr=1e-5, warmup=0.03, weight_decay=0.05, drop_path=0.0, clip_grad=1.0,
    crop="pad", padding=4, hflip=True, auto_augment="none", random_erasing=0.0, mixup=0.0, cutmix=0.0,
    label_smoothing=0.1, eval_every=10_000, precision="auto")
QUICK: dict[str, Any] = dict(data="digits", img_size=16, epochs=1, time_budget=None, batch_size=32, padding=1,
                             hflip=False, precision="fp32")
QUICK_SHARE = 0.2  # --quick trains every arm on a fifth of its training images (data-scale: 1% to 20%)

VIT, CONVIT, DEIT_DISTILLED, HYBRID = ("vit_nano_patch4_32", "convit_nano_patch4_32",
                                       "deit_nano_distilled_patch4_32", "vit_nano_r18_32")
RESNET = {"model": "resnet10_32", "model_args": {"widths": [32, 64, 128, 256]}}
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
TEACHER = "teacher"  # the value of ``teacher`` that stands for the study's teacher arm


@dataclass
class Arm:
    label: str  # what the table calls it
    values: dict[str, Any]  # recipe values that differ from BASE
    group: str = ""  # one line of a line figure (data-scale, locality)
    teacher: bool = False  # the teacher of the distillation arms: trained first, not a result


@dataclass
class Study:
    name: str
    claim: str  # the paper's claim, in a sentence
    source: str  # where the paper makes it
    arms: list[Arm]
    answer: Callable[[list[dict[str, Any]]], str]  # the measured answer, from the aggregated rows
    x: str | None = None  # line figure: the x axis (training images); None: bars
    heads: bool = False  # distilled students: report the class and distillation heads too
    notes: list[str] = field(default_factory=list)


def _row(rows, label):
    return next(r for r in rows if r["label"] == label)


def _points(rows, label):
    return _row(rows, label)["top1_mean"]


def _gap_text(a: float, b: float) -> str:
    return f"{100 * (a - b):+.1f} points"


def _clear(rows, a: str, b: str) -> bool:
    """Is the gap between two arms' means larger than either arm's spread over seeds?"""
    ra, rb = _row(rows, a), _row(rows, b)
    spread = max(ra["top1_spread"] or 0.0, rb["top1_spread"] or 0.0)
    return abs(ra["top1_mean"] - rb["top1_mean"]) > spread


def _versus(rows, a: str, b: str) -> str:
    """'a vs b: +x.x points (clear|within the seeds' spread)'."""
    gap = _gap_text(_points(rows, a), _points(rows, b))
    seeds = len(_row(rows, a)["top1"])
    how = "" if seeds < 2 else (", clear of the seeds' spread" if _clear(rows, a, b) else
                                ", within the seeds' spread")
    return f"{a} vs {b}: {gap}{how}"


def _answer_pos_embed(rows) -> str:
    none, learn, sincos = "none", "learned 1D", "fixed 2D sin-cos"
    worst = _points(rows, none) < min(_points(rows, learn), _points(rows, sincos))
    clearly = worst and _clear(rows, none, learn) and _clear(rows, none, sincos)
    alike = not _clear(rows, learn, sincos)
    return (f"{_versus(rows, none, learn)}; {_versus(rows, none, sincos)}; {_versus(rows, learn, sincos)}. "
            + ("No position embedding is clearly the worst, as the paper says" if clearly else
               "No position embedding is not clearly worse than both embeddings here")
            + ("; 1D and 2D hardly differ, as the paper says." if alike else
               "; 1D and 2D do differ here, unlike the paper's long schedules."))


def _by_group(rows) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        out.setdefault(r["group"], {})[r["train_images"]] = r["top1_mean"]
    return out


NOISE = 0.02  # a change of up to 2 points between single-seed runs is not read as a trend


def _answer_data_scale(rows) -> str:
    g = _by_group(rows)
    sizes = sorted(g["ViT"])
    parts = []
    for n in sizes:
        best = max(g, key=lambda k: g[k][n])
        parts.append(f"{n:,} images: {best} best (ViT {100 * g['ViT'][n]:.1f}%, ResNet {100 * g['ResNet'][n]:.1f}%, "
                     f"ConViT {100 * g['ConViT'][n]:.1f}%)")
    gaps = [g["ResNet"][n] - g["ViT"][n] for n in sizes]
    trend = gaps[0] - gaps[-1]
    return ("; ".join(parts) + f". The ResNet's lead over the ViT is {_gap_text(gaps[0], 0)} on the smallest set and "
            f"{_gap_text(gaps[-1], 0)} on the whole set: "
            + ("it narrows with data, as in the paper's curves (a ViT overtaking a CNN needs far more data than "
               "CIFAR-10)." if trend > NOISE else
               "it grows with data, unlike the paper's curves." if trend < -NOISE else
               f"it does not change by more than {100 * NOISE:.0f} points with data at this budget."))


def _answer_hybrid(rows) -> str:
    patch, cnn = "patch tokens", "CNN tokens (hybrid)"
    better = _points(rows, cnn) > _points(rows, patch)
    return (f"{_versus(rows, cnn, patch)}. "
            + ("Agrees: the hybrid is better for this small model" if better and _clear(rows, cnn, patch) else
               "The hybrid is ahead, but not clearly" if better else "Does not agree: the hybrid is not better here")
            + ".")


def _answer_distill(rows) -> str:
    alone, soft, hard = "no teacher", "soft", "hard"
    p = {k: _points(rows, k) for k in (alone, soft, hard)}
    order = " > ".join(sorted(p, key=p.get, reverse=True))
    agrees = p[hard] > p[soft] > p[alone]
    return (f"{_versus(rows, soft, alone)}; {_versus(rows, hard, alone)}; {_versus(rows, hard, soft)}. "
            f"Order: {order}. " + ("The same order as DeiT Table 3." if agrees else
                                   "Not the order of DeiT Table 3 (hard > soft > no teacher)."))


def _answer_locality(rows) -> str:
    g = _by_group(rows)
    sizes = sorted(g["DeiT"])
    gains = {n: g["ConViT"][n] - g["DeiT"][n] for n in sizes}
    text = ", ".join(f"{n:,}: {_gap_text(gains[n], 0)}" for n in sizes)
    small, large = gains[sizes[0]], gains[sizes[-1]]
    agrees = small > NOISE and small - large > NOISE
    return (f"ConViT minus DeiT by training images: {text}. "
            + ("Agrees: the locality prior helps most when data is scarce." if agrees else
               f"Not clear at this budget: the gain on the smallest set ({_gap_text(small, 0)}) is not more than "
               f"{100 * NOISE:.0f} points above both zero and the gain on the whole set ({_gap_text(large, 0)})."))


def _scale_arms(models: dict[str, dict[str, Any]]) -> list[Arm]:
    return [Arm(f"{name} {100 * f:g}%", {**values, **({"train_fraction": f} if f < 1 else {})}, group=name)
            for name, values in models.items() for f in FRACTIONS]  # 100%: the same run as the other studies'



STUDIES: dict[str, Study] = {s.name: s for s in [
    Study("pos-embed", "No position embedding is clearly worse; learned 1D and 2D embeddings hardly differ.",
          "ViT, appendix D.4 (Table 8)",
          [Arm("learned 1D", {"model": VIT}),
           Arm("none", {"model": VIT, "model_args": {"pos_embed": "none"}}),
           Arm("fixed 2D sin-cos", {"model": VIT, "model_args": {"pos_embed": "sincos"}})],
          _answer_pos_embed),
    Study("data-scale", "ViTs need more data than CNNs: on small sets the CNN wins, the ViT catches up with data.",
          "ViT, Figures 3 and 4",
          _scale_arms({"ViT": {"model": VIT}, "ResNet": RESNET, "ConViT": {"model": CONVIT}}),
          _answer_data_scale, x="train_images"),
    Study("hybrid", "At equal compute a hybrid (CNN feature maps as tokens) beats patch tokens for small models.",
          "ViT, Figure 5",
          [Arm("patch tokens", {"model": VIT}), Arm("CNN tokens (hybrid)", {"model": HYBRID})],
          _answer_hybrid),
    Study("distill", "Distilling from a CNN through a distillation token beats training alone; hard beats soft.",
          "DeiT, Table 3",
          [Arm("teacher (ResNet)", RESNET, teacher=True),
           Arm("no teacher", {"model": DEIT_DISTILLED}),
           Arm("soft", {"model": DEIT_DISTILLED, "teacher": TEACHER, "distill": "soft", "tau": 3.0, "alpha": 0.5}),
           Arm("hard", {"model": DEIT_DISTILLED, "teacher": TEACHER, "distill": "hard", "alpha": 0.5})],
          _answer_distill, heads=True,
          notes=["The teacher is trained first, under the same budget as each student; a distilled student also runs "
                 "the teacher on every batch inside its budget, so it sees fewer images."]),
    Study("locality", "GPSA's convolutional prior helps most when data is scarce; the gain shrinks with data.",
          "ConViT, Figures 1 and 6",
          _scale_arms({"DeiT": {"model": VIT}, "ConViT": {"model": CONVIT}}),
          _answer_locality, x="train_images"),
]}


def _slug(values: dict[str, Any], seed: int) -> str:
    """A run folder name from an arm's values: model, then every other changed value, then the seed."""
    parts = [str(values.get("model", "default"))]
    for key in sorted(values):
        if key in ("model", "teacher"):
            continue
        value = values[key]
        if isinstance(value, dict):
            parts += [f"{k}={v}" for k, v in sorted(value.items())]
        else:
            parts.append(f"{key}={value}")
    text = "-".join(parts + [f"seed{seed}"])
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "", text.replace(", ", "_").replace(" ", ""))


def arm_recipe(arm: Arm, seed: int, out: Path, common: dict[str, Any], teacher_run: Path | None,
               share: float = 1.0) -> Recipe:
    values = {**BASE, **common, **arm.values, "seed": seed}
    if share < 1:
        values["train_fraction"] = values.get("train_fraction", 1.0) * share
    if values.get("teacher") == TEACHER:
        values["teacher"] = str(teacher_run)
    return load_recipe(None, out=str(out), **values)


_SAME = ("model", "model_args", "data", "img_size", "train_fraction", "time_budget", "epochs", "seed", "distill",
         "batch_size", "lr")


def _check_same(folder: Path, recipe: Recipe) -> None:
    """A run folder that exists must hold this arm: a study's folder is not reused for another budget."""
    path = folder / "config.yaml"
    if not path.is_file():
        return
    old = yaml.safe_load(path.read_text()) or {}
    new = recipe.to_dict()
    diff = [k for k in _SAME if old.get(k) != new.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in diff)
        raise ValueError(f"{folder} holds another run ({shown}); give the study another --out")


def _child_command(folder: Path, recipe: Recipe) -> list[str]:
    if (folder / "config.yaml").is_file():
        return [sys.executable, "-m", "vitlab", "train", "--resume", str(folder)]
    spec = _beside(folder, ".yaml")
    values = {k: v for k, v in recipe.to_dict().items() if k != "out"}
    spec.write_text(yaml.safe_dump(values, sort_keys=False))
    return [sys.executable, "-m", "vitlab", "train", "--config", str(spec), "--out", str(folder)]


def _beside(folder: Path, ext: str) -> Path:
    """A file next to a run folder: NAME.log, NAME.yaml, NAME.lock (names hold dots: 'train_fraction=0.05')."""
    return folder.parent / (folder.name + ext)


def _claim(folder: Path, log: Callable[[str], None]) -> bool:
    """Take ``folder``'s lock (``NAME.lock`` beside it, holding this process id) before training it. If another
    live process holds it (a second study that shares the run), wait for that process to finish; returns
    False when the run was finished meanwhile, True when this process now owns it."""
    lock = _beside(folder, ".lock")
    waited = False
    while True:
        if (folder / "summary.json").is_file():
            return False
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                owner = int(lock.read_text() or 0)
                os.kill(owner, 0)
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # left by a process that is gone
                continue
            except PermissionError:
                pass  # alive, another user's
            if not waited:
                log(f"{folder.name} is being trained by process {owner}: waiting for it")
                waited = True
            time.sleep(5)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        if (folder / "summary.json").is_file():  # finished between the check and the lock
            lock.unlink(missing_ok=True)
            return False
        return True


def _train_arms(jobs: list[tuple[str, Recipe]], parallel: int, log: Callable[[str], None], bar) -> None:
    """Train the (name, recipe) runs: one at a time in this process, or ``parallel`` at a time in child
    processes (each writing OUT/runs/NAME.log); a failure names the arm and its log."""
    if parallel == 1:
        from .trainer import train
        for name, recipe in jobs:
            folder = Path(recipe.out)
            folder.parent.mkdir(parents=True, exist_ok=True)
            if _claim(folder, log):  # else finished meanwhile by another study
                log(f"training {name} -> {folder}")
                try:
                    train(recipe, resume=(folder / "config.yaml").is_file(), log=lambda s: None)
                finally:
                    _beside(folder, ".lock").unlink(missing_ok=True)
            bar.update(1)
        return
    pending = list(jobs)
    running: list[tuple[str, Path, subprocess.Popen, Any]] = []  # name, run folder, child, its log's handle
    failed = []
    while pending or running:
        while pending and len(running) < parallel:
            name, recipe = pending.pop(0)
            folder = Path(recipe.out)
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not _claim(folder, log):  # finished meanwhile by another study
                bar.update(1)
                continue
            logfile = _beside(folder, ".log")
            handle = open(logfile, "a")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(_child_command(folder, recipe), stdout=handle, stderr=subprocess.STDOUT, env=env)
            running.append((name, folder, proc, handle))
            log(f"training {name} -> {folder} (log: {logfile})")
        time.sleep(0.5)
        for item in list(running):
            name, folder, proc, handle = item
            if proc.poll() is None:
                continue
            handle.close()
            running.remove(item)
            _beside(folder, ".lock").unlink(missing_ok=True)
            logfile = _beside(folder, ".log")
            bar.update(1)
            if proc.returncode != 0:
                tail = logfile.read_text().strip().splitlines()[-1:] if logfile.is_file() else []
                failed.append(f"{name} (exit {proc.returncode}: {tail[0] if tail else 'no output'}; log {logfile})")
    if failed:
        raise RuntimeError("study arm(s) failed: " + "; ".join(failed))


def run_study(name: str, out: str | os.PathLike = "studies", data: str = "cifar10", budget: float | None = 5.0,
              epochs: int | None = None, seeds: Sequence[int] = (0,), jobs: int = 1, threads: int | None = None,
              quick: bool = False, cache_dir: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train what is missing of study ``name`` and write its table, figure and JSON; returns the JSON."""
    from ..progress import Progress

    if name not in STUDIES:
        raise ValueError(f"no study {name!r}; accepted: {', '.join(STUDIES)}")
    if jobs < 1:
        raise ValueError(f"jobs={jobs!r} is not valid; accepted: an integer >= 1")
    if not seeds or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds={list(seeds)!r} is not valid; accepted: integers >= 0, e.g. 0,1")
    study = STUDIES[name]
    out = Path(out)
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads!r} is not valid; accepted: an integer >= 1")
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    if quick:
        common = dict(QUICK)
    elif epochs is not None:
        common = {"data": data, "epochs": epochs, "time_budget": None}
    else:
        common = {"data": data, "time_budget": budget}
    common.update(threads=threads, cache_dir=cache_dir)
    runs = out / "runs"

    teacher_arms = [a for a in study.arms if a.teacher]
    teacher_run = runs / _slug(teacher_arms[0].values, 0) if teacher_arms else None
    plan: list[tuple[Arm, int, Recipe]] = []
    for arm in study.arms:
        for seed in ([0] if arm.teacher else seeds):
            recipe = arm_recipe(arm, seed, runs / _slug(arm.values, seed), common, teacher_run,
                                share=QUICK_SHARE if quick else 1.0)
            _check_same(Path(recipe.out), recipe)
            plan.append((arm, seed, recipe))
    todo = [(a, s, r) for a, s, r in plan if not (Path(r.out) / "summary.json").is_file()]
    log(f"study {name}: {len(plan)} runs, {len(plan) - len(todo)} done, {len(todo)} to train "
        + (f"({jobs} at a time, {threads} thread(s) each)" if todo else ""))
    with Progress(total=len(plan), initial=len(plan) - len(todo), unit="run", desc=f"study {name}") as bar:
        first = [(f"{a.label} seed {s}", r) for a, s, r in todo if a.teacher]  # the teacher before its students
        rest = [(f"{a.label} seed {s}", r) for a, s, r in todo if not a.teacher]
        for batch in (first, rest):
            if batch:
                _train_arms(batch, jobs, log, bar)

    rows = aggregate(study, plan)
    result = {"study": name, "claim": study.claim, "source": study.source,
              "budget": f"quick (digits, {100 * QUICK_SHARE:g}% of the images, 1 epoch at 16x16)" if quick else
              (f"{epochs} epochs" if epochs is not None else f"{budget:g} min per run"),
              "data": common["data"], "seeds": list(seeds), "threads_per_run": threads, "runs_at_a_time": jobs,
              "recipe": {**BASE, **{k: v for k, v in common.items() if k not in ("cache_dir",)}},
              "rows": rows, "answer": study.answer(rows), "notes": study.notes}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(format_markdown(result, study))
    plot_study(result, study, out / f"{name}.png")
    return result


def aggregate(study: Study, plan: list[tuple[Arm, int, Recipe]]) -> list[dict[str, Any]]:
    """One row per arm: its seeds' top-1 (and heads), their mean, training images, epochs, img/s."""
    rows = []
    for arm in study.arms:
        runs = [(seed, Path(r.out)) for a, seed, r in plan if a is arm]
        seeds = {}
        heads: dict[str, list[float]] = {"cls": [], "dist": []}
        epochs, rates, params, n_train = [], [], None, None
        for seed, folder in runs:
            summary = json.loads((folder / "summary.json").read_text())
            row = read_run(folder)
            seeds[seed] = summary["top1"]
            for h in heads:
                if "heads" in summary:
                    heads[h].append(summary["heads"][h])
            epochs.append(row.get("epochs"))
            rates.append(row.get("images_per_second"))
            params = summary.get("parameters")
            n_train = summary.get("num_train", n_train)
        rows.append({"label": arm.label, "group": arm.group, "teacher": arm.teacher,
                     "model": arm.values.get("model"), "parameters": params, "train_images": n_train,
                     "top1": seeds, "top1_mean": statistics.fmean(seeds.values()),
                     "top1_spread": (max(seeds.values()) - min(seeds.values())) if len(seeds) > 1 else None,
                     "cls_mean": statistics.fmean(heads["cls"]) if heads["cls"] else None,
                     "dist_mean": statistics.fmean(heads["dist"]) if heads["dist"] else None,
                     "epochs": statistics.fmean(e for e in epochs if e is not None) if any(epochs) else None,
                     "images_per_second": statistics.fmean(r for r in rates if r) if any(rates) else None,
                     "runs": [str(f) for _, f in runs]})
    return rows


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.2f}"


def format_markdown(result: dict[str, Any], study: Study) -> str:
    seeds = result["seeds"]
    head = ["arm", "model", "train images", *[f"top-1 seed {s}" for s in seeds], "mean top-1"]
    if study.heads:
        head += ["class head", "distillation head"]
    head += ["epochs", "img/s"]
    lines = [f"# study: {result['study']}", "", f"Claim ({result['source']}): {study.claim}", "",
             f"Budget: {result['budget']} on {result['data']}, {result['threads_per_run']} thread(s) per run, "
             f"{result['runs_at_a_time']} run(s) at a time.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["rows"]:
        cells = [r["label"], r["model"] or "", f"{r['train_images']:,}" if r["train_images"] else "",
                 *[_pct(r["top1"].get(s, r["top1"].get(str(s)))) for s in seeds], _pct(r["top1_mean"])]
        if r["teacher"]:
            cells[3:3 + len(seeds)] = [_pct(next(iter(r["top1"].values())))] + [""] * (len(seeds) - 1)
        if study.heads:
            cells += [_pct(r["cls_mean"]), _pct(r["dist_mean"])]
        cells += [f"{r['epochs']:.1f}" if r["epochs"] else "",
                  f"{r['images_per_second']:.0f}" if r["images_per_second"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Measured: {result['answer']}"]
    lines += ["", *result["notes"]] if result["notes"] else []
    return "\n".join(lines) + "\n"


def plot_study(result: dict[str, Any], study: Study, path: Path) -> Path:
    """Bars (one per arm, a dot per seed) or lines (top-1 against training images, one per group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r["teacher"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if study.x:
        for group in dict.fromkeys(r["group"] for r in rows):
            mine = sorted((r for r in rows if r["group"] == group), key=lambda r: r["train_images"])
            xs = [r["train_images"] for r in mine]
            line, = ax.plot(xs, [100 * r["top1_mean"] for r in mine], marker="o", label=group)
            for r in mine:
                ax.scatter([r["train_images"]] * len(r["top1"]), [100 * v for v in r["top1"].values()],
                           s=10, color=line.get_color(), alpha=0.5)
        ax.set_xscale("log")
        ax.set(xlabel="training images", ylabel="test top-1 (%)")
        ax.legend()
    else:
        labels = [r["label"] for r in rows]
        ax.bar(range(len(rows)), [100 * r["top1_mean"] for r in rows], color="#8fb3d9")
        for i, r in enumerate(rows):
            ax.scatter([i] * len(r["top1"]), [100 * v for v in r["top1"].values()], color="k", s=12, zorder=3)
            ax.annotate(f"{100 * r['top1_mean']:.1f}", (i, 100 * r["top1_mean"]), ha="center", va="bottom",
                        fontsize=9, xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(rows)), labels, rotation=15)
        ax.set(ylabel="test top-1 (%)")
        low = min(100 * min(r["top1"].values()) for r in rows)
        ax.set_ylim(max(0.0, low - 10), None)
    ax.set_title(f"{result['study']}: {result['budget']} on {Path(str(result['data'])).name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
