"""A study's report: one row per arm aggregated from its runs' summaries, the Markdown table and the figure."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..runs.figures import new_figure, save
from ..runs.format import is_finished, read_summary
from ..train.recipe import Recipe
from .claims import PRETRAIN_METHODS, RANDOM_ENCODER, Arm, Study, encoder_name


def write_report(result: dict[str, Any], study: Study, out: Path) -> None:
    """OUT/NAME.json, OUT/NAME.md and OUT/NAME.png."""
    name = result["study"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(format_markdown(result, study))
    plot_study(result, study, out / f"{name}.png")


def aggregate(study: Study, plan: list[tuple[Arm, int, Recipe]]) -> list[dict[str, Any]]:
    """One row per arm: its seeds' top-1 (and heads), their mean and standard deviation (sample, over seeds; None
    with one seed), training images, epochs, img/s, its place on a line figure. Pre-training
    arms have no top-1: they are reported by their probes (probe.py). A row holds the seeds whose runs have finished
    (``unfinished`` names the others); an arm with none is left out."""
    rows = []
    for arm in study.arms:
        if arm.pretraining:
            continue
        planned = [(seed, Path(r.out)) for a, seed, r in plan if a is arm]
        runs = [(seed, folder) for seed, folder in planned if is_finished(folder)]
        if not runs:
            continue
        seeds = {}
        heads: dict[str, list[float]] = {"cls": [], "dist": []}
        epochs, rates, params, n_train, steps, images = [], [], None, None, {}, {}
        for seed, folder in runs:
            summary = read_summary(folder)
            seeds[seed] = summary.top1
            for h in heads:
                if summary.heads is not None:
                    heads[h].append(summary.heads[h])
            epochs.append(summary.epochs)
            steps[seed], images[seed] = summary.steps, summary.images
            rates.append(summary.images_per_second)
            params, n_train = summary.parameters, summary.num_train
        rows.append({"label": arm.label, "group": arm.group, "teacher": arm.teacher,
                     "model": arm.values.get("model"), "parameters": params, "train_images": n_train,
                     "top1": seeds, "top1_mean": statistics.fmean(seeds.values()),
                     "top1_std": statistics.stdev(seeds.values()) if len(seeds) > 1 else None,
                     "x": arm.x, "panel": arm.panel,
                     "cls_mean": statistics.fmean(heads["cls"]) if heads["cls"] else None,
                     "dist_mean": statistics.fmean(heads["dist"]) if heads["dist"] else None,
                     "epochs": statistics.fmean(e for e in epochs if e is not None) if any(epochs) else None,
                     "images_per_second": statistics.fmean(r for r in rates if r) if any(rates) else None,
                     "steps": steps, "images": images,  # what each seed's run trained, by seed
                     "runs": [str(f) for _, f in runs],
                     "unfinished": [seed for seed, _ in planned if seed not in seeds]})
    return rows


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.2f}"


def _mean_std(r: dict[str, Any]) -> str:
    return _pct(r["top1_mean"]) + ("" if r.get("top1_std") is None else f" +/- {100 * r['top1_std']:.2f}")


def _spread(by_seed: dict | None) -> str:
    """'1,234' when every seed's run trained as much, '1,200-1,234' otherwise ('' for runs that do not say)."""
    values = [v for v in (by_seed or {}).values() if v is not None]
    if not values:
        return ""
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def format_markdown(result: dict[str, Any], study: Study) -> str:
    seeds = result["seeds"]
    head = ["arm", "model", "train images", *[f"top-1 seed {s}" for s in seeds], "top-1 mean +/- std"]
    if study.heads:
        head += ["class head", "distillation head"]
    head += ["epochs", "steps", "images trained", "img/s"]
    lines = [f"# study: {result['study']}", "", f"Claim ({result['source']}): {study.claim}", "",
             f"The paper: {result['paper']}.", "",
             f"Budget: {result['budget']} on {result['data']}, {result['threads_per_run']} thread(s) per run, "
             f"{result['runs_at_a_time']} run(s) at a time.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["rows"]:
        cells = [r["label"], r["model"] or "", f"{r['train_images']:,}" if r["train_images"] else "",
                 *[_pct(r["top1"].get(s, r["top1"].get(str(s)))) for s in seeds], _mean_std(r)]
        if r["teacher"] or r["group"] == "linear probe":  # one run, whatever the seeds
            cells[3:3 + len(seeds)] = [_pct(next(iter(r["top1"].values())))] + [""] * (len(seeds) - 1)
        if study.heads:
            cells += [_pct(r["cls_mean"]), _pct(r["dist_mean"])]
        cells += [f"{r['epochs']:.1f}" if r["epochs"] else "", _spread(r.get("steps")), _spread(r.get("images")),
                  f"{r['images_per_second']:.0f}" if r["images_per_second"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _pretraining_lines(result)
    lines += ["", f"**Verdict: {result['verdict']}.** Measured: {result['answer']}",
              "", "A difference is separated when it is at least twice its spread: the standard deviation over "
              "seeds of one seed's difference, sqrt(std_a^2 + std_b^2); agrees: every part of the claim separated "
              "the paper's way; disagrees: a part separated the other way; not separated: otherwise."]
    lines += ["", *result["notes"]] if result["notes"] else []
    return "\n".join(lines) + "\n"


def _pretraining_lines(result: dict[str, Any]) -> list[str]:
    """The pre-training runs and the probes' k-NN, as lines under the table."""
    lines = [f"{r['label']}: {r['epochs']} epoch(s), {r['images_per_second']:.0f} img/s, held-out loss "
             f"{r['test_loss']:.4f} ({Path(r['run']).name})" for r in result.get("pretraining", [])]
    knn = [f"{r['encoder']} {_pct(r['knn'])}%" for r in result["rows"] if r.get("knn") is not None]
    if knn:
        lines.append("Weighted k-NN (k=20, cosine) on the frozen features, every label: " + ", ".join(knn) + ".")
    return ["", *lines] if lines else []


def plot_study(result: dict[str, Any], study: Study, path: Path) -> Path:
    """Bars (one per arm, a dot per seed, the standard deviation as an error bar), or lines (top-1 against the x
    axis, one per group, a panel per share of the labels) with, where the study names two groups, their gap."""
    rows = [r for r in result["rows"] if not r["teacher"] and r["group"] != "linear probe"]
    probes = [r for r in result["rows"] if r["group"] == "linear probe" and r.get("knn") is not None]
    if study.x:
        panels = list(dict.fromkeys(r["panel"] for r in rows))
        extra = bool(study.gap) + bool(probes)
        fig = new_figure(5.5 * (len(panels) + extra), 4.5)
        axes = fig.subplots(1, len(panels) + extra, squeeze=False)[0]
        for ax, panel in zip(axes, panels):
            _lines(ax, [r for r in rows if r["panel"] == panel], result, study)
            ax.set_title(panel or "test top-1", fontsize=10)
        if study.gap:
            _gap_lines(axes[len(panels)], rows, study.gap)  # the probes' panel, if any, comes last
        if probes:
            _probe_lines(axes[-1], probes, result, study)
        fig.suptitle(f"{result['study']}: {result['budget']} on {Path(str(result['data'])).name}")
        return save(fig, path)
    fig = new_figure(7.5 if len(rows) <= 6 else 0.75 * len(rows) + 2, 4.5 if len(rows) <= 6 else 6)
    ax = fig.subplots()
    _bars(ax, rows)
    ax.set_title(f"{result['study']}: {result['budget']} on {Path(str(result['data'])).name}")
    return save(fig, path)


def _x(r: dict[str, Any], result: dict[str, Any]) -> float:
    """A row's place on the line figure: its x in budgets times the per-run budget (in minutes where the budget is
    minutes: a pre-training arm's minutes are its own method's), else its training images."""
    return r["x"] * _per_x(result)[0] if r.get("x") is not None else r["train_images"]


def _per_x(result: dict[str, Any]) -> tuple[float, str]:
    """One budget on the line figure's x axis, and its unit: minutes for a budget in minutes, else the result's."""
    minutes = (result.get("recipe") or {}).get("time_budget")
    return (minutes, "minutes") if minutes else (result["per_run"], result["unit"])


def _probe_lines(ax, probes: list[dict[str, Any]], result: dict[str, Any], study: Study) -> None:
    """Each method's frozen encoder on every label against its pre-training: weighted k-NN (solid) and linear probe
    (dashed), the untrained encoder's as horizontal lines."""
    arms = {encoder_name(a.label): a for a in study.arms if a.pretraining}
    every = [r for r in probes if r["encoder"] in arms]
    for method in dict.fromkeys(arms[r["encoder"]].values["pretrain"] for r in every):
        mine = sorted((r for r in every if arms[r["encoder"]].values["pretrain"] == method),
                      key=lambda r: arms[r["encoder"]].scale)
        xs = [arms[r["encoder"]].scale * _per_x(result)[0] for r in mine]
        line, = ax.plot(xs, [100 * r["knn"] for r in mine], marker="o", label=f"{PRETRAIN_METHODS[method]} k-NN")
        ax.plot(xs, [100 * r["top1_mean"] for r in mine], marker="s", ls="--", color=line.get_color(),
                label=f"{PRETRAIN_METHODS[method]} linear probe")
    for r in probes:
        if r["encoder"] == RANDOM_ENCODER:
            ax.axhline(100 * r["knn"], color="grey", lw=1, label="untrained k-NN")
            ax.axhline(100 * r["top1_mean"], color="grey", lw=1, ls="--", label="untrained linear probe")
    ax.set(xlabel=f"{study.x} ({_per_x(result)[1]})", ylabel="test top-1 (%)",
           title="frozen encoder, every label: k-NN and linear probe")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _lines(ax, rows: list[dict[str, Any]], result: dict[str, Any], study: Study) -> None:
    """Top-1 against x, one line per group; a group's line starts from the x = 0 rows of other groups (pretrain:
    the scratch run every curve starts from)."""
    origin = [r for r in rows if r.get("x") == 0]
    for group in dict.fromkeys(r["group"] for r in rows if r.get("x") != 0):
        mine = sorted(origin + [r for r in rows if r["group"] == group], key=lambda r: _x(r, result))
        xs = [_x(r, result) for r in mine]
        line = ax.errorbar(xs, [100 * r["top1_mean"] for r in mine], yerr=[100 * (r["top1_std"] or 0) for r in mine],
                           marker="o", capsize=3, label=group)
        for r in mine:
            ax.scatter([_x(r, result)] * len(r["top1"]), [100 * v for v in r["top1"].values()], s=10,
                       color=line.lines[0].get_color(), alpha=0.5)
    if study.x == "training images":
        ax.set_xscale("log")
    unit = "" if study.x == "training images" else f" ({_per_x(result)[1]})"
    ax.set(xlabel=f"{study.x}{unit}", ylabel="test top-1 (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _gap_lines(ax, rows: list[dict[str, Any]], gap: tuple[str, str]) -> None:
    """Group a minus group b against training images, +/- sqrt(std_a^2 + std_b^2)."""
    a, b = ({r["train_images"]: r for r in rows if r["group"] == g} for g in gap)
    xs = sorted(set(a) & set(b))
    diff = [100 * (a[n]["top1_mean"] - b[n]["top1_mean"]) for n in xs]
    err = [100 * ((a[n]["top1_std"] or 0) ** 2 + (b[n]["top1_std"] or 0) ** 2) ** 0.5 for n in xs]
    ax.errorbar(xs, diff, yerr=err, marker="o", capsize=3, color="k")
    ax.axhline(0, color="grey", lw=1)
    ax.set_xscale("log")
    ax.set(xlabel="training images", ylabel=f"{gap[0]} minus {gap[1]} (points)", title=f"{gap[0]} minus {gap[1]}")
    ax.grid(alpha=0.3)


def _bars(ax, rows: list[dict[str, Any]]) -> None:
    labels = [r["label"] for r in rows]
    ax.bar(range(len(rows)), [100 * r["top1_mean"] for r in rows], color="#8fb3d9",
           yerr=[100 * (r["top1_std"] or 0) for r in rows], capsize=4)
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["top1"]), [100 * v for v in r["top1"].values()], color="k", s=12, zorder=3)
        top = 100 * max(r["top1_mean"] + (r["top1_std"] or 0), *r["top1"].values())  # above the bar and its dots
        ax.annotate(f"{100 * r['top1_mean']:.1f}", (i, top), ha="center", va="bottom", fontsize=9, xytext=(0, 4),
                    textcoords="offset points")
    if len(rows) > 6:
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
    else:
        ax.set_xticks(range(len(rows)), labels, rotation=15)
    ax.set(ylabel="test top-1 (%)")
    low = min(100 * min(r["top1"].values()) for r in rows)
    ax.set_ylim(max(0.0, low - 10), None)
    ax.grid(alpha=0.3)
