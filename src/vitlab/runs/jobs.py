"""Child runs, N at a time: each job a command that writes one run folder.

A job whose folder holds a finished run is skipped; one whose folder holds a checkpoint (a run stopped before its
end) continues from it (its ``resume`` command); a job waits until the run folders it needs (a teacher, the run it
starts from) are finished, and is given up when they can no longer be. Stopped (Ctrl-C, SIGTERM, an error), the
scheduler stops every child it started (SIGTERM: each stops as on Ctrl-C, its folder whole; SIGKILL for one still
there after a while), so that none goes on writing its folder and taking the cores of what runs next; killed with
-9, it leaves its children their parent's death as their SIGTERM (Linux).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .format import CHECKPOINT, is_finished


@dataclass
class Job:
    """One child run."""

    name: str
    folder: Path                       # the run folder its command writes
    command: list[str]                 # the command that trains it from the start
    resume: list[str] | None = None    # the command that continues it from its checkpoint (None: ``command``)
    needs: tuple[Path, ...] = ()       # run folders that must be finished before it starts
    log: Path | None = None            # where the child's output goes (None: this process's own)


@dataclass
class Running:
    job: Job
    proc: Any                          # a subprocess.Popen (or what ``start`` returns: poll, terminate, wait, kill)
    handle: IO | None                  # the child's log, open
    started: float = field(default_factory=time.monotonic)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def dies_with(parent: int) -> Callable[[], None] | None:
    """Popen's preexec_fn on Linux: the child gets SIGTERM when ``parent`` (the scheduler) ends, even by kill -9, and
    stops as on Ctrl-C, its run folder whole; no run trains on unsupervised. None elsewhere."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        prctl = None
    if prctl is None:
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the scheduler ended before the line above
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


ATTEMPT = "=== "  # the line the scheduler writes in a job's log before each start of it (with its command)


def failure_reason(logfile: Path) -> str:
    """Why the last start of a run failed, from its log: the command's own one-line error (a run whose log holds
    other lines after it, e.g. those of a run it found already training, still names its reason), else the last
    line."""
    lines = logfile.read_text(errors="replace").splitlines() if logfile.is_file() else []
    starts = [i for i, line in enumerate(lines) if line.startswith(ATTEMPT)]
    lines = [line.strip() for line in lines[starts[-1] + 1 if starts else 0:] if line.strip()]
    said = [line for line in lines if line.startswith("vitlab ")]
    return (said or lines or ["no output"])[-1]


def command_of(job: Job) -> list[str]:
    """The job's command as its folder now stands: ``resume`` where a checkpoint is there to continue from."""
    return job.resume if job.resume is not None and (Path(job.folder) / CHECKPOINT).is_file() else job.command


def ready(job: Job) -> bool:
    return all(is_finished(p) for p in job.needs)


def run_jobs(jobs: Sequence[Job], parallel: int, say: Callable[[str], None] = print, *,
             claim: Callable[[Job], bool] = lambda job: True, release: Callable[[Job], None] = lambda job: None,
             done: Callable[[Job], None] = lambda job: None, start: Callable | None = None,
             wait: Callable[[float], None] = time.sleep, stop_wait: float = 60.0) -> list[str]:
    """Run the jobs, ``parallel`` at a time, in their order as far as their needs allow; returns the failures, one
    line each. ``claim(job)`` is asked before a job starts (False: skip it, e.g. another process finished it) and
    ``release(job)`` called once its child has ended; ``done(job)`` is called for every job skipped or ended.
    ``start`` (default ``subprocess.Popen``) starts a command; ``wait`` sleeps between looks at the children."""
    pending, running, failed = list(jobs), [], []
    try:
        while pending or running:
            start_ready(pending, running, parallel, say, claim, done, start)
            wait(0.5)
            failed += reap(running, say, release, done)
            if pending and not running and not any(ready(j) for j in pending):  # what they need did not finish
                failed += [f"{j.name} (not trained: the run it starts from did not finish)" for j in pending]
                pending.clear()
    finally:
        stop(running, say, release, stop_wait)
    return failed


def start_ready(pending: list[Job], running: list[Running], parallel: int, say: Callable[[str], None],
                claim: Callable[[Job], bool], done: Callable[[Job], None], start: Callable | None) -> None:
    """Start pending jobs whose needs are finished until ``parallel`` run; skip those already finished."""
    while len(running) < parallel and (job := next((j for j in pending if ready(j)), None)) is not None:
        pending.remove(job)
        if is_finished(job.folder):
            say(f"{job.name}: finished already in {job.folder}, kept")
            done(job)
            continue
        Path(job.folder).parent.mkdir(parents=True, exist_ok=True)
        if not claim(job):
            done(job)
            continue
        cmd = command_of(job)
        handle = open(job.log, "a") if job.log is not None else None  # noqa: SIM115 (closed when the child ends)
        out = {} if handle is None else {"stdout": handle, "stderr": subprocess.STDOUT,
                                         "env": {**os.environ, "PYTHONUNBUFFERED": "1"}}
        if handle is not None:
            handle.write(f"{ATTEMPT}{' '.join(map(str, cmd))}\n")
            handle.flush()
        proc = (start or subprocess.Popen)(cmd, **out, preexec_fn=dies_with(os.getpid()))
        running.append(Running(job, proc, handle))
        say(f"training {job.name} -> {job.folder}" + (" (resumed)" if cmd is not job.command else "")
            + (f" (log: {job.log})" if job.log is not None else f": {' '.join(map(str, cmd))}"))


def reap(running: list[Running], say: Callable[[str], None], release: Callable[[Job], None],
         done: Callable[[Job], None]) -> list[str]:
    """Take the ended children off ``running``; returns a line for each that failed."""
    failed = []
    for item in [r for r in running if r.proc.poll() is not None]:
        running.remove(item)
        job, code = item.job, item.proc.returncode
        if item.handle is not None:
            item.handle.close()
        release(job)
        done(job)
        say(f"{job.name}: exit {code}, {(time.monotonic() - item.started) / 60:.1f} min of wall time")
        if code != 0:
            failed.append(f"{job.name} (exit {code}"
                          + (f": {failure_reason(job.log)}; log {job.log})" if job.log is not None else ")"))
    return failed


def stop(running: list[Running], say: Callable[[str], None], release: Callable[[Job], None],
         wait: float = 60.0) -> None:
    """Stop the children still running: a moment to stop on their own (after Ctrl-C at a terminal they have their own
    SIGINT), then SIGTERM, then SIGKILL for any still there after ``wait`` seconds; their logs are closed and their
    claims released."""
    deadline = time.monotonic() + min(wait, 2.0)
    while any(r.proc.poll() is None for r in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped = [r for r in running if r.proc.poll() is None]
    for r in stopped:
        r.proc.terminate()
    for r in running:
        try:
            r.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
        if r.handle is not None:
            r.handle.close()
        release(r.job)
    running.clear()
    for r in stopped:  # said once every child is stopped (saying may raise: an interrupt arriving meanwhile)
        say(f"{r.job.name}: stopped")
