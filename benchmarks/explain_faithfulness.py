"""Faithfulness of every explanation method over seeds of trained models: the table of docs/explain.md.

    PYTHONPATH=src python benchmarks/explain_faithfulness.py --data ../shared/data/cifar10-jpg.tar.gz \\
        --model 'deit=studies/runs/deit_nano_distilled_patch4_32-progressive_scale=1.0-10min-seed{seed}' \\
        --model 'rope=runs/c10-rope-seed{seed}@recipes/cifar10_vit_rope.yaml' \\
        --seeds 0,1,2 --images 1000 --out runs/explain-faithfulness

A model is NAME=FOLDER, '{seed}' in the folder standing for each seed; with @RECIPE a missing folder is trained
first (``vitlab train --config RECIPE --seed S``). Per model and seed: every method's map of the class predicted on
each of the first --images test images taken with the classes in turn (as ``vitlab inspect`` takes them), scored on
the seven measures of ``vitlab.analysis.faithfulness`` (deletion, insertion, positive and negative perturbation,
ROAD MoRF and LeRF, SaCo) beside the random and edge floors, and the CPU seconds per image of each map alone. Each
(model, seed) is written to OUT/NAME-seedS.json as it finishes, and a later call reuses it, so a long run can stop
and go on. Prints per model the mean +- standard deviation over the seeds, the best method per measure and
overall (mean rank over the measures), whether each lead is separated (gap > 2 sqrt(sd_a^2 + sd_b^2)) and on how
many seeds it holds (paired: every map of a seed moves with that seed's model), and per
measure whether each floor is below every method, and clearly so (separated from the weakest method), or which
methods it cannot be told from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import vitlab
from vitlab.analysis.explain import METHODS, REGISTRY, explain, method_label
from vitlab.analysis.faithfulness import (
    BASELINE_KEYS,
    METRICS,
    SACO_GROUPED,
    faithfulness,
    map_rank_correlation,
    saco_scores,
)
from vitlab.data import load_data
from vitlab.data.augment import normalize
from vitlab.data.views import Preprocess, balanced_order

NAMES = {"deletion_auc": "deletion", "insertion_auc": "insertion", "positive_auc": "positive pert.",
         "negative_auc": "negative pert.", "road_morf_auc": "ROAD MoRF", "road_lerf_auc": "ROAD LeRF", "saco": "SaCo"}


def test_images(model, data: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` test images with the classes in turn (inspect's seeded order), normalised, and labels."""
    cfg = model.pretrained_cfg
    C, H, W = (int(s) for s in cfg["input_size"])
    bundle = load_data(data, img_size=(H, W), in_chans=C, fit=Preprocess.from_cfg(cfg).fit)
    pick = balanced_order(bundle.test.labels)[:count]
    rows, where = pick.sort()
    images = bundle.test.images[rows][torch.argsort(where)]
    return normalize(images, cfg["mean"], cfg["std"]), bundle.test.labels[pick]


def map_seconds(model, images: torch.Tensor, batch: int) -> dict[str, float]:
    """CPU seconds per image of each method's map alone (process time, every thread), median of 3."""
    out = {}
    target = torch.zeros(len(images), dtype=torch.long)
    for name in METHODS:
        runs = []
        for _ in range(3):
            c0 = time.process_time()
            for i in range(0, len(images), batch):
                explain(model, images[i:i + batch], name, target[i:i + batch], discard_ratio=0.9)
            runs.append((time.process_time() - c0) / len(images))
        out[name] = statistics.median(runs)
    return out


