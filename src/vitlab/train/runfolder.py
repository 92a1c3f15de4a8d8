"""The run folder: what a run writes, and the checks that keep one run from overwriting another."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..atomic import atomic_write_bytes, atomic_write_json
from .recipe import Recipe
from .state import CHECKPOINT

SUMMARY, METRICS, CONFIG_YAML = "summary.json", "metrics.jsonl", "config.yaml"


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse to overwrite a finished run or to silently restart an unfinished one."""
    if (out / SUMMARY).exists():
        raise ValueError(f"{out} holds a finished run ({SUMMARY} exists); choose another --out")
    if not resume and (out / CHECKPOINT).exists():
        raise ValueError(f"{out} holds an unfinished run: continue it with `vitlab train --resume {out}` "
                         "or choose another --out")


def write_config(out: Path, r: Recipe, model_name: str | None) -> None:
    """config.yaml: the recipe as run (a `--resume` reads it back)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_YAML).write_text(yaml.safe_dump({**r.to_dict(), "model": model_name or r.model}, sort_keys=False))


def write_metrics(out: Path, history: Sequence[dict]) -> None:
    atomic_write_bytes(out / METRICS, "".join(json.dumps(h) + "\n" for h in history).encode())


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """summary.json, written last: a folder without it is an unfinished run."""
    atomic_write_json(out / SUMMARY, summary)


def epoch_line(row: dict) -> str:
    """The one-line report of an epoch."""
    return (f"epoch {row['epoch']}: loss {row['train_loss']:.4f} train acc {row['train_acc']:.3f}"
            + (f" test top-1 {row['test_top1']:.4f}" if "test_top1" in row else "")
            + (f" (EMA {row['ema_test_top1']:.4f})" if "ema_test_top1" in row else "")
            + f" lr {row['lr']:.2e} {row['images_per_second']:.0f} img/s")
