"""``vitlab models``: the registered models with their parameters and multiply-adds (GMACs)."""
from __future__ import annotations

import argparse

from . import add_command


def register(sub: argparse._SubParsersAction) -> None:
    m = add_command(sub, "models")
    m.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'vit_*' or cifar")
    m.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..catalog import model_table  # the counted facts: no torch, no model built
    print(model_table(args.pattern))
    return 0
