"""The data cache: where it is, what a store's key is made of, its free space, and what it holds.

A store is found again by a key made of the source's identity and the settings it was decoded
with. A source's identity is its path and, for every file it reads, the file's size, mtime,
ctime and inode number: any change of a file's content through the file system moves its ctime,
which no program can set back, and a file replaced by another has another inode. A CSV/TSV list
is identified by its own bytes and by the files it lists. A build waits until the newest of
those timestamps is a clock tick in the past before it reads the files, so that a change made
later always shows in the key (the "racy timestamp" case).

``cache_entries`` lists what the cache folder holds (stores, unfinished builds, downloads, and what is
not vitlab's) with sizes and whether each store is still the current one for its source; ``clean``
removes the superseded ones, only the files vitlab can prove it wrote (``owned``), and says what it left.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, VitlabError
from .disk import disk_usage, format_sizes, free_bytes
from .owned import FEATURES_FILE, owned_name, owner_marker, remove_owned
from .scan import walk
from .store import HEADER, STORE_FILES
from .tables import Listing, list_table

__all__ = ["CacheEntry", "cache_entries", "clean", "clean_cache", "default_cache_dir", "format_sizes", "free_bytes"]

CACHE_VERSION = 3  # part of every store's key: a new version builds new stores
FINE_TICK_S = 0.05  # timestamps with sub-second parts: a change moves them by at least the kernel's tick
COARSE_TICK_S = 2.0  # whole-second (or FAT's 2-second) timestamps


def default_cache_dir() -> Path:
    """The data cache folder: $VITLAB_CACHE, else ~/.cache/vitlab."""
    env = os.environ.get("VITLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vitlab"


# ----------------------------------------------------------------------------------------------
# keys


def _stat(path: str | os.PathLike) -> list[int] | None:
    """[size, mtime_ns, ctime_ns, inode] of a file (symlinks followed), or None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def folder_fingerprint(root: Path) -> list[list]:
    """[relative path, size, mtime_ns, ctime_ns, inode] of every file under ``root`` (hidden ones skipped)."""
    entries = []
    for dirpath, _, filenames in walk(root):
        for f in filenames:
            full = os.path.join(dirpath, f)
            st = _stat(full)
            if st is not None:
                entries.append([os.path.relpath(full, root), *st])
    return entries


def files_fingerprint(paths: Iterable[str | os.PathLike]) -> list[list[int] | None]:
    """``_stat`` of each of ``paths``, in order (None for a missing file)."""
    return [_stat(p) for p in paths]


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _ctimes(ident: Any) -> Iterable[int]:
    """The ctime_ns values inside a fingerprint (the third of every [size, mtime, ctime, inode] run)."""
    if isinstance(ident, list):
        if len(ident) >= 4 and all(isinstance(v, int) for v in ident[-4:]):
            yield ident[-2]
        else:
            for v in ident:
                yield from _ctimes(v)


