"""Progress bars that suit where they are read: a live bar in a terminal, a line per interval in a log file."""
from __future__ import annotations

import io
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from tqdm import TqdmWarning, tqdm

LOG_INTERVAL = 30.0  # seconds between lines when the output is a file or a pipe


def _is_terminal(fp: Any) -> bool:
    try:
        return bool(fp.isatty())
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False


class _Lines:
    """Wraps a stream for a bar in line mode: drops the bare newlines and carriage returns tqdm adds."""

    def __init__(self, fp: Any):
        self.fp = fp

    def write(self, s: str) -> None:
        s = s.replace("\r", "")
        if s.strip():
            self.fp.write(s if s.endswith("\n") else s + "\n")

    def flush(self) -> None:
        getattr(self.fp, "flush", lambda: None)()


class Progress(tqdm):
    """tqdm, except that when the output is not a terminal each update is one whole line, at most one per
    ``mininterval`` (default 30 s), and the final state is printed once on close.

    A redirected log then reads ``name:  40%|####      | 400/1000 [00:20<00:30, 20.0 img/s]`` lines
    instead of thousands of carriage-return updates. ``clock`` (seconds, default ``time.time``) is what the
    elapsed time, the rate, the ETA and the interval between lines are measured with.
    """

    def __init__(self, *args: Any, file: Any = None, clock: Callable[[], float] | None = None, **kwargs: Any):
        self._clock = time.time if clock is None else clock
        file = sys.stderr if file is None else file
        self.lines = not _is_terminal(file)
        if self.lines:
            kwargs.setdefault("mininterval", LOG_INTERVAL)
            kwargs["dynamic_ncols"] = False
            kwargs.setdefault("ncols", 100)
            file = _Lines(file)
        self._line_t = -float("inf")
        self._line_n: float | None = None  # the count of the last line printed
        self._closing = False
        super().__init__(*args, file=file, **kwargs)

    @property
    def _time(self) -> Callable[[], float]:
        """tqdm's clock for elapsed time, rates and intervals: the one given."""
        return self._clock

    @_time.setter
    def _time(self, value: Callable[[], float]) -> None:
        """tqdm sets its clock to ``time.time`` while it starts; the one given stays."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self.lines:
            return super().display(msg, pos)
        if msg == "":  # a request to clear the bar: nothing to clear in a log
            return False
        if self._closing and msg is None and self.n == self._line_n:  # the final state is already the last line
            return True
        self.fp.write(self.__str__() if msg is None else msg)
        self._line_t, self._line_n = self._time(), self.n
        return True

    def close(self) -> None:
        self._closing = True
        super().close()

    def clear(self, nolock: bool = False) -> None:
        if not self.lines:
            super().clear(nolock)

    def refresh(self, nolock: bool = False, lock_args: Any = None) -> None:
        """Redraw; in line mode only once ``mininterval`` has passed since the last line."""
        if self.lines and self._time() - self._line_t < self.mininterval:
            return
        super().refresh(nolock=nolock, lock_args=lock_args)
        self.last_print_t = self._time()

    def goto(self, n: int) -> None:
        """Move the bar to ``n`` (e.g. seconds of a time budget), printing at most once per interval."""
        n = min(int(n), int(self.total)) if self.total is not None else int(n)
        if n > self.n:
            self.update(n - self.n)


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's shell under IPKernelApp), as tqdm.autonotebook tells."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """A progress bar (tqdm's arguments, and ``goto``): in a Jupyter notebook tqdm.auto's (a widget with ipywidgets,
    else a line redrawn in place); elsewhere on stderr, live in a terminal, a line per interval in a log."""
    if not in_notebook():
        return Progress(*args, **kwargs)
    with warnings.catch_warnings():  # without ipywidgets tqdm.auto is the plain bar, which a notebook redraws in place
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm as auto

    class NotebookProgress(auto):
        goto = Progress.goto

    kwargs.pop("clock", None)
    kwargs.pop("file", None)
    return NotebookProgress(*args, **kwargs)


def log_line(message: str) -> None:
    """Print a message on stderr without breaking a live progress bar."""
    tqdm.write(message, file=sys.stderr)
