"""``vitlab cache``: what the data cache holds, and removing superseded stores."""
from __future__ import annotations

import argparse
import json

from . import add_command
from .options import add_option


def register(sub: argparse._SubParsersAction) -> None:
    c = add_command(sub, "cache",
                    description="The data cache ($VITLAB_CACHE, else ~/.cache/vitlab) keeps one store per "
                    "source and settings. 'list' shows them with their sizes and whether the source has changed "
                    "since; 'clean' removes superseded stores: only the files vitlab wrote, in the folders it made "
                    "(they hold its marker), and lists what it leaves.")
    c.add_argument("action", choices=("list", "clean"), help="list, or clean")
    add_option(c, "cache_dir")
    c.add_argument("--all", action="store_true", help="clean: remove every store, unfinished build and download too")
    c.add_argument("--dry-run", action="store_true", help="clean: say what would be removed, remove nothing")
    c.add_argument("--json", action="store_true", help="list: print the entries as JSON")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..data.cache import cache_entries, clean, default_cache_dir
    from ..data.disk import format_size
    folder = args.cache_dir or default_cache_dir()
    if args.action == "list":
        entries = cache_entries(folder)
        if args.json:
            print(json.dumps([dict(vars(e), path=str(e.path)) for e in entries], indent=2))
            return 0
        for e in entries:
            print(f"{format_size(e.bytes):>12}  {e.kind:<8} {e.status:<30} {e.path.name}  {e.source}".rstrip())
        removable = sum(e.bytes for e in entries if e.removable)
        print(f"{format_size(sum(e.bytes for e in entries))} in {folder}; {format_size(removable)} superseded "
              "('vitlab cache clean' removes it)")
        return 0
    removed, kept = clean(folder, everything=args.all, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for e in removed:
        print(f"{verb} {e.path} ({e.kind}, {e.status}, {format_size(e.bytes)})")
        for path in e.left:
            print(f"  left {path} (not written by vitlab)")
    for e in kept:
        print(f"left {e.path} ({e.kind}, {e.status})")
    print(f"{verb} {len(removed)} entries, {format_size(sum(e.bytes for e in removed))}; left {len(kept)} "
          f"entries and {sum(len(e.left) for e in removed)} files that vitlab did not write")
    return 0
