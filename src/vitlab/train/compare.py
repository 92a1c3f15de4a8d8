"""``vitlab compare RUN [RUN...]``: a table of run folders and one figure with their curves overlaid.

A finished run is read from its summary.json; an unfinished one (no summary.json yet, e.g. still
training or killed) from its metrics.jsonl and config.yaml, and is marked as such.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

SUMMARY, METRICS, CONFIG_YAML = "summary.json", "metrics.jsonl", "config.yaml"
COLUMNS = [("run", "run"), ("status", "status"), ("model", "model"), ("params", "parameters"), ("data", "data"),
           ("epochs", "epochs"), ("wall", "wall_seconds"), ("img/s", "images_per_second"), ("top-1", "top1"),
           ("top-5", "top5")]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def read_history(folder: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (a torn last line, from a run killed mid-write, is left out)."""
    path = folder / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_run(path: str | os.PathLike) -> dict[str, Any]:
    """One run's row: name, status, model, parameters, data, epochs, wall seconds, img/s, top-1, top-5, history."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no run folder at {folder}")
    history = read_history(folder)
    recipe: dict[str, Any] = {}
    if (folder / CONFIG_YAML).is_file():
        recipe = yaml.safe_load((folder / CONFIG_YAML).read_text()) or {}
    if not history and not (folder / SUMMARY).is_file():
        raise FileNotFoundError(f"{folder} is not a run folder: it has neither {SUMMARY} nor {METRICS}")
    row: dict[str, Any] = {"run": folder.name or str(folder), "path": str(folder), "model": recipe.get("model"),
                           "data": recipe.get("data"), "parameters": None, "history": history}
    if (folder / SUMMARY).is_file():
        s = _read_json(folder / SUMMARY)
        row.update(status="finished", model=s.get("model", row["model"]), data=s.get("data", row["data"]),
                   parameters=s.get("parameters"), epochs=s.get("epochs", len(history)),
                   wall_seconds=s.get("elapsed_seconds", s.get("wall_seconds")),
                   images_per_second=s.get("images_per_second"), top1=s.get("top1"), top5=s.get("top5"))
        return row
    tested = [h for h in history if "test_top1" in h]
    rates = [h["images_per_second"] for h in history if "images_per_second" in h]
    row.update(status=f"unfinished ({len(history)}/{recipe['epochs']} epochs)"
               if recipe.get("epochs") and not recipe.get("time_budget") else "unfinished",
               epochs=len(history), wall_seconds=history[-1].get("elapsed_seconds"),
               images_per_second=sum(rates) / len(rates) if rates else None,
               top1=tested[-1]["test_top1"] if tested else None,
               top5=tested[-1].get("test_top5") if tested else None)
    return row


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("top1", "top5"):
        return f"{100 * value:.2f}%"
    if key == "parameters":
        return f"{value / 1e6:.2f}M"
    if key == "wall_seconds":
        return f"{value / 60:.1f} min" if value >= 120 else f"{value:.0f} s"
    if key == "images_per_second":
        return f"{value:.0f}"
    return str(value)


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """The runs as an aligned text table, one line each."""
    cells = [[title for title, _ in COLUMNS]] + [[_cell(key, r.get(key)) for _, key in COLUMNS] for r in runs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i < 3 or n == 0 else c.rjust(w) for i, (c, w) in
                               enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def plot_runs(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    """Train loss and test top-1 against epoch, one line per run, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        h = r["history"]
        line, = ax_loss.plot([x["epoch"] for x in h], [x["train_loss"] for x in h], label=r["run"])
        tested = [x for x in h if "test_top1" in x]
        ax_acc.plot([x["epoch"] for x in tested], [100 * x["test_top1"] for x in tested], marker=".",
                    color=line.get_color(), label=r["run"])
    ax_loss.set(xlabel="epoch", ylabel="train loss", title="Training loss")
    ax_acc.set(xlabel="epoch", ylabel="test top-1 (%)", title="Test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(runs: Sequence[str | os.PathLike], out: str | os.PathLike = "compare.png") -> list[dict[str, Any]]:
    """Read the run folders and write the overlaid curves to ``out``; returns the runs' rows (with histories)."""
    if not runs:
        raise ValueError("compare needs at least one run folder")
    rows = [read_run(r) for r in runs]
    names = [r["run"] for r in rows]
    if len(set(names)) < len(names):  # same folder names under different parents: label by path
        for r in rows:
            r["run"] = r["path"]
    plot_runs(rows, Path(out))
    return rows
