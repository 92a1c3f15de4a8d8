"""Disk space and writability of the data cache, and byte counts as people read them."""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from ..errors import VitlabError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def free_bytes(folder: Path) -> int | None:
    """Bytes free to this user in the file system of ``folder`` (or of its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def disk_usage(path: Path) -> int:
    """Bytes a file or folder occupies on disk (allocated blocks; symlinks not followed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not os.path.isdir(path) or os.path.islink(path):
        return st.st_blocks * 512
    total = st.st_blocks * 512
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _unit(n: float) -> tuple[str, int]:
    for name, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << power:
            return name, power
    return "bytes", 0


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals."""
    name, power = _unit(n)
    return f"{n} bytes" if power == 0 else f"{n / (1 << power):.2f} {name}"


def format_sizes(a: int, b: int) -> tuple[str, str]:
    """Two byte counts, each in its own unit or, where they would read alike, in one unit with as many decimals
    as it takes for different counts to read differently."""
    sa, sb = format_size(a), format_size(b)
    if sa != sb or a == b:
        return sa, sb
    name, power = _unit(max(a, b))
    for decimals in range(2, 10):
        sa, sb = (f"{v / (1 << power):.{decimals}f} {name}" for v in (a, b))
        if sa != sb or a == b:
            return sa, sb
    return f"{a} bytes", f"{b} bytes"


def check_writable(cache: Path) -> None:
    """Make the cache folder, or say in one line why it cannot be written."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / f".write-test.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        why = "a read-only file system" if e.errno == errno.EROFS else e.strerror or type(e).__name__
        raise VitlabError(f"cannot write the data cache {cache} ({why}); set VITLAB_CACHE or --cache-dir to a "
                          "writable folder") from None


def space_message(problem: str, what: str, cache: Path, need: int, free: int | None = None) -> str:
    """'<problem>: <what> needs X in <cache>, which has Y free; ...' with X and Y told apart."""
    sneed, sfree = format_sizes(need, free_bytes(cache) or 0 if free is None else free)
    return (f"{problem}: {what} needs {sneed} in {cache}, which has {sfree} free; free some space or choose "
            "another cache folder (VITLAB_CACHE, --cache-dir)")
