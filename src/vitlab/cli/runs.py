"""``vitlab compare`` and ``vitlab study``: run folders side by side, and the papers' claims as sets of runs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import VitlabError
from . import add_command
from .options import add_option


def register(sub: argparse._SubParsersAction) -> None:
    c = add_command(sub, "compare")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders (finished or not)")
    c.add_argument("--out", default="compare.png",
                   help="figure to write: a new file, or one an earlier compare wrote (default: compare.png here)")
    c.add_argument("--json", action="store_true", help="print the table as JSON")
    c.set_defaults(func=run_compare)

    st = add_command(sub, "study",
                     description="Train every arm of a study (skipping finished ones, resuming unfinished "
                     "ones) and write OUT/NAME.md, .json and .png.")
    st.add_argument("name", nargs="?", help="pos-embed, data-scale, hybrid, distill, locality or pretrain (--list)")
    st.add_argument("--list", action="store_true", help="list the studies and their claims")
    add_option(st, "data", default="cifar10", help="data set (a .tar.gz or folder works)")
    st.add_argument("--budget", type=float, default=None,
                    help="minutes of training per run on the whole training set, trained as steps: the images a "
                    "minute takes are measured once for --out (OUT/calibration.json), so every arm trains as much "
                    "whatever loads the machine (default: the study's own, which fits 90 minutes with --jobs 2 and "
                    "three seeds on a 2-core CPU; --list shows it)")
    add_option(st, "epochs", default=None, help="epochs per run instead of a time budget")
    st.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated (default 0,1,2: a verdict needs a "
                    "spread, at least two)")
    st.add_argument("--pretrain-budgets", default=None, metavar="B,B,...",
                    help="pretrain study: its pre-training runs, in fine-tuning budgets (default 1,3; 10,20,40 with "
                    "the default 1.5 minutes: 15, 30 and 60 minutes of pre-training)")
    st.add_argument("--methods", default=None, metavar="M,M,...",
                    help="pretrain study: its pre-training methods, comma-separated, among mpp, mae, dino and ibot "
                    "(default mae,dino)")
    st.add_argument("--arm", action="append", dest="arms", metavar="PATTERN",
                    help="train only the arms whose name matches (a shell pattern, e.g. 'MAE 79x*'; repeat for more) "
                    "and the runs they start from; the report holds every finished arm, its verdict 'incomplete' "
                    "while an arm it reads is untrained")
    st.add_argument("--jobs", type=int, default=1, help="runs trained side by side, each on cores/jobs threads")
    add_option(st, "threads", help="CPU threads per run (default: cores / jobs)")
    st.add_argument("--out", default="studies", help="folder for the runs and the results (default studies)")
    add_option(st, "cache_dir")
    st.add_argument("--quick", action="store_true", help="smoke run: digits, one epoch at 16x16 per run")
    st.set_defaults(func=run_study)


def run_compare(args: argparse.Namespace) -> int:
    from ..runs.compare import compare, figure_path, format_table
    rows = compare(args.runs, out=args.out)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "history"} for r in rows], indent=2))
    else:
        print(format_table(rows))
        print(f"curves: {figure_path(args.out)}")
    return 0


def run_study(args: argparse.Namespace) -> int:
    from ..runs.folder import claim_folder
    from ..studies import STUDIES, run_study
    if args.list or not args.name:
        for name, s in STUDIES.items():
            print(f"{name:<11} {s.minutes:g} min per run  {s.claim} ({s.source})")
        if args.list:
            return 0
        print(f"vitlab study: error: which study? accepted: {', '.join(STUDIES)} (listed above), or --list",
              file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise VitlabError(f"--seeds {args.seeds!r} is not valid; accepted: integers >= 0 separated by commas, "
                          "e.g. 0,1,2") from None
    budgets = None
    if args.pretrain_budgets is not None:
        try:
            budgets = [float(b) for b in args.pretrain_budgets.split(",")]
        except ValueError:
            raise VitlabError(f"--pretrain-budgets {args.pretrain_budgets!r} is not valid; accepted: numbers > 0 "
                              "separated by commas, e.g. 1,3,10") from None
    with claim_folder(args.out, "study"):
        result = run_study(args.name, out=args.out, data=args.data, budget=args.budget, epochs=args.epochs,
                           seeds=seeds, jobs=args.jobs, threads=args.threads, quick=args.quick,
                           cache_dir=args.cache_dir, pretrain_budgets=budgets, arms=args.arms,
                           pretrain_methods=args.methods.split(",") if args.methods is not None else None)
    print((Path(args.out) / f"{args.name}.md").read_text())
    print(f"table: {Path(args.out) / (args.name + '.md')}  figure: {Path(args.out) / (args.name + '.png')}")
    return 0 if result else 1
