"""Bad input to the CLI and the trainer: one line naming the problem and what is accepted (exit 2), never a
traceback, and nothing the user had changed."""
from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil

import pytest
import torch
from conftest import checksums, error_line
from test_faults import make_folder, remount, tmpfs

import vitlab
from vitlab.cli import main
from vitlab.models.registry import get_spec
from vitlab.train import build, load_recipe, train

TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]


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
    line = error_line(capsys, argv)
    assert f"'{argv[-1]}' is not valid; accepted: an integer >= 1" in line and line.startswith("vitlab ")


@pytest.mark.parametrize("classes", [("a", "b"), ("a", "b", "c", "d", "e")])
def test_classes_of_one_image_are_refused_before_training(tmp_path, capsys, classes):
    root = make_folder(tmp_path / "ones", classes=classes, per_class=1, size=(8, 8))
    line = error_line(capsys, ["train", "--data", str(root), *TINY, "--model-arg", "in_chans=3",
                               "--epochs", "1", "--out", str(tmp_path / "run"),
                               "--cache-dir", str(tmp_path / "c")], after_log=True)
    assert "no test images" in line and "classes of at least 2 images each" in line
    assert not (tmp_path / "run" / "checkpoint.pt").exists()  # refused before any training


@pytest.mark.parametrize("classes", [("a", "b", "c")])
def test_eval_on_a_set_without_test_images_is_one_line(tmp_path, capsys, model_dir, classes):
    root = make_folder(tmp_path / "ones", classes=classes, per_class=1, size=(8, 8))
    line = error_line(capsys, ["eval", str(model_dir), "--data", str(root), "--out", str(tmp_path / "e"),
                               "--cache-dir", str(tmp_path / "c")], after_log=True)
    assert "has no test images" in line and not (tmp_path / "e").exists()


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
    before = checksums(tmp_path / "mine")
    capsys.readouterr()
    line = error_line(capsys, ["train", "--resume", str(tmp_path / "mine")], after_log=True)
    mine_name = mine[mine.index("--model") + 1]
    assert f"holds the weights of {theirs_name}, not of {mine_name}" in line
    assert "accepted: a checkpoint of this run" in line
    assert checksums(tmp_path / "mine") == before


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
        line = error_line(capsys, argv, after_log=True)
        assert f"--out {out}" in line and "cannot be written (Read-only file system)" in line
        assert "accepted: a place on a writable file system" in line
        assert not (tmp_path / "c").exists()  # no data was decoded: refused before the work


@pytest.mark.parametrize("name, args", [("vit_micro_patch2_8", {}),
                                        ("vit_tiny_patch4_32", dict(embed_dim=32, depth=1, num_heads=2)),
                                        ("cait_xxs_patch4_32", dict(embed_dim=32, depth=1, num_heads=2))])
def test_a_config_without_architecture_says_what_is_missing(tmp_path, name, args):
    folder = vitlab.save(vitlab.create_model(name, **args), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architecture"]
    (folder / "config.json").write_text(json.dumps(cfg))
    before = checksums(folder)
    with pytest.raises(ValueError, match=r"config.json names no 'architecture' \(accepted: a registered model name, "
                                         r"see `vitlab models`\)") as e:
        vitlab.load(folder)
    assert "\n" not in str(e.value) and checksums(folder) == before


@pytest.mark.parametrize("model, size, patch", [("vit_tiny_patch4_32", "30", 4), ("vit_micro_patch2_8", "9", 2),
                                                ("deit_tiny_patch16_224", "200", 16)])
def test_a_size_the_patches_do_not_tile_is_refused_before_any_data(tmp_path, capsys, monkeypatch, model, size, patch):
    def no_data(*a, **kw):
        raise AssertionError("data decoded before the size was checked")
    monkeypatch.setattr(build, "load_data", no_data)
    line = error_line(capsys, ["train", "--model", model, "--img-size", size, "--epochs", "1",
                               "--out", str(tmp_path / "run")], after_log=True)
    assert f"is not divisible by the patch size {patch} of {model}; accepted: a multiple of {patch}" in line


@pytest.mark.parametrize("model, data, img_size, warned", [
    ("vit_base_patch16_224", "digits", None, "224x224 images and digits's are 8x8"),
    ("vit_tiny_patch4_32", "digits", None, "32x32 images and digits's are 8x8"),
    ("vit_micro_patch2_8", "cifar10", None, "8x8 images and cifar10's are 32x32"),
    ("vit_base_patch16_224", "digits", 16, None),
    ("vit_micro_patch2_8", "digits", None, None),
    ("vit_tiny_patch4_32", "cifar10", None, None),
])
def test_a_built_in_data_set_scaled_to_the_models_size_is_said(model, data, img_size, warned):
    lines = []
    r = load_recipe(None, model=model, data=data, img_size=img_size)
    spec = get_spec(model)
    build.check_size(model, img_size or spec.args["img_size"], spec.args, r, lines.append)
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(f"warning: {model} takes {warned}")
        assert "choose the size with --img-size" in lines[0]


class Payload:
    def __reduce__(self):
        return (print, ("executed",))


def test_a_refused_pickle_is_one_line_without_unsafe_advice(tmp_path, capsys, cache_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data: digits\nmodel: vit_micro_patch2_8\nepochs: 1\nthreads: 1\n")
    torch.save({"model": Payload()}, run / "checkpoint.pt")
    model = tmp_path / "model"
    shutil.copytree(vitlab.save(vitlab.create_model("vit_micro_patch2_8"), tmp_path / "m"), model)
    (model / "model.safetensors").unlink()
    torch.save({"x": Payload()}, model / "pytorch_model.bin")
    before = checksums(run), checksums(model)
    line = error_line(capsys, ["train", "--resume", str(run)], after_log=True)
    with pytest.raises(ValueError) as e:
        vitlab.load(model)
    for text in (line, str(e.value)):
        assert re.search(r"cannot be read as plain tensors: it holds a Python object \([\w.]*print\) that vitlab "
                         "never unpickles", text), text
        assert "weights_only" not in text and "\n" not in text
    assert (checksums(run), checksums(model)) == before
    assert "executed" not in capsys.readouterr().out