def write(path: Path, done: dict) -> None:
    """The (model, seed) record, as a later call reads it back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(done, indent=1) + "\n")


def agreement(model, images: torch.Tensor, batch: int) -> dict[str, float]:
    """Each method's mean Spearman rank correlation with AttnLRP's map of the predicted class, image by image: how
    far a method's map differs from AttnLRP's at all (PA-LRP's positional rules, LibraGrad's gradients)."""
    with torch.no_grad():
        target = torch.cat([model(b).argmax(1) for b in images.split(batch)])
    maps = {m: torch.cat([explain(model, images[i:i + batch], m, target[i:i + batch], discard_ratio=0.9)
                          for i in range(0, len(images), batch)]) for m in METHODS}
    return {m: map_rank_correlation(maps[m], maps["attnlrp"]) for m in METHODS}


def with_agreement(done: dict, model, images: torch.Tensor, args, path: Path) -> dict:
    """``done`` with its maps' agreement with AttnLRP over the first --agreement-images images (added to the file
    where an earlier call did not measure it)."""
    if done.get("agreement_images") != args.agreement_images:
        done["rank_correlation_with_attnlrp"] = agreement(model, images[:args.agreement_images], args.batch_size)
        done["agreement_images"] = args.agreement_images
        write(path, done)
    return done


def one_run(name: str, folder: Path, recipe: str | None, seed: int, args) -> dict:
    """Measure one trained model (training it first when it is missing and a recipe is given)."""
    path = args.out / f"{name}-seed{seed}.json"
    if path.is_file():
        done = json.loads(path.read_text())
        if done["images"] == args.images:
            print(f"{name} seed {seed}: reusing {path}")
            old_saco = done["protocol"]["saco"].get("grouped") != SACO_GROUPED
            if not old_saco and done.get("agreement_images") == args.agreement_images:
                return done
            model = vitlab.load(str(folder)).eval()
            images = test_images(model, args.data, args.images if old_saco else args.agreement_images)[0]
            if old_saco:  # measured before SaCo grouped pixels: its SaCo alone scored again
                rescored = saco_scores(model, images, methods=[(m, "cls") for m in METHODS],
                                       batch_size=args.batch_size, discard_ratio=0.9, seed=0)
                for key, value in rescored.items():
                    done["scores"][key]["saco"] = value
                done["protocol"]["saco"]["grouped"] = SACO_GROUPED
                write(path, done)
                print(f"{name} seed {seed}: SaCo scored again with groups of pixels", flush=True)
            return with_agreement(done, model, images, args, path)
    if not folder.is_dir():
        if recipe is None:
            raise SystemExit(f"{folder} does not exist; give NAME=FOLDER@RECIPE to train it")
        cmd = [sys.executable, "-m", "vitlab", "train", "--config", recipe, "--data", args.data, "--seed", str(seed),
               "--out", str(folder)] + (["--time-budget", str(args.train_minutes)] if args.train_minutes else [])
        print("training:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    model = vitlab.load(str(folder)).eval()
    images, labels = test_images(model, args.data, args.images)
    with torch.no_grad():
        accuracy = float((torch.cat([model(b).argmax(1) for b in images.split(args.batch_size)]) == labels)
                         .float().mean()) * 100
    started = time.perf_counter()
    result = faithfulness(model, images, labels, methods=[(m, "cls") for m in METHODS], batch_size=args.batch_size,
                          curve_steps=args.curve_steps, discard_ratio=0.9, keep_images=0, seed=0,
                          progress=not args.quiet)
    seconds = time.perf_counter() - started
    costs = map_seconds(model, images[:args.timing_images], 16)
    done = {"model": name, "folder": str(folder), "seed": seed, "images": args.images, "accuracy": accuracy,
            "faithfulness_seconds": seconds, "threads": torch.get_num_threads(),
            "scores": {k: {m: v[m] for m in METRICS} for k, v in result["methods"].items()},
            "map_cpu_seconds": costs, "protocol": result["protocol"]}
    write(path, done)
    with_agreement(done, model, images, args, path)
    print(f"{name} seed {seed}: {accuracy:.2f}% top-1 on the {args.images} images, {seconds:.0f} s; wrote {path}",
          flush=True)
    return done


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def summarise(name: str, runs: list[dict]) -> None:
    """Print the model's table (mean +- sd over seeds), the best per measure and overall, and the floors' check."""
    keys = list(runs[0]["scores"])
    methods = [k for k in keys if k not in BASELINE_KEYS]
    stats = {k: {m: _mean_sd([r["scores"][k][m] for r in runs]) for m in METRICS} for k in keys}
    cost = {k: statistics.fmean(r["map_cpu_seconds"][k] for r in runs) for k in methods}
    acc = _mean_sd([r["accuracy"] for r in runs])
    seeds = [r["seed"] for r in runs]
    print(f"\n### {name}: seeds {seeds}, {runs[0]['images']} images, top-1 on them {acc[0]:.2f}%"
          + (f" +- {acc[1]:.2f}" if acc[1] is not None else ""))
    head = " | ".join(f"{NAMES[m]} ({'higher' if up else 'lower'})" for m, up in METRICS.items())
    rho = ({k: statistics.fmean(r["rank_correlation_with_attnlrp"][k] for r in runs) for k in methods}
           if all("rank_correlation_with_attnlrp" in r for r in runs) else {})
    print(f"| method | {head} | CPU s / image (map) | x AttnLRP | rho with AttnLRP's map |")
    print("| --- |" + " ---: |" * (len(METRICS) + 3))
    best = {}
    for m, up in METRICS.items():
        ranked = sorted(methods, key=lambda k: stats[k][m][0], reverse=up)
        best[m] = ranked
    for k in keys:
        cells = []
        for m in METRICS:
            mean, sd = stats[k][m]
            text = f"{mean:.3f}" if m in ("deletion_auc", "insertion_auc", "saco") else f"{mean:.2f}"
            text += f" +- {sd:.3f}" if sd is not None else ""
            cells.append(f"**{text}**" if best[m][0] == k else text)
        c = f"{cost[k]:.4f} | {cost[k] / cost['attnlrp']:.2f}" if k in cost else "- | -"
        c += f" | {rho[k]:.3f}" if k in rho else " | -"
        label = REGISTRY[k].label if k in REGISTRY else method_label(k)
        print(f"| {label} | " + " | ".join(cells) + f" | {c} |")

    def gap_spread(a: str, b: str, m: str) -> tuple[float, float]:
        """The gap between a's and b's means on m and their combined spread (over one seed: no spread)."""
        (ma, sa), (mb, sb) = stats[a][m], stats[b][m]
        return abs(ma - mb), ((sa ** 2 + sb ** 2) ** 0.5 if sa is not None else float("nan"))

    def is_separated(a: str, b: str, m: str) -> bool:
        gap, spread = gap_spread(a, b, m)
        return gap > 2 * spread  # False over one seed (nan)

    def separated(a: str, b: str, m: str) -> str:
        if len(runs) == 1:
            return "one seed: separation not measured"
        gap, spread = gap_spread(a, b, m)
        sep = is_separated(a, b, m)
        return f"gap {gap:.3g} {'>' if sep else '<='} 2 x {spread:.3g}: " + ("separated" if sep else "not separated")

    def seeds_ahead(a: str, b: str, m: str) -> int:
        """On how many seeds a scores strictly better than b: a paired view, where the spread over seeds is mostly
        the models' (every map of one seed moves with its model)."""
        return sum(r["scores"][a][m] != r["scores"][b][m] and (r["scores"][a][m] > r["scores"][b][m]) == METRICS[m]
                   for r in runs)

    def ahead(a: str, b: str, m: str) -> str:
        return f"ahead on {seeds_ahead(a, b, m)} of {len(runs)} seeds"

    print("\nbest per measure (against the runner-up):")
    for m in METRICS:
        first, second = best[m][:2]
        print(f"- {NAMES[m]}: {method_label(first)} (then {method_label(second)}; {separated(first, second, m)}; "
              f"{ahead(first, second, m)})")
    mean_rank = {k: statistics.fmean(best[m].index(k) + 1 for m in METRICS) for k in methods}
    order = sorted(methods, key=mean_rank.get)
    if len(runs) > 1:
        wins = sum(is_separated(order[0], order[1], m) and best[m].index(order[0])
                   < best[m].index(order[1]) for m in METRICS)
        lead = f"ahead of it and separated on {wins} of {len(METRICS)} measures"
    else:
        lead = "one seed: separation not measured"
    print(f"overall (mean rank over the {len(METRICS)} measures): {method_label(order[0])} "
          f"({mean_rank[order[0]]:.2f}), then {method_label(order[1])} ({mean_rank[order[1]]:.2f}); {lead}")
    print("every method by mean rank: " + ", ".join(f"{method_label(k)} {mean_rank[k]:.2f}" for k in order))
    print("floors (random map, edge detector) against every method (clearly below: separated from the nearest):")
    for m, up in METRICS.items():
        parts = []
        nearest = best[m][-1]  # the weakest method, the one a floor must still be below
        for f in BASELINE_KEYS:
            above = [k for k in methods  # a floor level with a method is not below it either
                     if (stats[f][m][0] >= stats[k][m][0] if up else stats[f][m][0] <= stats[k][m][0])]
            if above:
                n = len(runs)
                named = ", ".join(method_label(k) + ("" if n == 1 else
                                                     f" (not below it on {n - seeds_ahead(k, f, m)} of {n} seeds)")
                                  for k in above)
                parts.append(f"{method_label(f)} NOT below {named}: this measure cannot tell it from "
                             + ("them" if len(above) > 1 else "it"))
            elif len(runs) == 1:
                parts.append(f"{method_label(f)} below every method (one seed: separation not measured)")
            else:
                parts.append(f"{method_label(f)} below every method, "
                             + ("clearly" if is_separated(f, nearest, m) else "not clearly")
                             + f" (nearest {method_label(nearest)}, {separated(f, nearest, m)})")
        print(f"- {NAMES[m]}: " + "; ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the data set whose test split is used (e.g. the CIFAR-10 tarball)")
    ap.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER[@RECIPE]",
                    help="a trained model per seed ('{seed}' in FOLDER); @RECIPE trains a missing one")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the trained model, e.g. 0,1,2")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--curve-steps", type=int, default=4)
    ap.add_argument("--timing-images", type=int, default=32, help="images the map costs are timed on")
    ap.add_argument("--agreement-images", type=int, default=100,
                    help="images over which each map's rank correlation with AttnLRP's is taken")
    ap.add_argument("--out", type=Path, default=Path("runs/explain-faithfulness"))
    ap.add_argument("--train-minutes", type=float, default=None,
                    help="train a missing model for this many minutes instead of its recipe's budget (a quick check)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_pretrain import cpu_name  # one CPU name for every benchmark
    print(f"{cpu_name()}, {torch.get_num_threads()} thread(s); seeds {seeds}, {args.images} images")
    for spec in args.model:
        name, _, rest = spec.partition("=")
        pattern, _, recipe = rest.partition("@")
        runs = [one_run(name, Path(pattern.format(seed=s)), recipe or None, s, args) for s in seeds]
        summarise(name, runs)


if __name__ == "__main__":
    main()
