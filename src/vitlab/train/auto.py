"""The recipe chosen when no model is named: from facts of the data, the machine's measured speed and the budget.

``vitlab.fit(data=...)`` and ``vitlab train --data X`` without ``--model`` (or ``--init``) train what the rule table
auto.yaml says for data of this shape: a row picked by the image size (``choose_row``), fitted to the number of
images, the channels and the budget by the table's rules (``choose``), with every option given by name kept as
given. It is no search: one short timing of the chosen model's training step (and of its evaluation) on this
machine, as a study calibrates, turns the budget into epochs and decides how much test-time augmentation the final
evaluation can afford. The choice goes through the one Recipe declaration like any option given (``auto_values``
returns the values the recipe is made from) and is recorded in it as ``auto``: config.yaml and summary.json keep
what was chosen and why; the run logs it as one line.
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from ..data.sources import DataBundle, load_data
from ..errors import VitlabError
from ..models.registry import create_model, get_spec
from .recipe import AUGMENT_FIELDS, FIELDS, _nested

TABLE = Path(__file__).with_name("auto.yaml")
AUTO = "auto"  # the model argument that asks for the choice (as leaving the model out does)


@dataclass(frozen=True)
class Facts:
    """What the choice reads from the data: the image size and channels, the images and classes, and how even the
    classes are (the smallest class's training images over the largest's: 1 balanced)."""

    height: int
    width: int
    channels: int
    num_train: int
    num_test: int
    classes: int
    balance: float

    @property
    def side(self) -> int:
        return min(self.height, self.width)

    def words(self) -> str:
        kind = "greyscale" if self.channels == 1 else "RGB" if self.channels == 3 else f"{self.channels}-channel"
        even = "balanced" if self.balance >= 0.5 else f"unbalanced: smallest class {self.balance:.2f}x the largest"
        return (f"{self.num_train} {kind} {self.height}x{self.width} training images in {self.classes} classes "
                f"({even})")


def facts_of(data: DataBundle) -> Facts:
    """The facts of a loaded data set (its training split)."""
    counts = np.bincount(np.asarray(data.train.labels), minlength=len(data.classes))
    counts = counts[counts > 0]
    c, h, w = data.train.images.shape[1:]
    return Facts(int(h), int(w), int(c), int(data.num_train), int(len(data.test.images)), len(data.classes),
                 float(counts.min() / counts.max()) if len(counts) else 1.0)


@functools.cache
def read_table(path: str = str(TABLE)) -> dict[str, Any]:
    """The rule table (auto.yaml), read once."""
    table = yaml.safe_load(Path(path).read_text())
    if not isinstance(table, dict) or table.get("version") != 1 or not table.get("rows"):
        raise VitlabError(f"{path} is not a version-1 rule table (rows: and rules:)")
    return table


def row_named(name: str, table: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The table's row of that name."""
    rows = (table or read_table())["rows"]
    for row in rows:
        if row["name"] == name:
            return row
    raise VitlabError(f"auto row {name!r} does not exist; accepted: {', '.join(r['name'] for r in rows)}")


def meets(facts: Facts, when: Mapping[str, Any]) -> bool:
    return (facts.side >= when.get("min_side", 0) and facts.side <= when.get("max_side", math.inf))


def choose_row(facts: Facts, table: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The first row whose ``when`` the facts meet."""
    table = table or read_table()
    for row in table["rows"]:
        if meets(facts, row.get("when", {})):
            return row
    raise VitlabError(f"no row of the rule table {TABLE.name} takes {facts.words()}")


def stem_widths(side: int, stem: Mapping[str, Any]) -> list[int]:
    """The hybrid's conv groups for images of ``side`` pixels: as many as bring the grid (the side less one after the
    2x2 whitening, halved by each group) to ``grid_max`` or less; widths ``first``, then ``middle``, the last ones
    ``last``."""
    grid, groups = side - 1, 0
    while grid > stem["grid_max"] or groups == 0:
        grid, groups = grid // 2, groups + 1
    last = list(stem["last"])[-(groups - 1):] if groups > 1 else []
    return [stem["first"]] + [stem["middle"]] * (groups - 1 - len(last)) + last


def patch_for(side: int, grid: int) -> int:
    """The largest patch no larger than ``side / grid`` that divides the side."""
    patch = max(1, side // grid)
    while side % patch:
        patch -= 1
    return patch


def model_values(row: Mapping[str, Any], facts: Facts) -> dict[str, Any]:
    """The row's model at the data's size and channels."""
    own = get_spec(row["model"]).args
    args = dict(row.get("model_args", {}), in_chans=facts.channels)
    if "stem" in row:
        args["stem_widths"] = stem_widths(facts.side, row["stem"])
    if "grid" in row:
        args["patch_size"] = patch_for(facts.side, row["grid"])
    args = {k: v for k, v in args.items() if k not in own or list(np.atleast_1d(own[k])) != list(np.atleast_1d(v))}
    size = facts.side if facts.height == facts.width and own.get("img_size") != facts.side else None
    return {"model": row["model"], "model_args": args, **({"img_size": size} if size else {})}


def batch_for(row_batch: int, num_train: int, rules: Mapping[str, Any]) -> int:
    """The row's batch, halved while an epoch would have fewer than ``min_steps_per_epoch`` steps."""
    batch = row_batch
    while batch > rules["min_batch"] and num_train / batch < rules["min_steps_per_epoch"]:
        batch //= 2
    return max(batch, rules["min_batch"])


