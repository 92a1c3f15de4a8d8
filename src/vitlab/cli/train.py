"""``vitlab train``: its options are the recipe's fields, made from their declarations."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..train.recipe import AUGMENT_FIELDS, FIELDS
from .options import add_recipe_option

SKIP = ("model_args", "augment", "out")  # recipe fields with options of their own (or none)


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train (or fine-tune, or distil) a model and write a run folder",
                       description="Train a model; options override the --config recipe, which overrides defaults.")
    t.add_argument("--config", help="YAML recipe (see recipes/)")
    t.add_argument("--out", help="run folder to write")
    t.add_argument("--resume", metavar="DIR", help="continue the unfinished run in DIR")
    t.add_argument("--model-arg", action="append", metavar="KEY=VALUE", default=None,
                   help="model argument override, repeatable (e.g. depth=6, widths=[32,64,128,256])")
    for name in [*FIELDS, *AUGMENT_FIELDS]:
        if name not in SKIP:
            add_recipe_option(t, name)
    t.set_defaults(func=run)


def parse_model_args(items: list[str]) -> dict:
    """KEY=VALUE strings, values read as YAML (numbers, lists, booleans), into a dict."""
    import yaml
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-arg {item!r} is not KEY=VALUE (e.g. depth=6)")
        out[key.strip()] = yaml.safe_load(value)
    return out


def run(args: argparse.Namespace) -> int:
    from ..runs.format import CONFIG_YAML
    from ..train import load_recipe, train
    if args.resume:
        folder = Path(args.resume)
        if not (folder / CONFIG_YAML).is_file():
            raise FileNotFoundError(f"{folder} is not a run folder: it has no {CONFIG_YAML}")
        recipe = load_recipe(folder / CONFIG_YAML, out=str(folder))
    else:
        given = {name: getattr(args, name) for name in [*FIELDS, *AUGMENT_FIELDS] if name not in SKIP}
        if args.model_arg:
            given["model_args"] = parse_model_args(args.model_arg)
        recipe = load_recipe(args.config, out=args.out, **given)
    summary = train(recipe, resume=bool(args.resume))
    if summary:
        print(f"test top-1 {100 * summary['top1']:.2f}%  top-5 {100 * summary['top5']:.2f}%  "
              f"{summary['wall_seconds']:.0f} s  -> {recipe.out}")
    return 0
