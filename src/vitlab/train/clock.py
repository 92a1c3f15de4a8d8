"""Where a run stands: a share of its steps, or of its time budget measured by rank 0 alone."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .distributed import Dist, broadcast_value

RESERVE_CAP = 0.5  # the largest share of a time budget kept back for the end of the run
RESERVE_MARGIN = 1.25  # the end's evaluation is kept back at its measured time times this, plus 3 s


class RunClock:
    """Progress through the schedule, in [0, 1] and beyond when the run is over.

    With a time budget the clock counts training time from the first step (not data decoding or
    set-up, so a cold and a warm data cache follow the same schedule), plus ``seconds`` from earlier
    sessions of a resumed run. Only rank 0 reads its clock; the other ranks take its value, so every
    replica uses the same learning rate and input size and stops after the same step.

    ``now`` is the time source in seconds (``time.perf_counter``; a test passes a fake one).
    """

    def __init__(self, dist: Dist, total_steps: int, budget_seconds: float | None = None, seconds: float = 0.0,
                 reserve: float = 0.0, now: Callable[[], float] = time.perf_counter):
        self.dist, self.total_steps, self.budget = dist, total_steps, budget_seconds
        self.before, self.reserve = seconds, reserve
        self.now = now
        self.t0: float | None = None

    def start(self) -> None:
        """Start counting (call right before the first step of this session)."""
        if self.t0 is None:
            self.t0 = self.now()

    def seconds(self) -> float:
        """Training seconds so far (this rank's clock; rank 0's is the one that counts)."""
        return self.before + (self.now() - self.t0 if self.t0 is not None else 0.0)

    @contextmanager
    def paused(self, pause: bool = True) -> Iterator[None]:
        """With ``pause``, what runs inside is not counted (the evaluations of a budget that counts training only)."""
        t = self.now()
        try:
            yield
        finally:
            if pause and self.t0 is not None:
                self.t0 += self.now() - t

    def progress(self, step: int) -> float:
        """The share of the schedule done after ``step`` steps; the same value on every rank."""
        if self.budget is None:
            return step / self.total_steps
        return broadcast_value(self.seconds() / max(self.budget - self.reserve, 1e-9), self.dist)

    def keep_back(self, seconds: float) -> bool:
        """Reserve enough of the budget for an end of the run (final evaluation, saving) measured or estimated at
        ``seconds``: RESERVE_MARGIN times that plus 3 s, never less than already reserved, and never more than half
        the budget (an estimate taken on a busy machine can exceed the whole budget: the run then trains for half of
        it and its end may run late, rather than never train). Returns whether that cap held the reserve back."""
        wanted = max(self.reserve, RESERVE_MARGIN * seconds + 3.0)
        cap = self.budget * RESERVE_CAP if self.budget is not None else wanted
        self.reserve = min(wanted, max(cap, self.reserve))
        return wanted > self.reserve
