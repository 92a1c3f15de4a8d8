"""``vitlab study NAME``: a paper's claim as a family of runs that differ in one factor, under one budget.

Every arm is an ordinary training run (a run folder under ``OUT/runs/``), named after what it
changes, so a study that is stopped and started again skips the finished arms, resumes the
unfinished ones from their checkpoints, and two studies that need the same arm (``locality``
and ``data-scale``) train it once. The study then writes ``OUT/NAME.json`` (every arm and seed),
``OUT/NAME.md`` (the table and the measured answer to the claim) and ``OUT/NAME.png``.

Budget: ``--budget MIN`` minutes of training per arm, trained as a number of steps: the images a minute of training
takes are measured once for the study folder (a short timed run of the base recipe's ViT, ``OUT/calibration.json``,
reused by every later run and study there), so every arm trains the same steps whatever else loads the machine while
it trains; or ``--epochs N``. ``--jobs N`` trains N arms side by side, each on cores/N threads (or ``--threads``),
which keeps the arms' conditions equal. ``--quick`` is a smoke run on the embedded digits (a fifth of them,
one epoch at 16x16).
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ..atomic import atomic_write_json, read_json_object
from ..errors import VitlabError
from ..progress import Progress
from ..runs.folder import LOCK, STUDY_FEATURES, STUDY_RUNS, LockHeld, lock_holder, release_lock, take_lock, write_lock
from ..runs.format import has_config, is_finished, read_config
from ..runs.jobs import Job, run_jobs
from ..train.recipe import FIELDS, Recipe, load_recipe
from ..train.trainer import train
from .claims import (
    BASE_RECIPE,
    DEFAULT_METHODS,
    INCOMPLETE,
    OWN_RECIPE_OVERRIDES,
    OWN_RECIPE_SKIP,
    PRETRAIN_BASE_KEYS,
    PRETRAIN_SCALES,
    PRETRAINED,
    QUICK,
    QUICK_SHARE,
    SEEDS,
    STUDIES,
    TEACHER,
    VIT,
    Arm,
    Study,
    base_values,
    pretrain_study,
    recipe_values,
)
from .probe import pretraining_rows, probe_rows
from .report import aggregate, write_report


def _slug(values: dict[str, Any], seed: int, budget: str = "") -> str:
    """A run folder name from an arm's values: model, then every other changed value, the budget ('16min', '1ep':
    studies share a run only at the same budget), then the seed."""
    parts = [str(values.get("model", "default"))]
    for key in sorted(values):
        if key in ("model", "teacher"):
            continue
        value = values[key]
        if isinstance(value, dict):
            parts += [f"{k}={v}" for k, v in sorted(value.items())]
        else:
            parts.append(f"{key}={value}")
    parts += [budget] if budget else []
    text = "-".join(parts + [f"seed{seed}"])
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "", text.replace(", ", "_").replace(" ", ""))


def arm_recipe(arm: Arm, seed: int, out: Path, common: dict[str, Any], teacher_run: Path | None,
               share: float = 1.0, base: dict[str, Any] | None = None,
               pretrained: dict[str, Path] | None = None) -> Recipe:
    """The recipe of one arm and seed: the base values (or the arm's own recipe's), the study's common values with
    the budget scaled to the arm, then the arm's; ``pretrained`` maps 'METHOD:SCALE' to the study's pre-training
    run (what ``init: pretrained:METHOD:SCALE`` stands for)."""
    base = base_values() if base is None else base
    if arm.pretraining:  # the optimiser's values only: the augmentation is pre-training's own (random resized crops)
        base = {k: v for k, v in base.items() if k in PRETRAIN_BASE_KEYS}
    if arm.recipe:  # a teacher's own recipe, under the study's budget
        own = recipe_values(BASE_RECIPE.parent / arm.recipe)
        base = {**{k: v for k, v in own.items() if k not in OWN_RECIPE_SKIP}, **OWN_RECIPE_OVERRIDES}
    values = {**base, **scaled_budget(common, arm), **arm.values, "seed": seed}
    rate, rates = values.pop("rate", None), values.pop("pretrain_rates", None) or {}
    rate = rates.get(arm.values.get("pretrain"), rate) if arm.pretraining else rate
    if rate:  # the arm's minutes at the study's calibrated rate (a pre-training method's own), as steps of its batch
        batch = values.get("batch_size") or FIELDS["batch_size"].default
        values["steps"] = max(1, round(rate * values.pop("time_budget") / batch))
        values["pretrain_args"] = {**{k: max(1, round(f * values["steps"])) for k, f in arm.step_args.items()},
                                   **values.get("pretrain_args", {})}
    if share < 1:
        values["train_fraction"] = values.get("train_fraction", 1.0) * share
    if values.get("teacher") == TEACHER:
        values["teacher"] = str(teacher_run)
    init = values.get("init")
    if isinstance(init, str) and init.startswith(PRETRAINED):
        values["init"] = str((pretrained or {})[init.removeprefix(PRETRAINED)])
    return load_recipe(None, out=str(out), **values)


def scaled_budget(common: dict[str, Any], arm: Arm) -> dict[str, Any]:
    """The study's common values with the budget scaled to the arm: minutes by scale x time_share, epochs by scale
    (rounded up)."""
    out = dict(common)
    if out.get("time_budget"):
        out["time_budget"] = round(out["time_budget"] * arm.scale * arm.time_share, 4)
    elif out.get("epochs") and arm.scale != 1:
        out["epochs"] = math.ceil(out["epochs"] * arm.scale)
    return out


def budget_tag(values: dict[str, Any]) -> str:
    """A run's budget in its folder name: '8.5min' or '2ep'."""
    return f"{values['time_budget']:g}min" if values.get("time_budget") else f"{values['epochs']}ep"


