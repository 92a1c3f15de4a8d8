"""Run folders and --out: a command never writes into a folder holding others' files or being written by another
process; --resume honours or refuses the options given with it; a killed final save resumes to the same model."""
import fcntl
import json
import os

import pytest
import torch
from conftest import error_line

import vitlab
import vitlab.data
from vitlab.cli import main
from vitlab.runs.folder import LOCK, MARK, claim_folder
from vitlab.runs.format import read_config, read_history, read_summary

TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]

COMMANDS = {  # every command that writes a folder, with --out left for the test to give
    "train": ["train", *TINY, "--epochs", "1"],
    "eval": ["eval", "no-such-model", "--data", "digits"],
    "inspect": ["inspect", "no-such-model"],
    "export": ["export", "no-such-model", "--to", "timm"],
    "study": ["study", "hybrid", "--quick"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_holding_others_files_is_refused(command, tmp_path, cache_dir, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / "config.yaml").write_text("mine: 1\n")
    (out / "notes.txt").write_text("keep\n")
    err = error_line(capsys, [*COMMANDS[command], "--out", out])
    assert f"vitlab {command} did not write" in err and "config.yaml" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "notes.txt"]  # nothing added, nothing changed
    assert (out / "config.yaml").read_text() == "mine: 1\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_another_process_writes_is_refused(command, tmp_path, cache_dir, capsys):
    out = tmp_path / "d"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    os.write(fd, f"{command} 4242\n".encode())
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live writer of the folder holds it
    try:
        err = error_line(capsys, [*COMMANDS[command], "--out", out])
    finally:
        os.close(fd)
    assert "being written by another vitlab process (pid 4242)" in err
    assert [p.name for p in out.iterdir()] == [LOCK]


def test_a_file_as_out_is_refused(tmp_path, capsys):
    out = tmp_path / "f"
    out.write_text("x")
    assert "is a file" in error_line(capsys, [*COMMANDS["eval"], "--out", out])
    assert out.read_text() == "x"


def test_init_into_itself_is_refused(tmp_path, cache_dir, capsys):
    src = tmp_path / "model"
    vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=10), src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (src, tmp_path):
        err = error_line(capsys, ["train", *TINY, "--epochs", "1", "--init", src, "--out", out])
        assert "--init" in err and "would overwrite it" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_a_command_may_rewrite_its_own_folder(tmp_path, cache_dir, capsys):
    model = tmp_path / "model"
    vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=10), model)
    out = tmp_path / "ev"
    for _ in range(2):
        assert main(["eval", str(model), "--data", "digits", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"summary.json", "confusion.png", MARK}
    capsys.readouterr()  # the evaluations' progress
    # another kind of command does not take it over
    err = error_line(capsys, ["export", str(model), "--to", "timm", "--out", str(out)])
    assert "vitlab export did not write" in err


def test_a_command_that_fails_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new"
    error_line(capsys, [*COMMANDS["eval"], "--out", out])  # the model does not exist
    assert not out.exists()


def test_resume_refuses_options_that_would_change_the_run(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("model: vit_micro_patch2_8\nepochs: 2\nlr: 0.001\n")
    err = error_line(capsys, ["train", "--resume", run, "--lr", "0.5", "--model", "other", "--epochs", "6"])
    assert err.endswith("--model, --lr cannot change on --resume; accepted with --resume: --epochs, --time-budget, "
                        "--eval-every, --log, --threads, --device, --cache-dir, --download, --workers, "
                        "--checkpoint-every")
    assert "--out" in error_line(capsys, ["train", "--resume", run, "--out", tmp_path / "elsewhere"])
    assert "--epochs -1 is not valid on --resume" in error_line(capsys, ["train", "--resume", run, "--epochs", "-1"])
    assert (run / "config.yaml").read_text().endswith("lr: 0.001\n")


def test_resume_with_more_epochs_trains_them(tmp_path, cache_dir):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--epochs", "1", "--out", str(run)]) == 0
    (run / "summary.json").unlink()  # as if killed before its end: the checkpoint holds 1 epoch
    assert main(["train", "--resume", str(run), "--epochs", "2", "--threads", "1"]) == 0
    assert [r.epoch for r in read_history(run)] == [1, 2]
    assert read_config(run)["epochs"] == 2 and read_summary(run).epochs == 2


@pytest.mark.parametrize("lost", [("summary.json",), ("summary.json", "model.safetensors", "config.json")])
def test_a_run_killed_in_its_final_save_resumes_to_the_same_ema_model(lost, tmp_path, cache_dir):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for out in (whole, killed):
        assert main(["train", *TINY, "--epochs", "3", "--ema-decay", "0.9", "--lr", "0.003", "--seed", "1",
                     "--out", str(out)]) == 0
    assert read_summary(whole).ema  # the EMA copy won: the case the resume must not lose
    for name in lost:  # killed after the last checkpoint, before or during the final save
        (killed / name).unlink()
    assert main(["train", "--resume", str(killed)]) == 0
    assert read_summary(killed).ema
    assert (killed / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert read_summary(killed).top1 == read_summary(whole).top1


def test_eval_and_inspect_of_a_run_use_its_own_split(tmp_path, cache_dir, capsys):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--epochs", "2", "--seed", "1", "--out", str(run)]) == 0
    assert main(["eval", str(run), "--out", str(tmp_path / "ev")]) == 0  # no --data: the run's own
    ev = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert ev["top1"] == read_summary(run).top1 and ev["data"] == read_summary(run).data
    seed0 = vitlab.data.load_data("digits", seed=0, log=lambda s: None).test.labels
    seed1 = vitlab.data.load_data("digits", seed=1, log=lambda s: None).test.labels
    assert not torch.equal(seed0, seed1)  # the seed-0 split is another set of test images
    assert main(["inspect", str(run), "--num-images", "2", "--distance-images", "8",
                 "--out", str(tmp_path / "in")]) == 0  # no --data: the run's own
    for folder, kind in (("ev", "eval"), ("in", "inspect")):  # finished: no lock, the mark of who wrote it
        assert not (tmp_path / folder / LOCK).exists() and (tmp_path / folder / MARK).read_text() == f"{kind}\n"
    plain = tmp_path / "plain"
    vitlab.save(vitlab.load(run), plain)
    capsys.readouterr()
    assert "give --data" in error_line(capsys, ["eval", str(plain)])


@pytest.mark.parametrize("kind", ["eval", "inspect", "export", "study", "probe"])
def test_a_folder_a_command_ended_in_holds_no_lock_and_is_its_own_again(kind, tmp_path):
    out, name = tmp_path / "out", {"eval": "summary.json", "inspect": "a.png", "export": "model.onnx",
                                   "study": "x.md", "probe": "probe.json"}[kind]
    with claim_folder(out, kind):
        assert (out / LOCK).read_text().split()[:2] == [kind, str(os.getpid())]  # the pid, for messages
        (out / name).write_text("1")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARK, name])  # no lock naming an ended process
    with pytest.raises(RuntimeError), claim_folder(out, kind):  # a command that fails midway: no lock either
        (out / name).write_text("2")
        raise RuntimeError("failed")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARK, name])
    with claim_folder(out, kind):  # the same kind rewrites its own folder
        (out / name).write_text("3")
    other = "eval" if kind != "eval" else "inspect"
    with pytest.raises(ValueError, match=f"vitlab {other} did not write"), claim_folder(out, other):
        pass
    assert sorted(p.name for p in out.iterdir()) == sorted([MARK, name]) and (out / name).read_text() == "3"
