"""``vitlab pretrain --method mae|mpp|dino|ibot|distill``: ``vitlab train`` with a self-supervised objective, labels
unused.

The options are train's (the recipe's fields) less those only supervised training uses (``recipe.SUPERVISED_ONLY``,
refused by name when given, but for ``--teacher``, which ``--method distill`` takes), with pre-training defaults
(``recipe.PRETRAIN_DEFAULTS``: MAE's augmentation, no label mixing, lr = 1.5e-4 x batch_size / 256) that options
given explicitly override, and ``--pretrain-arg KEY=VALUE`` for the objective's own options.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import VitlabError
from ..train.recipe import AUGMENT_FIELDS, FIELDS, PRETRAIN_TAKES, SUPERVISED_ONLY
from . import add_command
from . import train as train_cli
from .options import add_recipe_option, flag

OWN = ("pretrain", "pretrain_args")  # given here as --method and --pretrain-arg
TAKEN = tuple(sorted({name for names in PRETRAIN_TAKES.values() for name in names}))  # listed: a method takes them


def register(sub: argparse._SubParsersAction) -> None:
    from ..objectives import OBJECTIVES, objective_options
    p = add_command(sub, "pretrain",
                    description="Pre-train a ViT/DeiT encoder without labels on any data vitlab reads, or a flat "
                    "folder of images; then fine-tune it with `vitlab train --init RUN`.")
    p.add_argument("--method", choices=list(OBJECTIVES), help="mae: masked autoencoder (He et al. 2022); mpp: masked "
                   "patch prediction (Dosovitskiy et al. 2021, appendix B.1.2); dino: self-distillation with an EMA "
                   "teacher on multi-crop views (Caron et al. 2021); ibot: dino plus a masked-patch token loss "
                   "(Zhou et al. 2022); distill: the pooled and patch features of a frozen --teacher [required, "
                   "except with --resume]")
    p.add_argument("--pretrain-arg", action="append", metavar="KEY=VALUE", default=None,
                   help="objective option, repeatable; mae: " + ", ".join(objective_options("mae"))
                   + "; mpp: " + ", ".join(objective_options("mpp"))
                   + "; dino: " + ", ".join(objective_options("dino"))
                   + "; ibot: dino's and " + ", ".join(o for o in objective_options("ibot")
                                                       if o not in objective_options("dino"))
                   + "; distill: " + ", ".join(objective_options("distill")))
    refused = [n for n in SUPERVISED_ONLY if n not in TAKEN]
    train_cli.add_run_options(p, skip=(*OWN, *refused))
    for name in refused:  # parsed, to be refused by name in one line, but not listed
        add_recipe_option(p, name, hidden=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..runs.format import read_config
    supervised = [flag(name) for name in SUPERVISED_ONLY if name not in TAKEN and getattr(args, name) is not None]
    if supervised:
        raise VitlabError(f"{', '.join(supervised)}: supervised training's, which pre-training does not use (it learns "
                          "without labels, a classifier head or a teacher); accepted: the options `vitlab pretrain "
                          "--help` lists")
    if args.resume:
        method = read_config(Path(args.resume)).get("pretrain", "none")
        if args.pretrain_arg or (args.method and args.method != method):
            raise VitlabError("--method and --pretrain-arg cannot change on --resume: the run goes on as it began "
                              f"({method})")
        if method == "none":
            raise VitlabError(f"{args.resume} is not a pre-training run; continue it with `vitlab train --resume`")
        args.pretrain = None  # train's --resume reads the method from the run's config.yaml
        return train_cli.run(args)
    from ..objectives import OBJECTIVES
    if not args.method:
        raise VitlabError(f"--method is required; accepted: {', '.join(OBJECTIVES)}")
    from ..train import load_recipe, train
    given = {name: getattr(args, name) for name in [*FIELDS, *AUGMENT_FIELDS] if name not in (*train_cli.SKIP, *OWN)}
    if args.model_arg:
        given["model_args"] = train_cli.parse_model_args(args.model_arg)
    options = train_cli.parse_model_args(args.pretrain_arg or [], "--pretrain-arg", "mask_ratio=0.75")
    recipe = train_cli.in_folder(load_recipe(args.config, strict=True, out=args.out, pretrain=args.method,
                                             pretrain_args=options or None, **given))
    args.out = recipe.out  # as train's: the 'interrupted' line names the run folder
    train_cli.finished(train(recipe), recipe.out)
    return 0