RUN_OVERHEAD = 0.75  # minutes a run costs besides its training budget: start, data, the final evaluation


def _depends(arm: Arm) -> bool:
    """Whether the arm starts from another run of its study: the teacher's students, the pre-trained encoders'
    fine-tuning runs."""
    init = arm.values.get("init")
    return arm.values.get("teacher") == TEACHER or (isinstance(init, str) and init.startswith(PRETRAINED))


def planned_minutes(study: Study, minutes: float, seeds: Sequence[int], jobs: int) -> float:
    """Wall-clock minutes of the whole study from nothing: its runs' budgets (plus RUN_OVERHEAD each) laid on
    ``jobs`` slots as the runner lays them: the teacher and pre-training runs first, each free slot taking the first
    run whose teacher or encoder has finished (counted as once all of them have)."""
    first, rest = [], []
    for arm in study.arms:
        n = 1 if arm.teacher or arm.pretraining else len(seeds)
        run = (minutes * arm.scale * arm.time_share + RUN_OVERHEAD, _depends(arm))
        (first if arm.teacher or arm.pretraining else rest).extend([run] * n)
    slots = [0.0] * jobs
    for t, _ in first:
        slots[slots.index(min(slots))] += t
    ready_at = max(slots) if first else 0.0  # the runs that depend on the first ones start after the last of them
    pending = list(rest)
    while pending:
        i = slots.index(min(slots))
        now = slots[i]
        k = next((k for k, (_, dep) in enumerate(pending) if not dep or ready_at <= now), None)
        if k is None:  # nothing can start yet: this slot waits for the first runs
            slots[i] = ready_at
            continue
        slots[i] = now + pending.pop(k)[0]
    return max(slots)


_SAME = ("model", "model_args", "data", "img_size", "train_fraction", "time_budget", "epochs", "steps", "seed",
         "distill", "batch_size", "lr")


def _check_same(folder: Path, recipe: Recipe) -> None:
    """A run folder that exists must hold this arm: a study's folder is not reused for another budget."""
    if not has_config(folder):
        return
    old, new = read_config(folder), recipe.to_dict()
    diff = [k for k in _SAME if old.get(k) != new.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in diff)
        raise VitlabError(f"{folder} holds another run ({shown}); give the study another --out")


def _child_command(folder: Path, recipe: Recipe) -> list[str]:
    """The command that trains the arm from the start (its recipe written beside its folder as NAME.yaml)."""
    spec = _beside(folder, ".yaml")
    values = {k: v for k, v in recipe.to_dict().items() if k != "out"}
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(values, sort_keys=False))
    return [sys.executable, "-m", "vitlab", "train", "--config", str(spec), "--out", str(folder)]


def _job(name: str, recipe: Recipe) -> Job:
    """An arm as a child run: it continues from its checkpoint where it has one, and waits for its teacher and init
    where they are runs of the study (folders beside its own)."""
    folder = Path(recipe.out)
    needs = tuple(Path(p) for p in (recipe.teacher, recipe.init) if p and Path(p).parent == folder.parent)
    return Job(name, folder, _child_command(folder, recipe),
               resume=[sys.executable, "-m", "vitlab", "train", "--resume", str(folder)], needs=needs,
               log=_beside(folder, ".log"))


