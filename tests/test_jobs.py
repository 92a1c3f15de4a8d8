"""The scheduler of child runs (runs/jobs.py): finished runs skipped, unfinished ones resumed, N at a time in order
of their needs, every child stopped when the scheduler is."""
import subprocess
import sys

import pytest

from vitlab.runs.jobs import Job, failure_reason, run_jobs


class Child:
    """A child that ends after ``steps`` looks (``poll`` calls), with ``code``, and then calls ``then`` (writes its
    run folder's summary, say); or never, until stopped."""

    def __init__(self, cmd, steps=1, code=0, never=False, then=None):
        self.cmd, self.steps, self.code, self.never, self.then = cmd, steps, code, never, then
        self.returncode, self.terminated = None, False

    def poll(self):
        if self.returncode is None and not self.never:
            self.steps -= 1
            if self.steps <= 0:
                self.returncode = self.code
                if self.then is not None:
                    self.then()
        return self.returncode

    def terminate(self):
        self.terminated, self.returncode = True, -15

    def wait(self, timeout=None):
        return self.returncode


def finished(folder):
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{}")


def scheduler(children=None):
    """start: records each command and its child; the children of names in ``children`` take those options."""
    started = []

    def start(cmd, **kw):
        started.append(Child(cmd, **(children or {}).get(cmd[0], {})))
        return started[-1]
    return started, start


def test_finished_runs_are_skipped_unfinished_ones_resumed_and_new_ones_started(tmp_path):
    finished(tmp_path / "done")
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "checkpoint.pt").write_bytes(b"")
    jobs = [Job(name, tmp_path / name, [name], resume=[name, "--resume"]) for name in ("done", "stopped", "new")]
    started, start = scheduler()
    said, done = [], []
    assert run_jobs(jobs, 2, said.append, done=lambda job: done.append(job.name), start=start,
                    wait=lambda s: None) == []
    assert [c.cmd for c in started] == [["stopped", "--resume"], ["new"]]
    assert said[0] == f"done: finished already in {tmp_path / 'done'}, kept"
    assert said[1].startswith(f"training stopped -> {tmp_path / 'stopped'} (resumed): stopped --resume")
    assert said[2] == f"training new -> {tmp_path / 'new'}: new"
    assert sorted(done) == ["done", "new", "stopped"]  # each job once, skipped or ended


def test_at_most_n_run_at_once_and_a_job_waits_for_the_run_it_needs(tmp_path):
    teacher = tmp_path / "teacher"
    jobs = [Job("student", tmp_path / "student", ["student"], needs=(teacher,)),
            Job("teacher", teacher, ["teacher"]), Job("a", tmp_path / "a", ["a"]), Job("b", tmp_path / "b", ["b"])]
    started, start = scheduler({"teacher": {"steps": 2, "then": lambda: finished(teacher)}, "a": {"steps": 3},
                                "b": {"steps": 3}})
    most = []

    def wait(seconds):
        most.append(sum(c.returncode is None for c in started))
    assert run_jobs(jobs, 2, lambda s: None, start=start, wait=wait) == []
    assert [c.cmd[0] for c in started] == ["teacher", "a", "student", "b"]  # the student after its teacher
    assert max(most) == 2


def test_failures_are_named_by_their_own_error_line_and_what_waited_on_them_is_given_up(tmp_path):
    log = tmp_path / "teacher.log"
    log.write_text("epoch 1: loss 0.5\nvitlab train: error: an earlier start's reason\n")

    def fail():  # the child's own lines, after the scheduler's line for this start
        with open(log, "a") as f:
            f.write("epoch 9: loss 0.3\nvitlab train: error: no data\nepoch 10: loss 0.29\n")
    jobs = [Job("teacher", tmp_path / "teacher", ["teacher", "--out"], log=log),
            Job("student", tmp_path / "student", ["student"], needs=(tmp_path / "teacher",))]
    started, start = scheduler({"teacher": {"code": 1, "then": fail}})
    released = []
    failed = run_jobs(jobs, 2, lambda s: None, release=lambda job: released.append(job.name), start=start,
                      wait=lambda s: None)
    assert failed == [f"teacher (exit 1: vitlab train: error: no data; log {log})",
                      "student (not trained: the run it starts from did not finish)"]
    assert released == ["teacher"] and [c.cmd for c in started] == [["teacher", "--out"]]
    assert "=== teacher --out\n" in log.read_text()  # each start marked in the log, with its command
    assert failure_reason(tmp_path / "none.log") == "no output"


def test_a_job_its_claim_refuses_is_not_started(tmp_path):
    started, start = scheduler()
    jobs = [Job(name, tmp_path / name, [name]) for name in ("mine", "theirs")]
    assert run_jobs(jobs, 1, lambda s: None, claim=lambda job: job.name == "mine", start=start,
                    wait=lambda s: None) == []
    assert [c.cmd for c in started] == [["mine"]]


def test_stopped_the_scheduler_stops_every_child_it_started_and_releases_them(tmp_path):
    started, start = scheduler({name: {"never": True} for name in "abc"})
    released = []

    def ctrl_c(seconds):
        raise KeyboardInterrupt
    jobs = [Job(name, tmp_path / name, [name]) for name in "abc"]
    with pytest.raises(KeyboardInterrupt):
        run_jobs(jobs, 2, lambda s: None, release=lambda job: released.append(job.name), start=start, wait=ctrl_c,
                 stop_wait=0.1)
    assert [c.cmd for c in started] == [["a"], ["b"]]  # the third never started
    assert all(c.terminated for c in started) and released == ["a", "b"]


@pytest.mark.slow
def test_real_children_are_stopped_by_sigterm_and_their_logs_closed(tmp_path):
    sleeper = [sys.executable, "-c", "import time; print('training', flush=True); time.sleep(60)"]
    jobs = [Job(name, tmp_path / name, sleeper, log=tmp_path / f"{name}.log") for name in "ab"]
    looks = []

    def stop_after_a_while(seconds):
        looks.append(seconds)
        if len(looks) == 4:
            raise KeyboardInterrupt
    procs = []

    def start(cmd, **kw):
        procs.append(subprocess.Popen(cmd, **kw))
        return procs[-1]
    with pytest.raises(KeyboardInterrupt):
        run_jobs(jobs, 2, lambda s: None, start=start, wait=stop_after_a_while)
    assert [p.returncode for p in procs] == [-15, -15]
