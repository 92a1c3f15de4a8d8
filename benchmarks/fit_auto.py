"""The automatic recipe against its alternatives: ``vitlab.fit(data=..., time_budget=B)`` with nothing else given
(the rule table's choice, src/vitlab/train/auto.yaml), beside the generic defaults that ``fit`` trained before the
choice existed (``vitlab.fit("vit_tiny_patch4_32", data, time_budget=B)``) and beside the table's other rows fitted
to the same data, on data shapes the table was not written for, at the same budget and threads. Each cell is a data
shape and a budget; each arm's test top-1 and training images a second are kept in OUT/results.json, so cells can
be run one at a time (--cells) and the table written once at the end (--write: docs/python.md).

    python benchmarks/fit_auto.py --list                          # the cells
    python benchmarks/fit_auto.py --cells rgb32-50k@10 --threads 1
    python benchmarks/fit_auto.py --quick                         # every shape, tiny subsets and budgets: a smoke run
    python benchmarks/fit_auto.py --write                         # the table of OUT/results.json into docs/python.md

The shapes come from the embedded 8x8 digits and from CIFAR-10 (--cifar, the JPEG archive): greyscale at 28x28, RGB
at 32x32, and resized to 64x64 and 96x96; from a few hundred to 50,000 training images, 2 to 10 classes. The check
printed per cell: the chosen recipe within 2 points of the best alternative, and not below the generic defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import vitlab
from vitlab.data.sources import load_data
from vitlab.devices import busy_cores, cpu_flags, cpu_name, usable_cores
from vitlab.train.auto import Facts, choose, choose_row, measure_rates, read_table, row_named

ROOT = Path(__file__).resolve().parents[1]
CIFAR = ROOT.parent / "shared" / "data" / "cifar10-jpg.tar.gz"
DOCS = ROOT / "docs" / "python.md"
BEGIN, END = "<!-- fit_auto table: benchmarks/fit_auto.py --write -->", "<!-- end of the fit_auto table -->"
GENERIC = "vit_tiny_patch4_32"  # what fit trained with generic defaults before the choice (the docstring's model)


@dataclass(frozen=True)
class Shape:
    """A data shape: where from, the side, the channels, training images per class, test images per class, the
    classes kept (None: all)."""

    name: str
    source: str          # digits or cifar10
    side: int
    channels: int
    train_per_class: int | None
    test_per_class: int | None
    classes: tuple[int, ...] | None = None


SHAPES = {s.name: s for s in (
    Shape("digits8", "digits", 8, 1, None, None),
    Shape("grey28-10k", "cifar10", 28, 1, 1000, 200),
    Shape("rgb32-50k", "cifar10", 32, 3, None, None),
    Shape("rgb64-400x2", "cifar10", 64, 3, 200, 100, (3, 5)),   # cats and dogs: a few hundred images, 2 classes
    Shape("rgb96-5k", "cifar10", 96, 3, 1000, 200, (0, 1, 2, 8, 9)),
)}
CELLS = ("digits8@none", "digits8@2", "grey28-10k@5", "rgb32-50k@10", "rgb32-50k@30", "rgb64-400x2@2", "rgb96-5k@10")
QUICK = {"train": 30, "test": 10, "budget": 0.1}  # --quick: images per class and minutes


def cifar_arrays(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CIFAR-10's train and test split as uint8 (N, 32, 32, 3) arrays and labels (decoded once into vitlab's
    cache)."""
    data = load_data(str(path), log=lambda s: None)
    nhwc = lambda t: t.numpy().transpose(0, 2, 3, 1)  # noqa: E731
    return nhwc(data.train.images), data.train.labels.numpy(), nhwc(data.test.images), data.test.labels.numpy()


def digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The embedded digits as the README's quickstart splits them: the first 1,500 images to train, 297 to test."""
    from importlib.resources import files
    d = np.load(files("vitlab.data") / "digits.npz")
    x, y = d["images"][..., None], d["labels"]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def per_class(y: np.ndarray, k: int | None, classes: tuple[int, ...] | None) -> np.ndarray:
    """Indices of the first ``k`` images of each kept class (all with k None), in their order."""
    keep = np.isin(y, classes) if classes is not None else np.ones(len(y), bool)
    if k is None:
        return np.flatnonzero(keep)
    return np.sort(np.concatenate([np.flatnonzero((y == c) & keep)[:k] for c in np.unique(y[keep])]))


