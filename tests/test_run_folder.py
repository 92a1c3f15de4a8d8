"""A run folder's files tell one story: every write leaves the old file or the new; a resume finds the checkpoint,
the recipe, the metrics and the data to be the run's own, or says in one line what disagrees; a folder deleted
under a run stops it."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from conftest import checksums, error_line, run_cli
from PIL import Image

import vitlab
from vitlab import atomic
from vitlab.atomic import DiskFullError
from vitlab.cli import main
from vitlab.runs import folder
from vitlab.runs.figures import plot_confusion, plot_curves
from vitlab.runs.folder import LOCK, FolderGone, claim_folder
from vitlab.runs.format import (
    EpochRow,
    EvalSummary,
    read_history,
    read_summary,
    write_config,
    write_metrics,
    write_summary,
)
from vitlab.runs.identity import new_identity, write_identity
from vitlab.train import load_recipe, train
from vitlab.train.schedule import Plateau
from vitlab.train.state import TrainState, save_checkpoint

TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]
SHORT = [*TINY, "--train-fraction", "0.1"]  # three steps an epoch: a run's writes are the same at any size
VALUES = ("epoch", "step", "train_loss", "train_acc", "lr", "test_loss", "test_top1", "test_top5", "ema_test_top1")


def values(folder) -> list[dict]:
    """The metrics rows' values that an interrupted run must reproduce (timings aside)."""
    return [{k: getattr(r, k) for k in VALUES} for r in read_history(folder)]


def whole_files(out, killed: bool = False) -> None:
    """Every file a run folder holds is whole: what it is, read back without error. ``killed``: the folder of a
    process killed midway may also hold the temporary file of the write it was killed in, which no process holds
    and so is debris to remove (its file is the old whole one, or none)."""
    for p in out.iterdir():
        if killed and atomic.TEMP_PATTERN.fullmatch(p.name):
            assert atomic.is_stale_temp(p, older_than=0), p
            continue
        if p.name == "config.yaml":
            assert isinstance(yaml.safe_load(p.read_text()), dict) and yaml.safe_load(p.read_text())
        elif p.suffix in (".json", ".jsonl"):
            for line in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
                json.loads(line)
        elif p.suffix == ".png":
            Image.open(p).load()
        elif p.suffix == ".pt":
            torch.load(p, weights_only=True)
        elif p.suffix == ".safetensors":
            vitlab.checkpoint.read_weights(out)
        assert not p.name.endswith(".tmp"), p


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 2-epoch run never stopped, with and without an EMA copy."""
    runs = {}
    with pytest.MonkeyPatch.context() as m:
        m.setenv("VITLAB_CACHE", str(tmp_path_factory.mktemp("cache")))
        for ema in ("0", "0.9"):
            out = tmp_path_factory.mktemp("whole") / "run"
            assert main(["train", *SHORT, "--epochs", "2", "--ema-decay", ema, "--out", str(out)]) == 0
            runs[ema] = out
    return runs


@pytest.mark.slow
def test_a_disk_filling_at_any_write_leaves_whole_files_and_the_run_finishes_as_if_never_stopped(
        uninterrupted, tmp_path, capsys, monkeypatch):
    """Every write of a run, in turn, fails with a full disk: the command stops in one line, every file left is
    whole (the old one or the new), and running again (--resume once a checkpoint is there) ends where the run never
    stopped ends."""
    real_fsync, k = os.fsync, 0
    while True:
        k += 1
        out, calls = tmp_path / f"run{k}", [0]

        def fsync(fd, k=k, calls=calls):
            calls[0] += 1
            if calls[0] == k:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)

        monkeypatch.setattr(atomic.os, "fsync", fsync)
        fresh = ["train", *SHORT, "--epochs", "2", "--ema-decay", "0", "--out", out]
        code, err, _ = run_cli(capsys, fresh)
        monkeypatch.setattr(atomic.os, "fsync", real_fsync)
        if code == 0:
            break  # every write has had its fault
        assert code == 2 and "disk full" in err.splitlines()[-1], err
        if out.exists():
            whole_files(out)
        again = ["--resume", out] if (out / "checkpoint.pt").exists() else fresh[1:]
        code, err, _ = run_cli(capsys, ["train", *again])
        assert code == 0, err
        assert values(out) == values(uninterrupted["0"]), k
        assert read_summary(out).top1 == read_summary(uninterrupted["0"]).top1
        assert not (out / LOCK).exists()
    assert k > 10  # config, run.json, checkpoints, metrics, the model and its config, figures, summary


ROW = EpochRow(epoch=1, step=3, train_loss=2.0, train_acc=0.5, lr=0.1, images_per_second=10.0, test_loss=1.0,
               test_top1=0.5)
WRITERS = {  # every writer of a run folder's files, each writing its file once more
    "config.yaml": lambda out: write_config(out, load_recipe(None, lr=0.5), "vit_micro_patch2_8"),
    "run.json": lambda out: write_identity(out, new_identity(None)),
    "metrics.jsonl": lambda out: write_metrics(out, [ROW, ROW]),
    "summary.json": lambda out: write_summary(out, EvalSummary("m", "digits", False, {}, 0.5, 0.9, {})),
    "curves.png": lambda out: plot_curves([ROW], out / "curves.png"),
    "confusion.png": lambda out: plot_confusion([[1, 0], [0, 1]], ["a", "b"], out / "confusion.png"),
    "checkpoint.pt": lambda out: save_checkpoint(
        out, TrainState(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()), Plateau(0, 1))),
    "model.safetensors": lambda out: vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=2), out),
}


@pytest.mark.parametrize("fault", ["fsync", "replace"])
@pytest.mark.parametrize("name", WRITERS)
def test_a_run_folder_file_written_onto_a_full_disk_keeps_the_old_one(name, fault, tmp_path, monkeypatch):
    """The new content is flushed to a file beside the old one and renamed onto it: a full disk (or a crash) at any
    moment of the write leaves the old file whole, and no debris."""
    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_bytes(b"the previous file")

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, fault, full)
    with pytest.raises((DiskFullError, OSError)) as e:
        WRITERS[name](out)
    assert "disk full" in str(e.value) or e.value.errno == errno.ENOSPC
    assert (out / name).read_bytes() == b"the previous file"
    assert [p.name for p in out.iterdir()] == [name]


def test_the_lock_is_written_in_one_piece(tmp_path, monkeypatch):
    """The lock's text is one write of a fixed length over the old text: never an empty or a half-old file."""
    writes, truncations = [], []
    real_pwrite, real_ftruncate = os.pwrite, os.ftruncate
    monkeypatch.setattr(folder.os, "pwrite", lambda fd, data, at: writes.append(len(data)) or real_pwrite(fd, data, at))
    monkeypatch.setattr(folder.os, "ftruncate", lambda fd, n: truncations.append(n) or real_ftruncate(fd, n))
    with claim_folder(tmp_path / "ev", "eval"):
        assert (tmp_path / "ev" / LOCK).read_text().split()[0] == "eval"
    assert writes == [folder.LOCK_BYTES] and truncations == [folder.LOCK_BYTES]


