"""``vitlab probe``: how good a frozen model's features are on a data set (DINO's k-NN and a linear probe)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import VitlabError
from . import add_command
from .options import add_option, integer


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "probe",
                    description="Extract a frozen model's features of a data set once (cached), then report DINO's "
                    "weighted k-NN and a full-batch logistic-regression linear probe, both on the test split, "
                    "split as `vitlab train` splits it.")
    p.add_argument("model", help="run, timm or Hugging Face folder, hf-hub:ORG/NAME, or a registered model name "
                   "(random weights)")
    add_option(p, "data", default=None, help="digits, cifar10, cifar100, an image folder or a .tar.gz; default: a "
               "run folder's own data set")
    add_option(p, "seed", default=None, help="the split's seed (default: a run folder's, else 0)")
    add_option(p, "val_fraction", default=None, help="held-out share when the data has no test split (default: a "
               "run folder's, else 0.2)")
    add_option(p, "train_fraction", default=1.0)
    p.add_argument("--k", type=integer(1), default=20, help="neighbours of the k-NN [an integer >= 1; default 20]")
    p.add_argument("--probe-wd", type=float, default=1e-4, metavar="L2",
                   help="the linear probe's L2 penalty [a number >= 0; default 0.0001]")
    add_option(p, "batch_size", default=64, help="images per forward pass")
    add_option(p, "device", help="auto: CUDA when present")
    add_option(p, "precision", default="auto", help="fp32 or bf16 features (auto: a run folder's own, else bf16 where "
               "it pays for the model, as `vitlab eval` chooses)")
    add_option(p, "threads")
    add_option(p, "img_size", help="run the model at this input size (its position table resampled); default: its own")
    add_option(p, "cache_dir", help="data cache; the features are cached in its features/ folder")
    add_option(p, "download")
    p.add_argument("--out", help="folder to write probe.json in")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import contextlib

    from ..probe.run import PROBE_JSON, probe
    from ..runs.folder import claim_folder
    from ..runs.format import read_split

    split = read_split(args.model) if Path(args.model).is_dir() else {}
    data = args.data or split.get("data")
    if data is None:
        raise VitlabError(f"{args.model} is not a run folder (no config.yaml names its data): give --data (digits, "
                          "cifar10, cifar100, an image folder or a .tar.gz)")
    if args.probe_wd < 0:
        raise VitlabError(f"--probe-wd {args.probe_wd:g} is not valid; accepted: a number >= 0")
    if args.precision not in ("fp32", "bf16", "auto"):
        raise VitlabError(f"--precision {args.precision} is not valid for features; accepted: fp32, bf16, auto")
    seed = args.seed if args.seed is not None else split.get("seed", 0)
    val_fraction = args.val_fraction if args.val_fraction is not None else split.get("val_fraction", 0.2)
    with claim_folder(args.out, "probe") if args.out else contextlib.nullcontext():
        result = probe(args.model, data, seed=seed, val_fraction=val_fraction, train_fraction=args.train_fraction,
                       k=args.k, weight_decay=args.probe_wd, batch_size=args.batch_size, device=args.device,
                       precision=args.precision, cache_dir=args.cache_dir, download=args.download,
                       img_size=args.img_size)
        if args.out:
            from ..atomic import atomic_write_json
            atomic_write_json(Path(args.out) / PROBE_JSON, result)
    print(table(result))
    return 0


def table(result: dict) -> str:
    """The result as a small table: one row per classifier."""
    s = result["seconds"]
    head = (f"{result['model']} ({result['weights']}, {result['features']} features) on {result['data']}: "
            f"{result['num_train']} training / {result['num_test']} test images, {len(result['classes'])} classes")
    rows = [("classifier", "test top-1", "seconds"),
            (f"{result['knn']['k']}-NN (weighted, T={result['knn']['temperature']:g})",
             f"{100 * result['knn']['top1']:.2f}%", f"{s['knn']:.1f}"),
            (f"linear probe (L2 {result['linear']['weight_decay']:g})", f"{100 * result['linear']['top1']:.2f}%",
             f"{s['linear']:.1f}"),
            ("(features, both splits)", "", f"{s['features']:.1f}")]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}" for r in rows]
    return "\n".join([head, *lines])
