"""``vitlab compare RUN [RUN...]``: a table of run folders and one figure with their curves overlaid.

A finished run is read from its summary.json; an unfinished one (no summary.json yet, e.g. still
training or killed) from its metrics.jsonl and config.yaml, and is marked as such.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, VitlabError
from .figures import LOSS_NAMES, plot_runs
from .folder import claim_file, figure_metadata
from .format import (
    METRICS,
    SUMMARY,
    EpochRow,
    is_finished,
    read_config,
    read_history,
    read_summary,
    run_images_per_second,
)

COLUMNS = [("run", "run"), ("status", "status"), ("model", "model"), ("params", "parameters"), ("data", "data"),
           ("epochs", "epochs"), ("train", "train_seconds"), ("wall", "wall_seconds"),
           ("img/s", "images_per_second"), ("top-1", "top1"), ("top-5", "top5")]


def read_run(path: str | os.PathLike) -> dict[str, Any]:
    """One run's row: run, path, status, model, parameters, data, epochs, training and wall seconds, img/s,
    top-1, top-5, its history (the metrics.jsonl rows as dicts) and what its training loss is."""
    folder = Path(path)
    if not folder.is_dir():
        raise NotFoundError(f"no run folder at {folder}")
    history = read_history(folder)
    recipe = read_config(folder)
    if not history and not is_finished(folder):
        raise NotFoundError(f"{folder} is not a run folder: it has neither {SUMMARY} nor {METRICS}")
    objective = str(recipe.get("pretrain") or "none")
    row: dict[str, Any] = {"run": folder.name or str(folder), "path": str(folder), "model": recipe.get("model"),
                           "data": recipe.get("data"), "parameters": None, "history": [h.to_dict() for h in history],
                           "loss": LOSS_NAMES.get(objective, f"{objective} loss")}  # what its train_loss is
    if is_finished(folder):
        s = read_summary(folder)
        row.update(status="finished", model=s.model, data=s.data, parameters=s.parameters, epochs=s.epochs,
                   train_seconds=s.train_seconds, wall_seconds=s.wall_seconds,
                   images_per_second=s.images_per_second, top1=s.top1, top5=s.top5)
        return row
    tested = [h for h in history if h.test_top1 is not None]
    planned = recipe.get("epochs") if not recipe.get("time_budget") else None
    row.update(status=f"unfinished ({len(history)}/{planned} epochs)" if planned else "unfinished",
               epochs=len(history), train_seconds=history[-1].elapsed_seconds if history else None,
               wall_seconds=None, images_per_second=run_images_per_second(history),
               top1=tested[-1].test_top1 if tested else None, top5=tested[-1].test_top5 if tested else None)
    return row


def _seconds(value: float) -> str:
    return f"{value / 60:.1f} min" if value >= 120 else f"{value:.0f} s"


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("top1", "top5"):
        return f"{100 * value:.2f}%"
    if key == "parameters":
        return f"{value / 1e6:.2f}M"
    if key in ("train_seconds", "wall_seconds"):
        return _seconds(value)
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


def figure_path(out: str | os.PathLike) -> Path:
    """Where the figure for ``out`` is written: a name without a suffix gets .png (as matplotlib writes it)."""
    out = Path(out)
    return out if out.suffix else out.with_name(out.name + ".png")


def compare(runs: Sequence[str | os.PathLike], out: str | os.PathLike = "compare.png") -> list[dict[str, Any]]:
    """Read the run folders and write the overlaid curves to ``out`` (a new file, or a figure an earlier compare
    wrote: anything else is refused); returns the runs' rows (with histories)."""
    if not runs:
        raise VitlabError("compare needs at least one run folder")
    out = claim_file(figure_path(out), "compare")
    rows = [read_run(r) for r in runs]
    names = [r["run"] for r in rows]
    if len(set(names)) < len(names):  # same folder names under different parents: label by path
        for r in rows:
            r["run"] = r["path"]
    plot_runs([(r["run"], [EpochRow.from_dict(h) for h in r["history"]], r["loss"]) for r in rows], out,
              metadata=figure_metadata(out, "compare"))
    return rows

