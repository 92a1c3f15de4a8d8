"""What in the cache folder vitlab wrote: a marker file it writes into every folder it creates there.

``vitlab cache clean`` removes only files it can prove it wrote: a file inside a folder that holds the
marker, whose name is one its kind of folder holds (a store's header.json, images.u8, ...; the probe's
``features-<hex>.safetensors``; the files a download extracted, listed in the marker). A folder the user
made, a file the user put into one of vitlab's folders and anything at the top of the cache folder that is
not a marked folder are left where they are, and said.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from ..atomic import TEMP_PATTERN, atomic_write_json

MARKER = ".vitlab-cache.json"  # written by vitlab into each folder it creates in the cache folder
WRITTEN_BY = "vitlab"


def mark_owned(folder: Path, kind: str, files: Iterable[str] = ()) -> None:
    """Mark ``folder`` (which vitlab has just created) as vitlab's, of ``kind``; ``files`` lists what it holds where
    the kind names no fixed files."""
    atomic_write_json(Path(folder) / MARKER, {"written_by": WRITTEN_BY, "kind": kind, "files": sorted(files)})


def make_owned_folder(folder: Path, kind: str) -> None:
    """Create ``folder`` and mark it, unless it exists (a folder vitlab did not create stays unmarked)."""
    folder = Path(folder)
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    mark_owned(folder, kind)


def owner_marker(folder: Path) -> dict | None:
    """The marker of a folder vitlab created (kind and listed files), or None."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("written_by") != WRITTEN_BY:
        return None
    if not isinstance(marker.get("kind"), str):
        return None
    files = marker.get("files", [])
    return dict(marker, files=[f for f in files if isinstance(f, str)] if isinstance(files, list) else [])


def owned_name(names: Callable[[str], bool]) -> Callable[[str], bool]:
    """A test of a file name: one of ``names``, or the temporary file of an atomic write of one."""
    def test(name: str) -> bool:
        m = TEMP_PATTERN.fullmatch(name)
        return names(m["name"] if m else name)
    return test


FEATURES_FILE = re.compile(r"features-[0-9a-f]{8,64}\.safetensors")


def remove_owned(folder: Path, owns: Callable[[str], bool], dry_run: bool = False) -> list[Path]:
    """Remove the files of a marked ``folder`` that ``owns(relative path)`` says vitlab wrote, then its empty
    folders and, when nothing else is left, the marker and the folder; returns what is left (not vitlab's)."""
    left, folders = [], []
    for dirpath, dirnames, filenames in os.walk(folder):
        folders.append(dirpath)
        for name in filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(folder).as_posix()
            if rel == MARKER:
                continue
            if full.is_symlink() or not owns(rel):
                left.append(full)
            elif not dry_run:
                full.unlink(missing_ok=True)
        for name in dirnames:  # a link to a folder is left alone, never followed
            if (Path(dirpath) / name).is_symlink():
                left.append(Path(dirpath) / name)
    if dry_run:
        return left
    for dirpath in reversed(folders[1:]):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    if not left:
        (Path(folder) / MARKER).unlink(missing_ok=True)
        try:
            os.rmdir(folder)
        except OSError:
            left.append(Path(folder))
    return left
