"""torchrun under faults: two nodes on one machine, an elastic restart after kill -9 that resumes by itself and ends
identical, processes racing for one --out; and the claim a restarted worker group takes on its own folder."""
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import TINY, comparable, metrics

from vitlab.runs import folder
from vitlab.runs.folder import LOCK, claim_folder, launch_id
from vitlab.runs.format import read_config, write_config
from vitlab.train import load_recipe, train

TIMEOUT = 150  # seconds a launch may take before the test gives up on it (each takes a fraction of that)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(*commands: list[str]):
    """Start the commands, each in its own process group (stdout and stderr together, as text); on leaving, kill
    whatever of them is still running, the processes they started included."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([str(a) for a in c], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True) for c in commands]
    try:
        yield procs
    finally:
        for p in procs:
            for pid in [p.pid, *descendants(p.pid)]:  # torchrun may start its workers in sessions of their own
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL) if pid == p.pid else os.kill(pid, signal.SIGKILL)
            p.wait()
            p.stdout.close()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc while they still run."""
    found, todo = [], [pid]
    while todo:
        with contextlib.suppress(OSError):
            children = [int(c) for c in Path(f"/proc/{todo[0]}/task/{todo[0]}/children").read_text().split()]
            found += children
            todo += children
        todo.pop(0)
    return found


def torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def finish(p: subprocess.Popen) -> str:
    """What the process wrote, once it has ended (killed, with what it wrote so far said, after TIMEOUT)."""
    try:
        return p.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"no end after {TIMEOUT} s:\n{p.communicate()[0][-3000:]}") from None


def train_args(cache_dir, out, *extra) -> list[str]:
    return ["-m", "vitlab", "train", *TINY, "--cache-dir", cache_dir, *extra, "--out", out]


def two_nodes(cache_dir, out, elsewhere) -> tuple[list[int], list[str]]:
    """Two 'machines' of one process each (torchrun --nnodes 2 on loopback) train for 2 epochs; node 1 is told
    another --out, which stands for a path its machine does not share. Returns their exit codes and logs."""
    node = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", free_port()]
    with launched(torchrun(*node, "--node-rank", "0", *train_args(cache_dir, out, "--epochs", "2")),
                  torchrun(*node, "--node-rank", "1", *train_args(cache_dir, elsewhere, "--epochs", "2"))) as procs:
        logs = [finish(p) for p in procs]
    return [p.returncode for p in procs], logs


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_in_sync(tmp_path, cache_dir):
    """Node 1's rank never touches --out (a second machine may not have it): it is given a path that must stay
    absent."""
    out, elsewhere = tmp_path / "run", tmp_path / "not-on-node-0"
    codes, logs = two_nodes(cache_dir, out, elsewhere)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["replicas_in_sync"] is True and summary["epochs"] == 2
    assert not elsewhere.exists()