def settle(ident: Any, clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until the newest ctime in ``ident`` is a timestamp tick in the past; returns the seconds waited.

    A file changed within the same tick as its last change keeps its ctime; once the tick is over,
    what is read is what that ctime stands for, and any later change gives a new one.
    """
    ctimes = list(_ctimes(ident))
    if not ctimes:
        return 0.0
    tick = FINE_TICK_S if any(c % 1_000_000_000 for c in ctimes) else COARSE_TICK_S
    wait = min(max(ctimes) / 1e9 + tick - clock(), tick)  # a ctime in the future waits one tick, not forever
    if wait > 0:
        sleep(wait)
    return max(wait, 0.0)


def cache_key(*parts: Any) -> str:
    """A store's key: a short hash of the cache version, the source's identity and the settings."""
    blob = json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def identity_digest(ident: Any) -> str:
    """The hash of a source's identity kept in its store's header (to tell a superseded store)."""
    return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# what the cache holds


FEATURES_DIR = "features"  # the cache's folder of frozen models' features (vitlab probe; vitlab.probe.features)
NOT_OURS = "not vitlab's (no marker of vitlab's in it): never removed"


@dataclass
class CacheEntry:
    """One thing in the cache folder: ``kind`` is store, partial, download, features or other (what vitlab cannot
    prove it wrote, never removed)."""

    path: Path
    kind: str
    bytes: int
    source: str = ""
    status: str = ""  # stores: current, superseded (source changed), source gone, unreadable
    removable: bool = False  # what clean_cache removes without everything=True
    left: list[Path] = field(default_factory=list)  # clean: the files in it that vitlab did not write, left there


def _lock_free(store: Path) -> bool:
    """Whether no process holds the build lock of a store (a build or another clean)."""
    lock = store.with_name(f".{store.name.removesuffix('.partial')}.lock")
    if not lock.exists():
        return True
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def source_identity(kind: str, where: str | os.PathLike, listing: Listing | None = None) -> Any:
    """What identifies a source's content (see ``cache``): None for the embedded digits; raises
    FileNotFoundError when the source is gone."""
    if kind in ("digits", "arrays", None):  # embedded, or a store that is its own source (data/arrays.py)
        return None
    path = Path(where)
    if not path.exists():
        raise NotFoundError(f"{path} does not exist")
    if kind == "table":
        listing = listing or list_table(path, lambda s: None)
        return [str(path), file_digest(path), files_fingerprint(listing.payloads(0))]
    if path.is_file():
        return [str(path), files_fingerprint([path])[0]]
    return [str(path), folder_fingerprint(path)]


def store_status(header: dict[str, Any], identify: Callable[[str, str], Any]) -> str:
    """current, superseded (source changed) or source gone, for a store's header."""
    kind, source = header.get("kind"), header.get("fingerprint_of", "")
    if header.get("cache_version") != CACHE_VERSION:
        return "superseded (older vitlab)"
    try:
        ident = identify(kind, source)
    except FileNotFoundError:
        return "source gone"
    except (OSError, ValueError):
        return "superseded (source unreadable)"
    if ident is None:
        return "current" if kind in ("digits", "arrays", None) else "source gone"
    return "current" if identity_digest(ident) == header.get("fingerprint") else "superseded (source changed)"


def _store_entry(path: Path, identify: Callable[[str, str], Any]) -> CacheEntry:
    try:
        header = json.loads((path / HEADER).read_text())
        status = store_status(header, identify) if isinstance(header, dict) else "unreadable"
        source = str(header.get("source", "")) if isinstance(header, dict) else ""
    except (OSError, ValueError):
        status, source = "unreadable", ""
    return CacheEntry(path, "store", disk_usage(path), source, status, status != "current")


def _entry(path: Path, identify: Callable[[str, str], Any]) -> CacheEntry | None:
    """What one thing at the top of the cache folder is; None for the build locks."""
    marker = owner_marker(path) if path.is_dir() and not path.is_symlink() else None
    kind = marker and marker["kind"]
    if kind == "store" and (path / HEADER).is_file():
        return _store_entry(path, identify)
    if kind == "store" and path.name.endswith(".partial"):
        return CacheEntry(path, "partial", disk_usage(path), status="unfinished build (resumes when run)")
    if kind == "features":
        return CacheEntry(path, "features", disk_usage(path), status="probe features (computed again when needed)")
    if kind == "download":
        return CacheEntry(path, "download", disk_usage(path), status="downloaded data set")
    if path.name.startswith(".") and path.name.endswith(".lock") and path.is_file():
        return None
    return CacheEntry(path, "other", disk_usage(path), status=NOT_OURS)


def cache_entries(cache_dir: str | os.PathLike | None = None,
                  identify: Callable[[str, str], Any] | None = None) -> list[CacheEntry]:
    """What the cache folder holds, with sizes on disk and, for stores, whether they are current."""
    identify = identify or source_identity
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if cache.exists() and not cache.is_dir():
        raise VitlabError(f"the data cache {cache} is a file, not a folder; accepted: a folder, new or the cache's "
                          "own (--cache-dir, else $VITLAB_CACHE)")
    entries = (_entry(path, identify) for path in (sorted(cache.iterdir()) if cache.is_dir() else []))
    return [e for e in entries if e is not None]


def _owns(entry: CacheEntry) -> Callable[[str], bool]:
    """Which files (paths relative to the entry's folder) of an entry vitlab wrote."""
    if entry.kind in ("store", "partial"):
        return owned_name(STORE_FILES.__contains__)
    if entry.kind == "features":
        return owned_name(lambda name: bool(FEATURES_FILE.fullmatch(name)))
    listed = set((owner_marker(entry.path) or {}).get("files", []))
    return listed.__contains__


def clean(cache_dir: str | os.PathLike | None = None, everything: bool = False, dry_run: bool = False,
          identify: Callable[[str, str], Any] | None = None) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """Remove superseded stores (with ``everything``: every store, unfinished build, download and the probe's
    features too), only the files vitlab wrote in them; returns (what was, or with ``dry_run`` would be, removed,
    each with the files of others it left, and what was left alone). A store being built is kept."""
    removed, kept = [], []
    entries = cache_entries(cache_dir, identify)
    for e in entries:
        if e.kind == "other" or not (e.removable or everything):
            kept.append(e)
        elif e.kind in ("store", "partial") and not _lock_free(e.path):
            kept.append(CacheEntry(e.path, e.kind, e.bytes, e.source, "being built: kept"))
        else:
            removed.append(e)
    if removed and not dry_run:
        _check_removable(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir())
    for e in removed:
        try:
            e.left = remove_owned(e.path, _owns(e), dry_run)
        except OSError as err:
            raise VitlabError(f"cannot clean the data cache: {e.path} cannot be removed ({err.strerror}); "
                              "nothing of it that vitlab did not write was touched") from None
    return removed, kept


def _check_removable(cache: Path) -> None:
    """One line when the cache folder takes no changes (a read-only file system, no permission)."""
    try:
        probe = cache / f".write-test.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        why = "a read-only file system" if e.errno == errno.EROFS else e.strerror or type(e).__name__
        raise VitlabError(f"cannot clean the data cache {cache} ({why}); nothing was removed") from None


def clean_cache(cache_dir: str | os.PathLike | None = None, everything: bool = False, dry_run: bool = False,
                identify: Callable[[str, str], Any] | None = None) -> list[CacheEntry]:
    """``clean``'s removed entries alone."""
    return clean(cache_dir, everything, dry_run, identify)[0]