def reshape(x: np.ndarray, side: int, channels: int) -> np.ndarray:
    """uint8 (N, H, W, C) images at ``side`` pixels (bilinear, antialiased) and ``channels`` (ITU-R 601 luma)."""
    t = torch.from_numpy(x).permute(0, 3, 1, 2).float()
    if channels == 1 and t.shape[1] == 3:
        t = (t * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    if t.shape[-1] != side:
        t = torch.cat([F.interpolate(b, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
                       for b in t.split(2000)])
    return t.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def make_data(shape: Shape, quick: bool, cifar: Path) -> tuple[tuple, Facts]:
    """Keras's pair of the shape, and its facts."""
    x, y, xt, yt = digits_arrays() if shape.source == "digits" else cifar_arrays(cifar)
    k_train = QUICK["train"] if quick else shape.train_per_class
    k_test = QUICK["test"] if quick else shape.test_per_class
    tr, te = per_class(y, k_train, shape.classes), per_class(yt, k_test, shape.classes)
    relabel = {c: i for i, c in enumerate(shape.classes)} if shape.classes else None
    y_tr, y_te = y[tr], yt[te]
    if relabel:
        y_tr, y_te = np.vectorize(relabel.get)(y_tr), np.vectorize(relabel.get)(y_te)
    x_tr, x_te = reshape(x[tr], shape.side, shape.channels), reshape(xt[te], shape.side, shape.channels)
    counts = np.bincount(y_tr)
    facts = Facts(shape.side, shape.side, shape.channels, len(y_tr), len(y_te), len(counts),
                  float(counts.min() / counts.max()))
    return ((x_tr, y_tr.astype(np.int64)), (x_te, y_te.astype(np.int64))), facts


def arms_of(facts: Facts, budget: float | None, threads: int) -> dict[str, tuple[str | None, dict]]:
    """Each arm: (model, options). auto: nothing but the budget; generic: the docstring's model with the recipe's
    general defaults; row:NAME: the table's other rows fitted to the data (their own measured rates)."""
    # generic: the general recipe; the docstring's model told the data's size and channels, as a user has to
    generic = {**({"img_size": facts.side} if facts.side != 32 else {}),
               **({"model_args": {"in_chans": facts.channels}} if facts.channels != 3 else {})}
    arms: dict[str, tuple[str | None, dict]] = {"auto": (None, {}), "generic": (GENERIC, generic)}
    chosen = choose_row(facts)["name"]
    for row in read_table()["rows"]:
        if row["name"] == chosen:
            continue
        given = {} if budget is None else {"time_budget": budget}
        first = choose(facts, given, row=row_named(row["name"]))
        rates = measure_rates(first.values, facts, threads)
        values = choose(facts, given, rates, row=row_named(row["name"])).values
        flat = {**{k: v for k, v in values.items() if k != "augment"}, **values["augment"]}
        arms[f"row:{row['name']}"] = (flat.pop("model"), flat)
    return arms


def run_arm(model: str | None, options: dict, data: tuple, budget: float, threads: int, out: Path) -> dict:
    """One arm's run: its summary's top-1, images a second, training and wall seconds (or its error)."""
    t0 = time.perf_counter()
    try:
        result = vitlab.fit(model, data, out=out, threads=threads, **options,
                            **({"time_budget": budget} if budget is not None else {}))
    except Exception as e:  # noqa: BLE001 - an arm that fails is a cell's finding, not the benchmark's end
        return {"error": f"{type(e).__name__}: {str(e)[:200]}", "wall": time.perf_counter() - t0}
    s = result.summary
    return {"top1": s["top1"], "images_per_second": s["images_per_second"], "train_seconds": s["train_seconds"],
            "wall": time.perf_counter() - t0, "model": s["model"], "images": s.get("images"),
            "auto": (s.get("auto") or {}).get("row")}


def run_cell(cell: str, args: argparse.Namespace, results: dict) -> None:
    name, _, minutes = cell.partition("@")
    shape = SHAPES[name]
    budget = QUICK["budget"] if args.quick else None if minutes == "none" else float(minutes)
    data, facts = make_data(shape, args.quick, args.cifar)
    key = f"{cell}{' (quick)' if args.quick else ''}"
    print(f"== {key}: {facts.words()}, {said(budget)}, {args.threads} thread(s)", flush=True)
    cell_out = {"facts": facts.words(), "budget": budget, "arms": {}}
    for arm, (model, options) in arms_of(facts, budget, args.threads).items():
        if args.arms and arm.split(":")[0] not in args.arms:
            continue
        busy = busy_cores(usable_cores(), interval=0.5)
        folder = args.out / "runs" / f"{key.replace(' ', '_')}-{arm.replace(':', '_')}-{time.strftime('%H%M%S')}"
        r = run_arm(model, options, data, budget, args.threads, folder)
        r["busy_before"] = busy
        cell_out["arms"][arm] = r
        print(f"   {arm:14s} {line_of(r)}", flush=True)
    results[key] = cell_out
    print(f"   check: {verdict(cell_out['arms'])}", flush=True)


def said(budget: float | None) -> str:
    return "no budget (the epochs chosen)" if budget is None else f"{budget:g} min"


def line_of(r: dict) -> str:
    if "error" in r:
        return f"failed: {r['error']}"
    return (f"top-1 {100 * r['top1']:.2f}%  {r['images_per_second']:.0f} img/s  trained {r['train_seconds']:.0f} s  "
            f"wall {r['wall']:.0f} s  ({r['model']})")


def verdict(arms: dict) -> str:
    """The cell's check: auto within 2 points of the best alternative and not below the generic defaults."""
    auto = arms.get("auto", {}).get("top1")
    others = {a: r["top1"] for a, r in arms.items() if a != "auto" and r.get("top1") is not None}
    if auto is None or not others:
        return "n/a"
    best = max(others, key=others.get)
    ok = auto >= others[best] - 0.02 and auto >= others.get("generic", 0.0)
    return (f"{'ok' if ok else 'FAILS'}: auto {100 * auto:.2f}% vs best alternative {best} "
            f"{100 * others[best]:.2f}% ({100 * (auto - others[best]):+.2f} points)")


def table(results: dict) -> str:
    """The markdown table of the cells (top-1 and img/s per arm)."""
    arms = sorted({a for c in results.values() for a in c["arms"]}, key=lambda a: (a != "auto", a != "generic", a))
    head = "| cell | data | " + " | ".join(arms) + " | check |"
    lines = [head, "|" + " --- |" * (len(arms) + 3)]
    for key, c in results.items():
        cells = []
        for a in arms:
            r = c["arms"].get(a)
            cells.append("-" if r is None else "failed" if "error" in r else
                         f"{100 * r['top1']:.2f}% ({r['images_per_second']:.0f} img/s"
                         + (f", {r['auto']}" if a == "auto" and r.get("auto") else "") + ")")
        lines.append(f"| {key} | {c['facts']}, {said(c['budget'])} | " + " | ".join(cells)
                     + f" | {verdict(c['arms']).split(':')[0]} |")
    return "\n".join(lines)


def machine() -> str:
    flags = cpu_flags()
    isa = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "x86"
    return f"{cpu_name()} ({isa}), {len(usable_cores())} cores usable"


def write_docs(results: dict, threads: int) -> None:
    text = DOCS.read_text()
    block = (f"{BEGIN}\n\nMeasured by `python benchmarks/fit_auto.py` on {machine()}, {threads} thread(s) an arm, "
             "the arms one after the other (each row's load before it started is in OUT/results.json):\n\n"
             f"{table(results)}\n\n{END}")
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## The automatic recipe against its alternatives\n\n" + block + "\n"
    DOCS.write_text(text)
    print(f"wrote the table into {DOCS}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", nargs="+", default=None, help=f"SHAPE@MINUTES or SHAPE@none, no budget: the epochs "
                   f"the table chooses (default: {' '.join(CELLS)}; none "
                   "with --write alone)")
    p.add_argument("--arms", nargs="+", default=None, help="only these arms: auto, generic, row")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['train']} training images a class, "
                   f"{QUICK['budget']:g} min: a smoke run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cifar", type=Path, default=CIFAR, help="the CIFAR-10 JPEG archive")
    p.add_argument("--out", type=Path, default=Path("runs/fit_auto"), help="runs and results.json")
    p.add_argument("--write", action="store_true", help="write OUT/results.json's table into docs/python.md")
    p.add_argument("--list", action="store_true", help="print the cells and shapes")
    args = p.parse_args(argv)
    if args.list:
        for s in SHAPES.values():
            print(f"{s.name}: {s.source} at {s.side}x{s.side}x{s.channels}, {s.train_per_class or 'all'} train / "
                  f"{s.test_per_class or 'all'} test images a class, classes {s.classes or 'all'}")
        print("cells:", " ".join(CELLS))
        return 0
    if args.cells is None:
        args.cells = [] if args.write else list(CELLS)
    unknown = [c for c in args.cells if c.partition("@")[0] not in SHAPES or not c.partition("@")[2]]
    if unknown:
        p.error(f"unknown cell(s) {', '.join(unknown)}; accepted: SHAPE@MINUTES (or SHAPE@none) with SHAPE one of "
                f"{', '.join(SHAPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else {}
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    for cell in args.cells:
        run_cell(cell, args, results)
        store.write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.write:
        write_docs({k: v for k, v in results.items() if "(quick)" not in k}, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