def _beside(folder: Path, ext: str) -> Path:
    """A file next to a run folder: NAME.log, NAME.yaml, NAME.lock (names hold dots: 'train_fraction=0.05')."""
    return folder.parent / (folder.name + ext)


WAIT_S = 5.0  # how often a study looks again at a run that another process trains
_HELD: dict[Path, int] = {}  # run folder -> the fd of its study lock, while this process trains it


def _claim(folder: Path, log: Callable[[str], None]) -> bool:
    """Take ``folder``'s study lock (``NAME.lock`` beside it, flocked while this process trains the run: the kernel
    releases it however the process ends, so it never goes stale) before training it. While another live process
    holds it (a second study that shares the run) or writes the run folder itself (a run of a study that was
    killed), wait for it; returns False when the run was finished meanwhile, True when this process now owns it
    (until ``_release``)."""
    lock, fd, waited = _beside(folder, ".lock"), None, False
    try:
        while not is_finished(folder):
            if fd is None:
                with contextlib.suppress(LockHeld):
                    fd = take_lock(lock)
                    write_lock(fd, f"study {os.getpid()}")
            pid = lock_holder(lock) if fd is None else lock_holder(folder / LOCK)
            if fd is not None and pid is None:
                _HELD[folder], fd = fd, None
                return True
            if pid is None:  # released as this process looked: take it now
                continue
            if not waited:
                log(f"{folder.name} is being trained by process {pid or '(unknown)'}: waiting for it")
                waited = True
            time.sleep(WAIT_S)
        return False
    finally:
        if fd is not None:
            release_lock(lock, fd)


def _release(folder: Path) -> None:
    """Give up this process's study lock on ``folder`` (the lock file goes with it)."""
    fd = _HELD.pop(folder, None)
    if fd is not None:
        release_lock(_beside(folder, ".lock"), fd)


def _train_arms(jobs: list[tuple[str, Recipe]], parallel: int, log: Callable[[str], None], bar) -> None:
    """Train the (name, recipe) runs: one at a time in this process, or ``parallel`` at a time in child
    processes (runs/jobs.py, each writing OUT/runs/NAME.log); a failure names the arm and its log."""
    if parallel == 1:
        for name, recipe in jobs:
            folder = Path(recipe.out)
            folder.parent.mkdir(parents=True, exist_ok=True)
            if _claim(folder, log):  # else finished meanwhile by another study
                log(f"training {name} -> {folder}")
                try:
                    train(recipe, resume=has_config(folder), log=lambda s: None)
                finally:
                    _release(folder)
            bar.update(1)
        return
    failed = run_jobs([_job(name, recipe) for name, recipe in jobs], parallel, log,
                      claim=lambda job: _claim(job.folder, log),  # False: finished meanwhile by another study
                      release=lambda job: _release(job.folder), done=lambda job: bar.update(1))
    if failed:
        raise RuntimeError("study arm(s) failed: " + "; ".join(failed))


def _common(study: Study, data: str, budget: float | None, epochs: int | None, quick: bool) -> dict[str, Any]:
    """The values every arm of the study shares: the data and the per-run budget (quick: digits, one epoch)."""
    if quick:
        return dict(QUICK)
    if epochs is not None:
        return {"data": data, "epochs": epochs, "time_budget": None}
    return {"data": data, "time_budget": study.minutes if budget is None else budget}


def _plan(study: Study, runs: Path, common: dict[str, Any], seeds: Sequence[int],
          quick: bool) -> list[tuple[Arm, int, Recipe]]:
    """Every (arm, seed, recipe) of the study; one teacher and one run per pre-training arm (seed 0)."""
    base = base_values()
    folder = {id(a): lambda seed, a=a: runs / _slug(a.values, seed, budget_tag(scaled_budget(common, a)))
              for a in study.arms}
    teacher = next((folder[id(a)](0) for a in study.arms if a.teacher), None)
    pretrained = {f"{a.values['pretrain']}:{a.scale:g}": folder[id(a)](0) for a in study.arms if a.pretraining}
    plan = []
    for arm in study.arms:
        for seed in ([0] if arm.teacher or arm.pretraining else seeds):
            recipe = arm_recipe(arm, seed, folder[id(arm)](seed), common, teacher,
                                share=QUICK_SHARE if quick else 1.0, base=base, pretrained=pretrained)
            _check_same(Path(recipe.out), recipe)
            plan.append((arm, seed, recipe))
    return plan