def tta_views(tta: bool, translate: int) -> int:
    """The forward passes an image takes in evaluation: 1, 2 with its mirror, 6 with mirror + translations."""
    return 1 if not tta else 6 if translate else 2


@dataclass
class Choice:
    """What ``choose`` decided: the values (given ones left out), the row, and why, in one line."""

    values: dict[str, Any]
    row: str
    reason: str

    def record(self, rates: Mapping[str, float] | None) -> dict[str, Any]:
        """What config.yaml and summary.json keep of it."""
        return {"row": self.row, "reason": self.reason,
                "rate": None if not rates else round(float(rates["train"]), 2),
                "eval_rate": None if not rates else round(float(rates["eval"]), 2)}


def choose(facts: Facts, given: Mapping[str, Any], rates: Mapping[str, float] | None = None,
           table: Mapping[str, Any] | None = None, row: Mapping[str, Any] | None = None) -> Choice:
    """The recipe for data of these ``facts``: the row's values fitted by the table's rules; ``given`` (the options
    named, augmentation ones flat or under ``augment``) win and are left out. ``rates``: the chosen model's measured
    training and evaluation images a second (``measure_rates``); with a time budget they say how many epochs it
    buys and how much test-time augmentation the final evaluation affords. ``row``: that row instead of the one the
    facts pick (the benchmark's alternatives)."""
    table = table or read_table()
    rules, row = table["rules"], row or choose_row(facts, table)
    given = _nested({k: v for k, v in given.items() if v is not None})
    given_aug = given.get("augment", {})
    chosen = {**model_values(row, facts), **{k: v for k, v in row["values"].items() if k not in AUGMENT_FIELDS}}
    aug = {k: v for k, v in row["values"].items() if k in AUGMENT_FIELDS}
    why = [f"row {row['name']!r} ({row['evidence']})"]
    batch = batch_for(chosen["batch_size"], facts.num_train, rules)
    if batch != chosen["batch_size"]:
        chosen["lr"] = float(f"{chosen['lr'] * math.sqrt(batch / chosen['batch_size']):.3g}")
        why.append(f"batch {batch} for {facts.num_train} images, lr by its square root")
        chosen["batch_size"] = batch
    if facts.channels == 1 and not rules["greyscale_hflip"] and aug.get("hflip", True):
        aug.update(hflip=False, alternating_flip=False)
        why.append("no mirror flips for one channel")
    budget = given.get("time_budget")
    if budget is None and given.get("steps") is None and "epochs" not in given:
        epochs = min(row["max_epochs"], max(row["min_epochs"], round(row["target_images"] / facts.num_train)))
        chosen["epochs"] = epochs
        if rates:
            why.append(f"{epochs} epochs, about {epochs * facts.num_train / rates['train'] / 60:.0f} min at "
                       f"{rates['train']:.0f} img/s")
    elif budget is not None and rates:
        views = tta_views(given.get("tta", chosen.get("tta", False)), given.get("tta_translate",
                                                                                chosen.get("tta_translate", 0)))
        share = rules["eval_share"] * 60 * float(budget)
        if "tta" not in given and "tta_translate" not in given:
            while views > 1 and facts.num_test * views / rates["eval"] > share:
                views = 2 if views == 6 else 1
            chosen["tta"], chosen["tta_translate"] = views > 1, (chosen.get("tta_translate", 0) if views == 6 else 0)
        epochs = 60 * float(budget) * rates["train"] / facts.num_train
        why.append(f"{float(budget):g} min at {rates['train']:.0f} img/s is {epochs:.2g} epochs; final evaluation "
                   f"{facts.num_test * views / rates['eval']:.0f} s with {views} view{'s' if views > 1 else ''}")
    values = {k: v for k, v in chosen.items() if k not in given}
    if "model_args" in given and isinstance(given["model_args"], dict):
        values["model_args"] = {**chosen["model_args"], **given["model_args"]}
    values["augment"] = {k: v for k, v in aug.items() if k not in given_aug}
    named = sorted(k for k in given if k in chosen or k in ("time_budget", "steps", "epochs")) + sorted(
        k for k in given_aug if k in aug)
    if named:
        why.append(f"given: {', '.join(named)}")
    return Choice(values, row["name"], "; ".join(why))


