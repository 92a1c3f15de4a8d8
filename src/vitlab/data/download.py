"""Downloads through a temp file with checksums, and safe reading of tar archives.

Archives are read member by member and refused if any member has an absolute path, a ``..``
component, or is a link or special file.
"""
from __future__ import annotations

import hashlib
import os
import re
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..atomic import atomic_path, locked_temp_folder, remove_stale_temps
from ..errors import VitlabError
from ..progress import progress_bar

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")

Log = Callable[[str], None]


def download_url(url: str, dest: str | os.PathLike, md5: str | None = None, sha256: str | None = None,
                 log: Log = print) -> Path:
    """Download ``url`` (http(s) or file://) to ``dest`` through a temp file, check its checksum, rename it in."""
    dest = Path(dest)
    hashes = {"md5": hashlib.md5(usedforsecurity=False), "sha256": hashlib.sha256()}
    with atomic_path(dest) as tmp, open(tmp, "wb") as out:
        try:
            response = urllib.request.urlopen(url, timeout=60)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise OSError(f"could not download {url}: {getattr(e, 'reason', e)}") from None
        with response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with progress_bar(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                              desc=f"downloading {dest.name}") as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    for h in hashes.values():
                        h.update(chunk)
                    bar.update(len(chunk))
        out.flush()
        for algo, expected in (("md5", md5), ("sha256", sha256)):
            got = hashes[algo].hexdigest()
            if expected is not None and got != expected.lower():
                raise VitlabError(f"checksum mismatch for {url}: {algo} is {got}, expected {expected}; "
                                  "the download was deleted (try again, or fetch the file by hand)")
    log(f"downloaded {url} to {dest} ({dest.stat().st_size / 2**20:.1f} MiB)")
    return dest


def member_parts(name: str) -> tuple[str, ...]:
    """An archive member's path as its parts, without empty and '.' parts."""
    return tuple(p for p in name.replace("\\", "/").split("/") if p not in ("", "."))


def check_member(member: tarfile.TarInfo, archive: Path) -> None:
    """Raise unless the archive member is a plain file or folder with a relative path inside the archive."""
    name = member.name
    problem = None
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        problem = "has an absolute path"
    elif ".." in member_parts(name):
        problem = "has a '..' component that points outside the archive"
    elif member.issym() or member.islnk():
        problem = f"is a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r})"
    elif not (member.isfile() or member.isdir()):
        problem = "is a device, FIFO or other special file"
    if problem:
        raise VitlabError(f"refusing to read {archive}: member {name!r} {problem}; "
                          "vitlab reads only plain files and folders with relative paths from archives")


def is_archive(path: Path) -> bool:
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def archive_stem(path: Path) -> str:
    lower = path.name.lower()
    for suffix in ARCHIVE_SUFFIXES:
        if lower.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def safe_extract(archive: Path, dest: Path, folder: str) -> Path:
    """Extract ``folder/`` from a checked archive into ``dest``, all or nothing."""
    try:
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            for m in members:
                check_member(m, archive)
            wanted = [m for m in members if member_parts(m.name)[:1] == (folder,)]
            if not wanted:
                raise VitlabError(f"{archive} holds no {folder}/ folder")
            remove_stale_temps(dest, folder)
            with locked_temp_folder(dest, folder) as tmp:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(tmp, members=wanted, filter="data")
                else:  # pragma: no cover - Python without extraction filters; members were checked above
                    tf.extractall(tmp, members=wanted)
                os.replace(tmp / folder, dest / folder)
    except (tarfile.TarError, EOFError) as e:
        raise VitlabError(f"{archive} is not a readable tar archive ({e})") from None
    return dest / folder


