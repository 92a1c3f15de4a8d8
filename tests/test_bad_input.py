"""Bad input to the CLI and the trainer: one line naming the problem and what is accepted (exit 2), never a
traceback, and nothing the user had changed."""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import shutil

import pytest
from test_faults import make_folder, one_line_error, remount, tmpfs

import vitlab
from vitlab.cli import main
from vitlab.train import load_recipe, train

TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def argparse_error(capsys, argv):
    """(exit code, the one stderr line) of a command line argparse refuses."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return e.value.code, lines[0]


@pytest.fixture
def model_dir(tmp_path):
    """A saved 8x8 RGB model of three classes."""
    return vitlab.save(vitlab.create_model("vit_micro_patch2_8", in_chans=3, num_classes=3), tmp_path / "model")


@pytest.mark.parametrize("argv", [
    ["predict", "M", "x.png", "--top-k", "-3"],
    ["predict", "M", "x.png", "--top-k", "0"],
    ["predict", "M", "x.png", "--top-k", "two"],
    ["eval", "M", "--data", "digits", "--batch-size", "-5"],
    ["eval", "M", "--data", "digits", "--batch-size", "0"],
    ["eval", "M", "--data", "digits", "--batch-size", "1.5"],
])
def test_a_count_out_of_range_names_the_accepted_range(capsys, argv):
    code, line = argparse_error(capsys, argv)
    assert code == 2
    assert f"'{argv[-1]}' is not valid; accepted: an integer >= 1" in line and line.startswith("vitlab ")


@pytest.mark.parametrize("classes", [("a", "b"), ("a", "b", "c", "d", "e")])
def test_classes_of_one_image_are_refused_before_training(tmp_path, capsys, classes):
    root = make_folder(tmp_path / "ones", classes=classes, per_class=1, size=(8, 8))
    code, line = one_line_error(capsys, ["train", "--data", str(root), *TINY, "--model-arg", "in_chans=3",
                                         "--epochs", "1", "--out", str(tmp_path / "run"),
                                         "--cache-dir", str(tmp_path / "c")])
    assert code == 2 and "no test images" in line and "classes of at least 2 images each" in line
    assert not (tmp_path / "run" / "checkpoint.pt").exists()  # refused before any training


@pytest.mark.parametrize("classes", [("a", "b", "c")])
def test_eval_on_a_set_without_test_images_is_one_line(tmp_path, capsys, model_dir, classes):
    root = make_folder(tmp_path / "ones", classes=classes, per_class=1, size=(8, 8))
    code, line = one_line_error(capsys, ["eval", str(model_dir), "--data", str(root), "--out", str(tmp_path / "e"),
                                         "--cache-dir", str(tmp_path / "c")])
    assert code == 2 and "has no test images" in line and not (tmp_path / "e").exists()


class FastClock:
    """A clock on which each reading is ``tick`` seconds after the last."""

    def __init__(self, tick):
        self.t, self.tick = 0.0, tick

    def __call__(self):
        self.t += self.tick
        return self.t


@pytest.mark.parametrize("budget, tick", [(0.05, 10.0), (0.01, 1.0), (1.0, 120.0)])
def test_a_budget_spent_before_the_first_step_is_one_line(tmp_path, cache_dir, budget, tick):
    r = load_recipe(None, data="digits", model="vit_micro_patch2_8", time_budget=budget, batch_size=64,
                    precision="fp32", threads=1, out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"--time-budget {budget:g} min ran out before the first training step") as e:
        train(r, log=lambda s: None, now=FastClock(tick))
    assert "\n" not in str(e.value) and "accepted: a budget that leaves time to train" in str(e.value)


OTHER = ["--model", "vit_tiny_patch4_32", "--img-size", "8", "--model-arg", "embed_dim=32", "--model-arg", "depth=1",
         "--model-arg", "num_heads=2", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]


@pytest.mark.parametrize("mine, theirs, theirs_name", [(TINY, OTHER, "vit_tiny_patch4_32"),
                                                       (OTHER, TINY, "vit_micro_patch2_8")])
def test_resuming_from_another_models_checkpoint_names_both(tmp_path, capsys, cache_dir, mine, theirs, theirs_name):
    for name, argv in (("mine", mine), ("theirs", theirs)):
        assert main(["train", *argv, "--epochs", "1", "--out", str(tmp_path / name)]) == 0
    (tmp_path / "mine" / "summary.json").unlink()  # an unfinished run, now holding another model's checkpoint
    shutil.copy(tmp_path / "theirs" / "checkpoint.pt", tmp_path / "mine" / "checkpoint.pt")
    before = digests(tmp_path / "mine")
    capsys.readouterr()
    code, line = one_line_error(capsys, ["train", "--resume", str(tmp_path / "mine")])
    mine_name = mine[mine.index("--model") + 1]
    assert code == 2 and f"holds the weights of {theirs_name}, not of {mine_name}" in line
    assert "accepted: a checkpoint of this run" in line
    assert digests(tmp_path / "mine") == before


@contextlib.contextmanager
def read_only(tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as path:
        (path / "existing").mkdir()
        remount(path, "ro")
        yield path


@pytest.mark.parametrize("command, where", list(itertools.product(["train", "eval", "export", "compare"],
                                                             ["new/run", "existing", "."])))
def test_an_out_on_a_read_only_file_system_is_refused_before_the_work(tmp_path, capsys, model_dir, command, where):
    with read_only(tmp_path) as ro:
        out = str(ro / where)
        argv = {"train": ["train", "--data", "digits", *TINY, "--epochs", "1", "--out", out],
                "eval": ["eval", str(model_dir), "--data", str(make_folder(tmp_path / "set", classes=("a", "b", "c"),
                                                                            per_class=3, size=(8, 8))),
                         "--out", out, "--cache-dir", str(tmp_path / "c")],
                "export": ["export", str(model_dir), "--to", "timm", "--out", out],
                "compare": ["compare", str(model_dir), "--out", out + "/compare.png"]}[command]
        code, line = one_line_error(capsys, argv)
        assert code == 2 and f"--out {out}" in line and "cannot be written (Read-only file system)" in line
        assert "accepted: a place on a writable file system" in line
        assert not (tmp_path / "c").exists()  # no data was decoded: refused before the work