def select_runs(study: Study, plan: list[tuple[Arm, int, Recipe]],
                patterns: Sequence[str] | None) -> list[tuple[Arm, int, Recipe]]:
    """The runs of the arms whose label matches one of ``patterns`` (shell patterns, case-insensitive), with the
    teacher and pre-training runs they start from; the whole plan when ``patterns`` is None."""
    if patterns is None:
        return plan
    chosen: set[int] = set()
    for pattern in patterns:
        hits = [id(a) for a in study.arms if fnmatch.fnmatchcase(a.label.lower(), pattern.lower())]
        if not hits:
            raise VitlabError(f"--arm {pattern!r} matches no arm of the {study.name} study; accepted: shell patterns "
                              "('*' for any text) over its arms: " + "; ".join(a.label for a in study.arms))
        chosen.update(hits)
    needs = {Path(p) for a, _, r in plan if id(a) in chosen for p in (r.teacher, r.init) if p}
    return [(a, s, r) for a, s, r in plan if id(a) in chosen or Path(r.out) in needs]


def _missing(study: Study, rows: list[dict[str, Any]]) -> list[str]:
    """The arms (or seeds of an arm) with no finished run, in the study's order: 'none', 'learned 1D (seed 1, 2)'."""
    unfinished = {r["label"]: r["unfinished"] for r in rows}
    missing = []
    for arm in study.arms:
        if arm.pretraining:
            continue
        if arm.label not in unfinished:
            missing.append(arm.label)
        elif unfinished[arm.label]:
            missing.append(f"{arm.label} (seed {', '.join(map(str, unfinished[arm.label]))})")
    return missing


CALIBRATION = "calibration.json"  # OUT/calibration.json: the training images a minute takes, measured once
CALIBRATION_SECONDS = 60.0  # how long the measurement trains (a shorter budget: the budget)


def calibrate(out: Path, common: dict[str, Any], log: Callable[[str], None], arm: Arm | None = None) -> dict[str, Any]:
    """The training images a minute of a study's runs takes on its data with its threads per run: read from
    OUT/calibration.json, or measured once now by a short timed run of the base recipe's ViT (its schedule, progressive
    resizing included, laid over the measurement) and recorded there, so that every arm of every study in OUT, on
    every re-run, turns its minutes into the same steps whatever loads the machine when it trains. ``arm``: a
    pre-training arm, whose method's own rate is measured the same way with its recipe (a DINO step, with its crops
    and teacher, costs more than a supervised one; an MAE step, whose encoder sees a quarter of the patches, less)."""
    method = arm.values["pretrain"] if arm else None
    path, key = out / CALIBRATION, f"{common['data']}, {common['threads']} thread(s) per run"
    key += f", {method} pre-training" if method else ""
    recorded = read_json_object(path) if path.is_file() else {}
    if key in recorded:
        return recorded_rate(path, key, recorded[key])
    seconds = min(CALIBRATION_SECONDS, 60 * common["time_budget"])
    what = f"{VIT} {method} pre-training" if method else f"{VIT} training"
    log(f"calibrating the study budget: {seconds:g} s of {what} on {common['data']} with "
        f"{common['threads']} thread(s), once for {out} ({path})")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".calibration-") as tmp:
        timed = {k: v for k, v in common.items() if k not in ("rate", "pretrain_rates")}
        if arm:
            recipe = arm_recipe(replace(arm, scale=1.0, time_share=1.0), 0, Path(tmp) / "run",
                                {**timed, "time_budget": seconds / 60}, None)
        else:
            recipe = load_recipe(None, out=str(Path(tmp) / "run"), **{
                **base_values(), "model": VIT, "data": common["data"], "threads": common["threads"],
                "cache_dir": common.get("cache_dir"), "time_budget": seconds / 60, "seed": 0})
        summary = train(recipe, log=lambda s: None)
    entry = {"images_per_minute": 60 * summary["images"] / max(summary["train_seconds"], 1e-9),
             "measured_with": what, "seconds": round(summary["train_seconds"], 2), "steps": summary["steps"],
             "images": summary["images"]}
    atomic_write_json(path, {**recorded, key: entry})
    log(f"study budget{' of ' + method if method else ''}: {entry['images_per_minute']:.0f} training images a "
        f"minute ({path})")
    return entry


