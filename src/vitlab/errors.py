"""vitlab's own error types. A refusal of what the user gave (an option, a file, an array, a set-up) raises
`VitlabError` with one line that names the problem and what is accepted; the command line prints that line and
exits 2. Any other exception is a fault in vitlab or beneath it and keeps its traceback."""
from __future__ import annotations

import errno
import os
import stat


class VitlabError(ValueError):
    """A refusal of the user's input: the message says what was wrong, with the value, and what is accepted.

    A ValueError, so callers' ``except ValueError`` still catches it."""


class NotFoundError(VitlabError, FileNotFoundError):
    """A refusal of a path, folder or Hub id that names nothing vitlab can read (also a FileNotFoundError)."""


def not_a_file(path: str | os.PathLike, what: str = "", accepted: str = "a file, or a link to one") -> VitlabError:
    """The refusal of a ``path`` that is not a readable file, saying why: a symlink loop, a link to nothing, a
    folder, or nothing there (``is_file`` and ``exists`` call all of these missing)."""
    name = f"{what} {path}" if what else str(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return VitlabError(f"{name} is a symlink loop (it leads back to itself); accepted: {accepted}")
        if os.path.islink(path):
            return NotFoundError(f"{name} is a symlink to {os.readlink(path)}, which does not exist; accepted: "
                                 f"{accepted}")
        return NotFoundError(f"{name} does not exist; accepted: {accepted}")
    kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
    return VitlabError(f"{name} is {kind}; accepted: {accepted}")