def measure_rates(values: Mapping[str, Any], facts: Facts, threads: int | None = None,
                  rules: Mapping[str, Any] | None = None, now: Callable[[], float] = time.perf_counter
                  ) -> dict[str, float]:
    """Training and evaluation images a second of the chosen model on this machine (on the CPU, at its threads):
    one untimed step, then ``probe_steps`` timed ones of ``probe_batch`` random images; float32, the model's
    own optimiser left out (its cost is small beside the step's)."""
    rules = rules or read_table()["rules"]
    n, steps = rules["probe_batch"], rules["probe_steps"]
    old, rng = torch.get_num_threads(), torch.random.get_rng_state()  # the probe leaves both as they were
    if threads:
        torch.set_num_threads(threads)
    try:
        model = create_model(values["model"], num_classes=max(facts.classes, 2),
                             **{**({"img_size": values["img_size"]} if values.get("img_size") else {}),
                                **values.get("model_args", {})})
        x = torch.randn(n, facts.channels, facts.height, facts.width)
        y = torch.randint(0, max(facts.classes, 2), (n,))
        loss = torch.nn.CrossEntropyLoss()
        model.train()
        for i in range(steps + 1):
            if i == 1:
                t0 = now()
            model.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
        train = n * steps / max(now() - t0, 1e-9)
        model.eval()
        with torch.no_grad():
            model(x)
            t0 = now()
            for _ in range(steps):
                model(x)
            evaluate = n * steps / max(now() - t0, 1e-9)
    finally:
        torch.set_num_threads(old)
        torch.random.set_rng_state(rng)
    return {"train": train, "eval": evaluate}


def wanted(values: Mapping[str, Any]) -> bool:
    """Whether the values ask for the choice: no model (or ``auto``), no ``init``, supervised training."""
    return (values.get("model") in (None, AUTO) and not values.get("init")
            and values.get("pretrain") in (None, "none"))


def auto_values(values: dict[str, Any], log: Callable[[str], None],
                measure: Callable[..., dict[str, float]] = measure_rates) -> dict[str, Any]:
    """``values`` (a recipe's, as given) with the choice filled in where they ask for it (``wanted``), and the
    record of it as ``auto``; the one line that says what was chosen and why is logged. Other values are returned
    as they are."""
    if not wanted(values):
        return values
    values = {k: v for k, v in values.items() if k != "model"}
    data = str(values.get("data", FIELDS["data"].default))
    bundle = load_data(data, img_size=values.get("img_size"), cache_dir=values.get("cache_dir"),
                       download=bool(values.get("download", False)),
                       val_fraction=float(values.get("val_fraction", FIELDS["val_fraction"].default)),
                       seed=int(values.get("seed", 0)), log=lambda s: None, store_size=values.get("store_size"),
                       test_data=values.get("test_data"))
    facts = facts_of(bundle)
    first = choose(facts, values)
    device = values.get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    rates = measure({**first.values, **{k: v for k, v in values.items() if k in ("img_size",)}}, facts,
                    threads=values.get("threads")) if on_cpu else None
    choice = choose(facts, values, rates)
    record = choice.record(rates)
    log(f"auto: {describe(choice.values, values)} for {facts.words()}; {choice.reason}")
    chosen = {**choice.values, "augment": {**choice.values["augment"], **_nested(values).get("augment", {})}}
    return {**_nested(values), **chosen, "auto": {**record, "facts": asdict(facts)}}


def describe(chosen: Mapping[str, Any], given: Mapping[str, Any]) -> str:
    """The chosen recipe in a few words: model, batch, lr, schedule, augmentation, precision, evaluation."""
    pick = {**_nested(chosen), **_nested({k: v for k, v in given.items() if v is not None})}
    aug = {**chosen.get("augment", {}), **_nested(given).get("augment", {})}
    args = pick.get("model_args") or {}
    spec = get_spec(str(pick.get("model"))).args
    shape = ", ".join(f"{k} {v}" for k, v in {**spec, **args}.items()
                      if k in ("stem_widths", "patch_size", "depth", "embed_dim"))
    span = (f"{float(pick['time_budget']):g} min" if pick.get("time_budget") else
            f"{pick['steps']} steps" if pick.get("steps") else f"{pick.get('epochs')} epochs")
    mixes = [f"{k} {aug[k]:g}" for k in ("mixup", "cutmix", "label_smoothing") if aug.get(k)]
    tta = ("tta mirror+translate" if pick.get("tta_translate") else "tta mirror") if pick.get("tta") else "no tta"
    return (f"{pick.get('model')} ({shape}), batch {pick.get('batch_size')}, {pick.get('optimizer', 'adamw')} lr "
            f"{pick.get('lr')} warm-up {pick.get('warmup')} then cosine over {span}, crop {aug.get('crop', 'rrc')}"
            f"{', flips' if aug.get('hflip', True) else ''}{', ' + ', '.join(mixes) if mixes else ''}, {tta}, "
            f"precision {pick.get('precision', 'auto')}")