@pytest.mark.slow
def test_a_refused_out_ends_every_rank(tmp_path, cache_dir):
    """Rank 0 refuses a finished run; rank 1, on the other 'machine', learns it and leaves too: none is left waiting."""
    out, elsewhere = tmp_path / "run", tmp_path / "not-on-node-0"
    train(load_recipe(None, **RECIPE, out=str(out)))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    codes, logs = two_nodes(cache_dir, out, elsewhere)
    assert 0 not in codes
    assert f"vitlab train: error: {out} holds a finished run" in logs[0], logs[0][-3000:]
    assert f"vitlab train: error: rank 0 could not claim --out {elsewhere}" in logs[1], logs[1][-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not elsewhere.exists()


def worker(agent: int, rank: int) -> int:
    """The pid of the worker of that rank among the torchrun agent's children."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        with contextlib.suppress(OSError):
            if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return int(child)
    raise AssertionError(f"no worker of rank {rank} under pid {agent}")


def elastic(cache_dir, out, port) -> list[str]:
    return torchrun("--max-restarts", "1", "--nproc-per-node", "2", "--master-port", port,
                    *train_args(cache_dir, out, "--epochs", "2"))


@pytest.mark.slow
def test_an_elastic_restart_after_kill_9_resumes_and_ends_identical(tmp_path, cache_dir):
    """Rank 1 is killed (SIGKILL) after the first epoch's checkpoint: the agent stops rank 0 (which holds the folder's
    lock), starts the group again, and the run resumes from the checkpoint by itself."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    with launched(elastic(cache_dir, whole, free_port())) as (p,):
        log = finish(p)
    assert p.returncode == 0, log[-3000:]
    with launched(elastic(cache_dir, killed, free_port())) as (p,):
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("epoch 1:"):
                deadline = time.monotonic() + 60
                while not (killed / "checkpoint.pt").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(worker(p.pid, 1), signal.SIGKILL)
                break
        log = "".join(lines) + finish(p)
    assert p.returncode == 0, log[-3000:]
    assert "restart 1 of the worker group: resuming this launch's run" in log, log[-3000:]
    resumed = [line for line in log.splitlines() if line.startswith(f"resuming {killed} after epoch ")]
    assert resumed == [f"resuming {killed} after epoch 1"], log[-3000:]
    assert comparable(metrics(killed)) == comparable(metrics(whole))
    assert (killed / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert json.loads((killed / "summary.json").read_text())["replicas_in_sync"] is True


@pytest.mark.slow
def test_two_processes_racing_for_one_out(tmp_path, cache_dir):
    """One wins and trains; the other exits 2 with one line; the folder holds the winner's run alone."""
    out = tmp_path / "run"
    vitlab = [sys.executable, "-m", "vitlab", "train", *TINY, "--cache-dir", cache_dir, "--epochs", "3", "--out", out]
    with launched([*vitlab, "--seed", "1"], [*vitlab, "--seed", "2"]) as procs:
        logs = [finish(p) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], logs
    winner, loser = codes.index(0), codes.index(2)
    err = logs[loser].strip()
    assert len(err.splitlines()) == 1 and "being written by another vitlab process" in err, err
    assert read_config(out)["seed"] == winner + 1 and len(metrics(out)) == 3
    assert not (out / LOCK).exists()  # the winner's, removed when it finished
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3


def test_a_refused_claim_leaves_the_holder_its_lock(tmp_path, monkeypatch):
    """A process that finds the lock held removes nothing, even a folder it made itself an instant earlier."""
    def held(fd, operation):
        raise BlockingIOError(errno.EWOULDBLOCK, "held")

    monkeypatch.setattr(folder.fcntl, "flock", held)
    with pytest.raises(ValueError, match="being written by another vitlab process"):
        with claim_folder(tmp_path / "new", "eval"):
            pass
    assert (tmp_path / "new" / LOCK).is_file()


RECIPE = dict(model="vit_micro_patch2_8", epochs=1, precision="fp32", threads=1, batch_size=64)


def as_torchrun(monkeypatch, run_id: str, restarts: int) -> None:
    """The environment torchrun gives a worker of a launch (without a process group: the run trains alone)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts))


def test_a_restart_before_the_first_checkpoint_starts_over(tmp_path, cache_dir, monkeypatch):
    fresh, out = tmp_path / "fresh", tmp_path / "run"
    train(load_recipe(None, **RECIPE, out=str(fresh)))
    as_torchrun(monkeypatch, "job", 1)
    write_config(out, load_recipe(None, **RECIPE, out=str(out)), "vit_micro_patch2_8")  # what the first attempt left
    (out / LOCK).write_text(f"train 1 {launch_id()}\n")
    lines = []
    train(load_recipe(None, **RECIPE, out=str(out)), log=lines.append)
    assert "restart 1 of the worker group: resuming this launch's run in " + str(out) in lines
    assert f"no checkpoint in {out} yet: starting the run from the beginning" in lines
    assert comparable(metrics(out)) == comparable(metrics(fresh))


def test_only_a_restart_of_the_same_launch_and_recipe_resumes(tmp_path, cache_dir, monkeypatch):
    out = tmp_path / "run"
    as_torchrun(monkeypatch, "job", 0)
    train(load_recipe(None, **RECIPE, out=str(out)))
    (out / "summary.json").unlink()  # as if killed before its end: an unfinished run with its checkpoint and lock
    (out / LOCK).write_text(f"train 1 {launch_id()}\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK}
    refusals = [("job", 0, {}), ("other-job", 1, {}), ("job", 1, {"lr": 0.5})]
    for run_id, restarts, change in refusals:  # a first attempt; another launch; another recipe
        as_torchrun(monkeypatch, run_id, restarts)
        with pytest.raises(ValueError, match="holds an unfinished run"):
            train(load_recipe(None, **{**RECIPE, **change}, out=str(out)))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    with pytest.raises(ValueError, match="holds an unfinished run"):  # no torchrun: --resume is needed
        train(load_recipe(None, **RECIPE, out=str(out)))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK} == before
    as_torchrun(monkeypatch, "job", 1)
    lines = []
    train(load_recipe(None, **RECIPE, out=str(out)), log=lines.append)
    assert f"resuming {out} after epoch 1" in lines and (out / "summary.json").is_file()
