"""``vitlab data``: a source written as WebDataset shards (``pack``), and shards written back as a folder
(``unpack``)."""
from __future__ import annotations

import argparse

from . import add_command
from .options import add_option


def register(sub: argparse._SubParsersAction) -> None:
    d = add_command(sub, "data",
                    description="Move a data set between the forms vitlab reads: 'pack' writes any source (a "
                    "built-in set, an image folder, an archive, Parquet or CSV/TSV files, a store) as "
                    "train-NNNNNN.tar and test-NNNNNN.tar shards with an _info.json, split as training splits it; "
                    "'unpack' writes shards (wds:DIR, or a pattern) back as an image folder.")
    actions = d.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = actions.add_parser("pack", help="write a source as WebDataset shards")
    p.add_argument("source", help="what --data takes: digits, cifar10, an image folder, a .tar.gz, ...")
    p.add_argument("--out", required=True, help="the new (or empty) folder of shards")
    p.add_argument("--shard-size", default="1GB", help="the most bytes of a shard, e.g. 500MB [default 1GB]")
    for name in ("val_fraction", "seed", "cache_dir", "download"):
        add_option(p, name)
    p.set_defaults(func=run_pack)
    u = actions.add_parser("unpack", help="write WebDataset shards back as an image folder")
    u.add_argument("shards", help="wds:DIR (its train and test shards) or a pattern, e.g. "
                   "DIR/train-{000000..000009}.tar")
    u.add_argument("--out", required=True, help="the new (or empty) folder: <split>/<class>/<key>.<ext>")
    u.set_defaults(func=run_unpack)


def run_pack(args: argparse.Namespace) -> int:
    from ..data.pack import pack, parse_size
    pack(args.source, args.out, parse_size(args.shard_size), val_fraction=args.val_fraction, seed=args.seed,
         cache_dir=args.cache_dir, download=args.download)
    return 0


def run_unpack(args: argparse.Namespace) -> int:
    from ..data.pack import unpack
    unpack(args.shards, args.out)
    return 0