def recorded_rate(path: Path, key: str, entry: Any) -> dict[str, Any]:
    """A calibration.json entry as vitlab measured it: a rate that is a number > 0 and agrees with the images and
    seconds recorded beside it (within 5%, their rounding); anything else (edited, damaged) is one line naming the
    file, the entry and the value, never a rate that turns minutes into any number of steps."""
    fields = entry if isinstance(entry, dict) else {}
    rate, images, seconds = (fields.get(k) for k in ("images_per_minute", "images", "seconds"))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                  for v in (rate, images, seconds))
    if not numbers or abs(rate - 60 * images / seconds) > 0.05 * rate:
        what = (f"images_per_minute {rate!r}" if isinstance(entry, dict) else f"{type(entry).__name__} {entry!r}")
        raise VitlabError(f"{path}: the entry {key!r} holds {what}, not the rate vitlab measured ({images!r} images in "
                          f"{seconds!r} s); accepted: the file as vitlab wrote it (remove the entry, or the file, to "
                          "measure the rate again)")
    return entry


def budget_said(common: dict[str, Any], quick: bool, calibration: dict[str, Any] | None) -> dict[str, Any]:
    """The result's budget: its text, its unit and the per-run amount (a whole-set arm's steps for a budget in
    minutes, which the arms train as steps)."""
    if quick:
        return {"budget": f"quick (digits, {100 * QUICK_SHARE:g}% of the images, 1 epoch at 16x16)", "unit": "epochs",
                "per_run": common["epochs"]}
    if common.get("epochs"):
        return {"budget": f"{common['epochs']} epochs", "unit": "epochs", "per_run": common["epochs"]}
    minutes, rate = common["time_budget"], calibration["images_per_minute"]
    steps = max(1, round(rate * minutes / base_values()["batch_size"]))
    own = calibration.get("pretraining") or {}
    pre = "".join(f"; {m} pre-training at its own {c['images_per_minute']:,.0f}" for m, c in own.items())
    return {"budget": f"{minutes:g} min per run, trained as {steps:,} steps of {base_values()['batch_size']} images "
                      f"(an arm's minutes at {rate:,.0f} training images a minute{pre}, measured once: "
                      f"{CALIBRATION}; the same steps whatever loads the machine)",
            "unit": "steps", "per_run": steps, "calibration": calibration}


def check_distinct(name: str, values: Sequence[Any], accepted: str, valid: Callable[[Any], bool]) -> None:
    """One line for a list of study values (seeds, budgets) that is empty, holds an invalid value or one twice."""
    twice = sorted({v for v in values if list(values).count(v) > 1}, key=str)
    if not values or twice or not all(valid(v) for v in values):
        why = f" ({', '.join(map(str, twice))} twice)" if twice else ""
        raise VitlabError(f"{name} {','.join(map(str, values)) or '(none)'} are not valid{why}; accepted: {accepted}")