@pytest.mark.parametrize("ema", ["0", "0.9"])
def test_killed_between_the_last_checkpoint_and_its_metrics_row_resumes_to_the_whole_history(
        ema, uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted[ema], out)
    for name in ("summary.json", "model.safetensors", "config.json", "curves.png", "confusion.png"):
        (out / name).unlink()
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:-1]))  # the last row was never written
    code, err, _ = run_cli(capsys, ["train", "--resume", out])
    assert code == 0, err
    assert "metrics.jsonl had 1 of the 2 epochs in the checkpoint" in err
    assert values(out) == values(uninterrupted[ema]) and read_summary(out).epochs == 2
    assert read_summary(out).ema == read_summary(uninterrupted[ema]).ema


def unfinished(uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted["0"], out)
    (out / "summary.json").unlink()  # as if killed in its final save
    return out


@pytest.mark.parametrize("damage, said", [
    (lambda out: (out / "config.yaml").write_text((out / "config.yaml").read_text().replace("lr: 0.005", "lr: 0.5")),
     "lr 0.005 -> 0.5"),
    (lambda out: (out / "config.yaml").write_text(""), "holds no recipe (it is empty)"),
    (lambda out: (out / "config.yaml").write_text("- a\n- b\n"), "holds no recipe (list)"),
    (lambda out: (out / "config.yaml").write_text("lr: [\n"), "is not valid YAML"),
    (lambda out: (out / "run.json").unlink(), "has a checkpoint.pt but no run.json"),
    (lambda out: (out / "metrics.jsonl").write_text('{"epoch": 7}\n'), "metrics.jsonl disagrees with the history"),
], ids=["lr", "emptied", "list", "not-yaml", "no-run-json", "metrics"])
def test_a_resume_of_a_folder_whose_files_disagree_is_refused(damage, said, uninterrupted, tmp_path, capsys):
    out = unfinished(uninterrupted, tmp_path)
    damage(out)
    before = checksums(out)
    err = error_line(capsys, ["train", "--resume", out])
    assert said in err
    assert checksums(out) == before


