"""``vitlab train``: its options are the recipe's fields, made from their declarations."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import VitlabError
from ..runs.folder import new_run_folder
from ..train.recipe import AUGMENT_FIELDS, FIELDS, SECTIONS
from . import add_command
from .options import add_recipe_option, flag

SKIP = ("model_args", "pretrain_args", "augment", "out", "auto")  # fields with options of their own (or none)


def register(sub: argparse._SubParsersAction) -> None:
    t = add_command(sub, "train",
                    description="Train a model; options override the --config recipe, which overrides defaults. "
                    "A default given per data set or model applies where the option is not given, and not with "
                    "--init (which keeps the general ones).")
    add_run_options(t)
    t.set_defaults(func=run)


def add_run_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The options of a command that writes a training run: the run's, then the recipe's fields (less ``skip``) in
    groups by the recipe's sections."""
    run = parser.add_argument_group("the run")
    run.add_argument("--config", help="YAML recipe (see recipes/)")
    run.add_argument("--out", help="run folder to write [default: runs/MODEL-TIME]")
    run.add_argument("--resume", metavar="DIR", help="continue the unfinished run in DIR")
    for section, names in SECTIONS.items():
        group = parser.add_argument_group(section)
        if "model_args" in names:
            group.add_argument("--model-arg", action="append", metavar="KEY=VALUE", default=None,
                               help="model argument override, repeatable (e.g. depth=6, widths=[32,64,128,256])")
        for name in names:
            if name not in (*SKIP, *skip):
                add_recipe_option(group, name)


def parse_model_args(items: list[str], flag: str = "--model-arg", example: str = "depth=6") -> dict:
    """KEY=VALUE strings, values read as YAML (numbers, lists, booleans), into a dict."""
    import yaml
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise VitlabError(f"{flag} {item!r} is not KEY=VALUE (e.g. {example})")
        out[key.strip()] = yaml.safe_load(value)
    return out


def resumed(args: argparse.Namespace):
    """The recipe that continues the run in ``--resume DIR``: the options given that a resume honours (a longer run:
    more epochs, a later time budget); any other option given is refused in one line that names it."""
    from ..api import resumed_recipe
    given = {name: getattr(args, name) for name in [*FIELDS, *AUGMENT_FIELDS] if name not in SKIP}
    refused = [f for f, v in (("--config", args.config), ("--model-arg", args.model_arg)) if v]
    if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
        refused.append("--out")
    return resumed_recipe(args.resume, given, refused, named=flag)


def recipe_of(args: argparse.Namespace):
    """The recipe a ``vitlab train`` command line (not ``--resume``) trains: ``--config``, then the options given;
    without a model (nor --init), the one the rule table chooses for the data and the budget (train/auto.py)."""
    from ..progress import log_line
    from ..train.auto import auto_values
    from ..train.recipe import check_given, make_recipe, recipe_values
    given = {name: getattr(args, name) for name in [*FIELDS, *AUGMENT_FIELDS] if name not in SKIP}
    if args.model_arg:
        given["model_args"] = parse_model_args(args.model_arg)
    values = recipe_values(args.config, out=args.out, **given)
    make_recipe(values)  # every option checked before the data is read for the choice
    said: list[str] = []  # the choice's line, said once the options given are known to be used
    recipe = make_recipe(auto_values(values, said.append))
    check_given(recipe, args.config, {"out": args.out, **given})  # an option given that the run would not use
    for line in said:
        log_line(line)
    return recipe


def run(args: argparse.Namespace) -> int:
    from ..train import train
    recipe = in_folder(resumed(args) if args.resume else recipe_of(args))
    args.out = recipe.out  # the run folder, named by --out or by the config: the 'interrupted' line names it
    summary = train(recipe, resume=bool(args.resume))
    finished(summary, recipe.out)
    return 0


def finished(summary: dict, out: str) -> None:
    """A finished run's result line (rank 0 only: the others get no summary); a pre-training run's encoder judged by
    its k-NN against an untrained one's first, where the data has labels."""
    if not summary:
        return
    if summary["pretrain"] != "none":
        from ..probe.pretraining import judge_pretraining
        judge_pretraining(out)
    print(result_line(summary, out))


def in_folder(recipe):
    """The recipe with its run folder: ``--out``, else a new ``runs/<model>-<time>``."""
    if recipe.out is None:
        recipe.out = str(new_run_folder(recipe.model or recipe.init or "model"))
    return recipe


def result_line(summary: dict, out: str) -> str:
    """What a finished run prints: its test accuracy, or a pre-training run's held-out loss."""
    if summary["top1"] is None:
        held = "held-out" if summary["num_test"] else "training-image (none held out)"
        return (f"{held} {summary['pretrain']} loss {summary['test_loss']:.4f}  {summary['wall_seconds']:.0f} s  -> "
                f"{out} (fine-tune its encoder: vitlab train --init {out})")
    from ..metrics import top_k_text
    top_k = top_k_text(summary["per_class"])
    return (f"test top-1 {100 * summary['top1']:.2f}%  {top_k} {100 * summary['top5']:.2f}%  "
            f"{summary['wall_seconds']:.0f} s  -> {out}")