def run_study(name: str, out: str | os.PathLike = "studies", data: str = "cifar10", budget: float | None = None,
              epochs: int | None = None, seeds: Sequence[int] = SEEDS, jobs: int = 1, threads: int | None = None,
              quick: bool = False, cache_dir: str | None = None, log: Callable[[str], None] = print,
              pretrain_budgets: Sequence[float] | None = None, arms: Sequence[str] | None = None,
              pretrain_methods: Sequence[str] | None = None) -> dict[str, Any]:
    """Train what is missing of study ``name`` and write its table, figure and JSON; returns the JSON. ``budget``:
    minutes per run (default: the study's own, which fits 90 minutes with two jobs and three seeds);
    ``pretrain_budgets``: the pretrain study's pre-training runs, in fine-tuning budgets (default 1 and 3);
    ``pretrain_methods``: its pre-training methods (default MAE and DINO, each trained at its own calibrated rate);
    ``arms``: train only the arms these shell patterns match (and the runs they start from). The report holds every
    arm with a finished run (its finished seeds); while an arm or seed is missing the verdict is 'incomplete' and
    names them."""
    if name not in STUDIES:
        raise VitlabError(f"no study {name!r}; accepted: {', '.join(STUDIES)}")
    if (pretrain_budgets is not None or pretrain_methods is not None) and name != "pretrain":
        raise VitlabError(f"pretrain budgets and methods are not valid for the {name} study; accepted: with the "
                          "pretrain study")
    if jobs < 1:
        raise VitlabError(f"jobs={jobs!r} is not valid; accepted: an integer >= 1")
    check_distinct("seeds", seeds, "integers >= 0, each once (a seed given twice counts one run twice and makes its "
                   "spread look smaller)", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    if pretrain_budgets is not None:
        check_distinct("pretrain budgets", pretrain_budgets, "numbers > 0, each once",
                       lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    if not seeds or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise VitlabError(f"seeds={list(seeds)!r} is not valid; accepted: integers >= 0, e.g. 0,1,2")
    if threads is not None and threads < 1:
        raise VitlabError(f"threads={threads!r} is not valid; accepted: an integer >= 1")
    study = STUDIES[name]
    if pretrain_budgets is not None or pretrain_methods is not None:
        study = pretrain_study(PRETRAIN_SCALES if pretrain_budgets is None else tuple(pretrain_budgets),
                               DEFAULT_METHODS if pretrain_methods is None else tuple(pretrain_methods))
    out = Path(out)
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    common = {**_common(study, data, budget, epochs, quick), "threads": threads, "cache_dir": cache_dir}
    calibration = calibrate(out, common, log) if common.get("time_budget") else None
    if calibration:
        common["rate"] = calibration["images_per_minute"]
        methods = {a.values["pretrain"]: a for a in study.arms if a.pretraining}  # each method's own minutes
        calibration["pretraining"] = {m: calibrate(out, common, log, a) for m, a in methods.items()}
        common["pretrain_rates"] = {m: c["images_per_minute"] for m, c in calibration["pretraining"].items()}
    plan = _plan(study, out / STUDY_RUNS, common, seeds, quick)
    chosen = select_runs(study, plan, arms)
    todo = [(a, s, r) for a, s, r in chosen if not is_finished(Path(r.out))]
    minutes = common.get("time_budget")
    picked = study if arms is None else replace(study, arms=list({id(a): a for a, _, _ in chosen}.values()))
    log(f"study {name}: {len(chosen)} runs" + (f" of {len(plan)} (--arm)" if arms is not None else "")
        + f", {len(chosen) - len(todo)} done, {len(todo)} to train "
        + (f"({jobs} at a time, {threads} thread(s) each)" if todo else "")
        + (f"; about {planned_minutes(picked, minutes, seeds, jobs):.0f} minutes from nothing" if minutes else ""))
    with Progress(total=len(chosen), initial=len(chosen) - len(todo), unit="run", desc=f"study {name}") as bar:
        # the teacher before its students, the pre-training runs before the arms that start from them
        # (a free slot takes the first run that does not wait for one of them)
        first = [(f"{a.label} seed {s}", r) for a, s, r in todo if a.teacher or a.pretraining]
        rest = [(f"{a.label} seed {s}", r) for a, s, r in todo if not (a.teacher or a.pretraining)]
        if todo:
            _train_arms(first + rest, jobs, log, bar)

    rows, extra = aggregate(study, plan), {}  # every arm with a finished run
    missing = _missing(study, rows)
    pre_runs = {a.label: Path(r.out) for a, _, r in plan if a.pretraining and is_finished(Path(r.out))}
    if study.probe and pre_runs:
        rows += probe_rows(pre_runs, study.probe, common["data"], common.get("img_size"),
                           QUICK_SHARE if quick else 1.0, cache_dir, out / STUDY_FEATURES, threads, log)
    if pre_runs:
        extra["pretraining"] = pretraining_rows(pre_runs)
    verdict, answer = study.answer(rows) if not missing else (
        INCOMPLETE, "not trained yet: " + "; ".join(missing) + " (the study without --arm trains them)")
    result = {"study": name, "claim": study.claim, "source": study.source, "paper": study.paper,
              **budget_said(common, quick, calibration),
              "data": common["data"], "seeds": list(seeds), "threads_per_run": threads, "runs_at_a_time": jobs,
              "recipe": {**base_values(), **{k: v for k, v in common.items()
                                             if k not in ("cache_dir", "rate", "pretrain_rates")}},
              "rows": rows, "verdict": verdict, "answer": answer, "notes": study.notes, **extra}
    write_report(result, study, out)
    return result