def test_another_runs_checkpoint_is_refused(uninterrupted, tmp_path, capsys):
    out = unfinished(uninterrupted, tmp_path)
    other = tmp_path / "other"
    assert main(["train", *SHORT, "--epochs", "2", "--out", str(other)]) == 0  # the same recipe, another run
    shutil.copy(other / "checkpoint.pt", out / "checkpoint.pt")
    before, _ = checksums(out), capsys.readouterr()
    err = error_line(capsys, ["train", "--resume", out])
    assert "checkpoint.pt belongs to another run" in err
    assert checksums(out) == before


def test_a_moved_run_folder_resumes(uninterrupted, tmp_path, capsys):
    out = unfinished(uninterrupted, tmp_path)
    code, err, _ = run_cli(capsys, ["train", "--resume", out])
    assert code == 0, err
    assert values(out) == values(uninterrupted["0"])


def test_resuming_with_another_thread_count_says_the_numbers_will_differ(uninterrupted, tmp_path, one_thread):
    out = unfinished(uninterrupted, tmp_path)
    lines = []
    train(load_recipe(out / "config.yaml", out=str(out), threads=2), resume=True, log=lines.append)
    assert any(line.startswith("warning: the run trained with 1 threads and resumes with 2") for line in lines)
    lines.clear()
    (out / "summary.json").unlink()
    train(load_recipe(out / "config.yaml", out=str(out), threads=1), resume=True, log=lines.append)  # the run's own
    assert not any("threads and resumes" in line for line in lines)


def test_a_resume_without_threads_goes_on_with_the_runs_own_count(uninterrupted, tmp_path, monkeypatch):
    out = unfinished(uninterrupted, tmp_path)  # trained with --threads 1
    config = yaml.safe_load((out / "config.yaml").read_text())
    (out / "config.yaml").write_text(yaml.safe_dump({**config, "threads": None}))  # as a run of the default count
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads, lines = torch.get_num_threads(), []
    torch.set_num_threads(2)
    try:
        train(load_recipe(out / "config.yaml", out=str(out)), resume=True, log=lines.append)
    finally:
        torch.set_num_threads(threads)
    assert "threads: 1, as the run trained with (run.json)" in lines
    assert not any("threads and resumes" in line for line in lines)
    assert values(out) == values(uninterrupted["0"])


def image_folder(root, per_class, start=0):
    rng = np.random.default_rng(start)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(start, start + per_class):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / c / f"{i}.png")


def test_data_that_changed_under_a_run_is_refused_by_resume_eval_inspect_and_probe(tmp_path, cache_dir, capsys):
    data, out = tmp_path / "data", tmp_path / "run"
    image_folder(data, 10)
    assert main(["train", *TINY, "--epochs", "1", "--data", str(data), "--out", str(out)]) == 0
    assert main(["eval", str(out)]) == 0  # the data as it was
    os.utime(data / "a" / "0.png", (1, 1))  # touched: the same files, split the same way
    assert main(["eval", str(out)]) == 0
    capsys.readouterr()
    image_folder(data, 4, start=10)  # images added since
    for argv in (["eval", out], ["inspect", out, "--num-images", "2", "--distance-images", "4",
                                 "--faithfulness-images", "0", "--out", tmp_path / "in"],
                 ["probe", out, "--threads", "1"], ["eval", out, "--data", data]):
        err = error_line(capsys, argv, after_log=True)
        assert "changed since the run trained on it" in err and "22 train / 6 test images, the run's split was 16 / 4" \
            in err, err
    (out / "summary.json").unlink()
    before = checksums(out)
    err = error_line(capsys, ["train", "--resume", out], after_log=True)
    assert "changed since the run started" in err and "22 train / 6 test images, the run's split was 16 / 4" in err
    assert checksums(out) == before
    assert main(["eval", str(out), "--data", "digits"]) == 2  # another data set is its own split (classes differ)


def test_a_folder_deleted_while_the_run_trains_stops_it(tmp_path, cache_dir, one_thread):
    out = tmp_path / "run"

    def log(line):
        if line.startswith("epoch 1:"):
            shutil.rmtree(out)

    recipe = load_recipe(None, model="vit_micro_patch2_8", epochs=2, precision="fp32", threads=1, batch_size=64,
                         out=str(out))
    with pytest.raises(FolderGone, match="was deleted .* while the run was writing it: stopped") as e:
        train(recipe, log=log)
    assert len(str(e.value).splitlines()) == 1
    assert not out.exists()  # nothing written after it went, no folder made again


def test_a_setup_failure_leaves_nothing_that_asks_for_a_resume(tmp_path, cache_dir, capsys):
    teacher = tmp_path / "teacher"
    vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=10), teacher)
    (teacher / "model.safetensors").unlink()
    torch.save({"model": torch.nn.Linear(2, 2)}, teacher / "pytorch_model.bin")  # a pickled module: never unpickled
    out = tmp_path / "run"
    err = error_line(capsys, ["train", *TINY, "--epochs", "1", "--teacher", teacher, "--out", out], after_log=True)
    assert "Python object" in err and "--resume" not in err
    assert not out.exists()
    err = error_line(capsys, ["train", *TINY, "--epochs", "1", "--store-size", "4", "--out", out], after_log=True)
    assert "store_size 4 is smaller than the training size 8x8" in err and "--resume" not in err
    assert not out.exists()
    (out / "tb").mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump({"model": "vit_micro_patch2_8", "epochs": 1}))  # an older attempt
    (out / LOCK).write_text("train 1\n")
    code, err, _ = run_cli(capsys, ["train", *TINY, "--epochs", "1", "--out", out])
    assert code == 0 and "stopped before its first epoch ended: starting it over" in err


def test_a_finished_run_and_a_diverged_run_give_advice_that_works(uninterrupted, tmp_path, capsys):
    err = error_line(capsys, ["train", "--resume", uninterrupted["0"]])
    assert "nothing to resume" in err and "choose another --out" not in err
    diverged = ["train", *TINY, "--epochs", "1", "--out", tmp_path / "d"]
    err = error_line(capsys, [*diverged, "--lr", "1e6"], 1, after_log=True)  # the progress bar was closed before
    assert "diverged" in err and "resume from" not in err and "train it again with a lower --lr" in err
    code, err, _ = run_cli(capsys, diverged)  # what it advises: the same again with a lower --lr
    assert code == 0, err


def test_finished_run_and_export_folders_hold_no_lock(uninterrupted, tmp_path, capsys):
    assert not (uninterrupted["0"] / LOCK).exists()
    assert main(["export", str(uninterrupted["0"]), "--to", "timm", "--out", str(tmp_path / "ex")]) == 0
    assert not (tmp_path / "ex" / LOCK).exists()


@pytest.mark.slow
def test_kill_9_at_any_moment_leaves_whole_files_and_resumes(tmp_path, cache_dir):
    """A run killed with -9 at moments spread over its life: every file left is whole, and --resume (or a new start
    before the first checkpoint) finishes it with every epoch's row."""
    cmd = [sys.executable, "-m", "vitlab", "train", *TINY, "--epochs", "3"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for i, delay in enumerate((1.0, 2.5, 4.0, 6.0, 8.0)):
        out = tmp_path / f"run{i}"
        p = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if not out.exists():
            continue
        whole_files(out, killed=True)
        if (out / "summary.json").exists():
            continue
        again = ["--resume", str(out)] if (out / "checkpoint.pt").exists() else [*TINY, "--epochs", "3", "--out",
                                                                                   str(out)]
        assert subprocess.run([sys.executable, "-m", "vitlab", "train", *again], env=env).returncode == 0
        assert [r.epoch for r in read_history(out)] == [1, 2, 3] and read_summary(out).epochs == 3
        whole_files(out)  # and the debris of the killed write is gone


def test_a_run_with_no_model_yet_is_named_unfinished_by_every_command_that_reads_one(uninterrupted, tmp_path,
                                                                                     cache_dir, capsys):
    run = unfinished(uninterrupted, tmp_path)
    for name in ("config.json", "model.safetensors"):  # as a run stopped after its second epoch
        (run / name).unlink()
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
    commands = [["eval", run], ["predict", run, image], ["inspect", run, "--out", tmp_path / "in"],
                ["probe", run, "--data", "digits"], ["train", *TINY, "--epochs", "1", "--init", run,
                                                     "--out", tmp_path / "ft"],
                ["train", *TINY, "--epochs", "1", "--teacher", run, "--out", tmp_path / "ft"]]
    before = checksums(run)
    stopped = f"{run} is unfinished (stopped at epoch 2; resume with `vitlab train --resume {run}`), so it holds no"
    for argv in commands:
        assert stopped in error_line(capsys, argv), argv
    fd = folder.take_lock(run / LOCK)  # and while it trains
    folder.write_lock(fd, "train 4242")
    try:
        for argv in commands:
            err = error_line(capsys, argv)
            assert f"{run} is unfinished (training, pid 4242): its model is written when the run ends" in err, argv
    finally:
        os.close(fd)
    assert checksums(run) == before and not (tmp_path / "in").exists() and not (tmp_path / "ft").exists()
