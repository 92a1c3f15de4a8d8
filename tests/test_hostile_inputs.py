"""Hostile input on the newest surfaces (arrays, shards, pack, LoRA, pre-training, studies, predict), each one class
of input read wherever it is read: one line naming the problem, the value and what is accepted, or a correct
result; never a traceback, never a run that trains on something other than what was given."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import checksums, error_line
from test_shards import _images, write_shards

import vitlab
import vitlab.api
import vitlab.data.arrays
from vitlab.cli import main
from vitlab.data import sources
from vitlab.data.shards import ShardReader, open_shards
from vitlab.data.sources import load_data
from vitlab.errors import VitlabError
from vitlab.studies.runner import calibrate
from vitlab.train import load_recipe, train
from vitlab.train import setup as run_setup
from vitlab.train.feed import EpochPlan, ShardFeeder
from vitlab.train.lora import apply_lora

wds = pytest.importorskip("webdataset")
TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "16", "--precision", "fp32", "--threads", "1"]


# ----------------------------------------------------------------------------------------------
# every shard a run reads, read the same way: at the first look, while training, for the test split


def _epoch(data) -> None:
    """Read one training epoch of a shard bundle as a run does (in this process)."""
    feeder = ShardFeeder(ShardReader(data.shards, workers=0), torch.device("cpu"), 0)
    for _ in feeder.epoch(EpochPlan(data.num_train, 2, 0)):
        pass


def _info(folder, pattern_prefix: str, counts: list[int], classes: int = 3) -> None:
    files = [f"{pattern_prefix}-{i:06d}.tar" for i in range(len(counts))]
    (folder / "_info.json").write_text(json.dumps({"classes": [f"c{k}" for k in range(classes)], "splits": {
        "train": {"filenames": files, "shard_lengths": counts}}}))


@pytest.fixture
def shards(tmp_path):
    x, y = _images(60, 3, 0)
    tx, ty = _images(12, 3, 1)
    train = write_shards(tmp_path / "wds", "train", x, y, per_shard=20)
    test = write_shards(tmp_path / "wds", "test", tx, ty, per_shard=12)
    return tmp_path / "wds", train, test


def test_a_train_shard_that_is_not_a_tar_is_one_line_wherever_it_is_read(shards, cache_dir, monkeypatch):
    folder, train, test = shards
    (folder / "train-000002.tar").write_bytes(os.urandom(20000))  # random bytes
    with pytest.raises(VitlabError, match=r"train-000002.tar cannot be read as a tar file .*accepted: WebDataset"):
        open_shards(train)  # counted by reading it
    _info(folder, "train", [20, 20, 20])  # counted by _info.json: met while training
    monkeypatch.setattr(sources, "PEEK", 4)
    data = load_data(train, test_data=test, img_size=8, log=lambda m: None)
    with pytest.raises(VitlabError, match=r"train-000002.tar cannot be read as a tar file"):
        _epoch(data)
    (folder / "train-000000.tar").write_bytes(os.urandom(20000))  # the first shard: met at the first look
    with pytest.raises(VitlabError, match=r"train-000000.tar cannot be read as a tar file"):
        load_data(train, test_data=test, img_size=8, log=lambda m: None)


@pytest.mark.parametrize("label", [7, -1])
def test_a_train_shards_label_outside_the_classes_is_one_line_as_a_test_shards_is(shards, cache_dir, monkeypatch,
                                                                                   tmp_path, label):
    folder, train, test = shards
    x, y = _images(20, 3, 2)
    y[13] = label
    write_shards(folder, "train", x, y, per_shard=20)  # train-000000.tar again, one label outside 0..2
    _info(folder, "train", [20, 20, 20])
    monkeypatch.setattr(sources, "PEEK", 4)
    data = load_data(train, test_data=test, img_size=8, log=lambda m: None)
    with pytest.raises(VitlabError, match=rf"train-000000.tar: sample train00013 has label {label}, out of range; "
                                          r"accepted: 0..2 \(the 3 classes"):
        _epoch(data)
    (folder / "_info.json").unlink()
    (folder / "classes.txt").write_text("a\nb\nc\n")
    with pytest.raises(VitlabError, match=rf"sample train00013 has label {label}, out of range"):
        open_shards(train)


def test_shard_lengths_that_undercount_the_shards_are_one_line(shards, cache_dir, monkeypatch):
    folder, train, test = shards
    _info(folder, "train", [20, 10, 20])  # 10 counted, 20 held
    monkeypatch.setattr(sources, "PEEK", 4)
    data = load_data(train, test_data=test, img_size=8, log=lambda m: None)
    assert data.num_train == 50
    with pytest.raises(VitlabError, match=r"train-000001.tar holds more than the 10 samples counted of it "
                                          r"\(_info.json's shard_lengths undercount it"):
        _epoch(data)
    _info(folder, "train", [20, 20, 20])  # counted right: the epoch reads every image
    _epoch(load_data(train, test_data=test, img_size=8, log=lambda m: None))


def test_a_resume_after_a_shards_content_changed_is_refused(shards, cache_dir, capsys, monkeypatch):
    folder, train, test = shards
    monkeypatch.setattr(run_setup, "SHARD_WORKERS", 0)
    out = folder.parent / "run"
    argv = ["train", *TINY, "--data", train, "--test-data", test, "--out", str(out)]
    assert main([*argv, "--epochs", "1"]) == 0
    capsys.readouterr()
    (out / "summary.json").unlink()  # as if stopped after its first epoch
    os.rename(folder, folder.parent / "moved")  # a moved folder is the same data...
    os.rename(folder.parent / "moved", folder)
    x, y = _images(60, 3, 0)
    write_shards(folder, "train", x[20:40], (y[20:40] + 1) % 3, per_shard=20)  # ...every label of a shard changed
    os.rename(folder / "train-000000.tar", folder / "train-000001.tar")
    write_shards(folder, "train", x[:20], y[:20], per_shard=20)  # the first shard as it was
    before = checksums(out)
    err = error_line(capsys, ["train", "--resume", str(out), "--epochs", "2"], after_log=True)
    assert "changed since the run started" in err and "a shard was rewritten since" in err, err
    assert checksums(out) == before


# ----------------------------------------------------------------------------------------------
# integer labels with no class names: a label far beyond the others is refused by every source, as Parquet's is


def test_a_label_far_beyond_the_others_is_refused_by_arrays_and_shards_as_by_parquet(tmp_path, cache_dir):
    x, y = _images(40, 3, 0)
    y[17] = 1000
    with pytest.raises(VitlabError, match=r"the arrays hold label 1000, which makes 1001 classes .*997 of them with "
                                          r"no image .*accepted: labels 0..K-1 with images in each class, or "
                                          r"class_names"):
        vitlab.data.arrays.store_arrays((x, y), cache_dir=cache_dir, log=lambda m: None)
    names = [str(k) for k in range(1001)]  # named, the classes are the user's own
    assert vitlab.data.arrays.store_arrays((x, y), class_names=names, cache_dir=cache_dir, log=lambda m: None)
    train = write_shards(tmp_path / "wds", "train", x, y, per_shard=20)
    with pytest.raises(VitlabError, match=r"the shards of .* hold label 1000, which makes 1001 classes .*accepted: "
                                          r"labels 0..K-1 with images in each class, or the class names in a "
                                          r"classes.txt"):
        open_shards(train)


# ----------------------------------------------------------------------------------------------
# the Python face of predict and evaluate takes what the command line takes, and says it as clearly


CLASSIFIER = Path(__file__).parent / "fixtures" / "preprocess" / "hf_vit_exact_bilinear"  # 3x16x16, 5 classes


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_a_batch_size_below_one_is_one_line_for_predict_and_evaluate(size):
    x = np.zeros((3, 16, 16, 3), np.uint8)
    with pytest.raises(VitlabError, match=rf"batch_size {size!r} is not valid; accepted: an integer >= 1"):
        vitlab.predict(str(CLASSIFIER), x, batch_size=size)
    with pytest.raises(VitlabError, match=rf"batch_size {size!r} is not valid; accepted: an integer >= 1"):
        vitlab.evaluate(str(CLASSIFIER), (x, np.zeros(3, np.int64)), batch_size=size)


def test_predict_decodes_a_batch_at_a_time_as_the_command_line_does(tmp_path, monkeypatch):
    from PIL import Image
    files = []
    for i in range(10):
        Image.fromarray(np.full((20, 24, 3), 20 * i, np.uint8)).save(tmp_path / f"{i}.png")
        files.append(tmp_path / f"{i}.png")
    real, sizes = vitlab.api.decode_images, []

    def counted(images, cfg):
        sizes.append(len(images))
        return real(images, cfg)
    monkeypatch.setattr(vitlab.api, "decode_images", counted)
    probs = vitlab.predict(str(CLASSIFIER), files, batch_size=4)
    assert sizes == [4, 4, 2] and probs.shape == (10, 5)
    whole = vitlab.predict(str(CLASSIFIER), files, batch_size=10)
    assert np.allclose(probs, whole, atol=1e-5)


def test_array_messages_say_what_was_given(tmp_path, monkeypatch):
    """What cannot be read of a Keras user's arrays is named with advice that fits the values given: (N, H, W) for
    a model of three channels is told to add the channel, values outside [0, 1] and [0, 255] are told what they look
    like, and a list of images of two sizes is said to hold two sizes."""
    x = np.zeros((5, 16, 16, 3), np.uint8)
    with pytest.raises(VitlabError, match=r"an array of shape \(5, 16, 16\) is not one image .*\(N, H, W\): add "
                                          r"their channel, x\[..., None\]"):
        vitlab.predict(str(CLASSIFIER), x[..., 0])  # (N, H, W) for a model of three channels
    y = np.zeros(5, np.int64)
    with pytest.raises(VitlabError, match=r"values -3..3, outside \[0, 1\] and \[0, 255\] \(they look normalised"):
        vitlab.fit("vit_micro_patch2_8", (np.linspace(-3, 3, 5 * 64).reshape(5, 8, 8, 1), y), out=tmp_path / "a")
    with pytest.raises(VitlabError, match=r"differing sizes \(\(10, 10\), \(8, 8\)\): the sizes differ"):
        vitlab.fit("vit_micro_patch2_8", ([np.zeros((8, 8), np.uint8)] * 3 + [np.zeros((10, 10), np.uint8)] * 2, y),
                   out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_encoder_given_to_evaluate_is_said_to_have_no_head(tmp_path, cache_dir):
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=0, embed_dim=16, depth=1,
                                             num_heads=2, in_chans=1), tmp_path / "encoder")
    x, y = np.zeros((4, 8, 8), np.uint8), np.array([0, 1, 0, 1])
    for model in (str(folder), vitlab.load(folder)):
        with pytest.raises(VitlabError, match=r"has no classifier head \(a pre-trained encoder\): nothing to evaluate"):
            vitlab.evaluate(model, (x, y))
    with pytest.raises(VitlabError, match=r"has no classifier head \(a pre-trained encoder\): nothing to evaluate"):
        vitlab.evaluate(str(folder), "digits", cache_dir=cache_dir)


def test_predict_names_a_symlink_loop_and_a_dangling_link_among_its_files(tmp_path, capsys):
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    (tmp_path / "gone.png").symlink_to(tmp_path / "nowhere.png")
    line = error_line(capsys, ["predict", str(CLASSIFIER), str(tmp_path / "loop.png")])
    assert f"{tmp_path / 'loop.png'} is a symlink loop (it leads back to itself)" in line
    line = error_line(capsys, ["predict", str(CLASSIFIER), str(tmp_path / "gone.png")])
    assert f"{tmp_path / 'gone.png'} is a symlink to {tmp_path / 'nowhere.png'}, which does not exist" in line
    line = error_line(capsys, ["train", "--data", str(tmp_path / "loop.png"), "--out", str(tmp_path / "run")])
    assert "is a symlink loop" in line


def test_a_run_trained_on_a_relative_path_is_evaluated_from_another_folder(tmp_path, cache_dir, capsys, monkeypatch):
    from test_run_folder import image_folder
    (tmp_path / "here").mkdir()
    image_folder(tmp_path / "here" / "photos", 6)
    monkeypatch.chdir(tmp_path / "here")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--data", "photos", "--out", str(out)]) == 0
    top1 = json.loads((out / "summary.json").read_text())["top1"]
    monkeypatch.chdir(tmp_path)  # elsewhere: the run's data is where it was trained from
    capsys.readouterr()
    assert main(["eval", str(out)]) == 0
    assert vitlab.evaluate(str(out))["top1"] == top1
    line = error_line(capsys, ["eval", str(out), "--data", "photos"])  # named here, it is read from here
    assert f"data source 'photos' (read from the current folder, {tmp_path})" in line


# ----------------------------------------------------------------------------------------------
# an option given is used, or refused: never recorded and ignored


@pytest.mark.parametrize("argv, named", [
    (["--steps", "6", "--epochs", "1"], "epochs=1"), (["--time-budget", "1", "--epochs", "2"], "epochs=2"),
    (["--budget-counts", "training"], "budget_counts='training'"), (["--lora-targets", "qkv"], "lora_targets='qkv'"),
    (["--lookahead-decay", "0.9"], "lookahead_decay=0.9"), (["--plateau-factor", "0.3"], "plateau_factor=0.3"),
    (["--progressive-until", "0.3"], "progressive_until=0.3"),
])
def test_an_option_given_that_the_run_would_not_use_is_refused(tmp_path, capsys, argv, named):
    line = error_line(capsys, ["train", "--data", "digits", *argv, "--out", str(tmp_path / "run")])
    assert f"{named} is given but would not be used" in line and "accepted: leave it out" in line
    assert not (tmp_path / "run").exists()
    with pytest.raises(VitlabError, match=f"{named} is given but would not be used"):
        vitlab.fit("vit_micro_patch2_8", "digits", out=tmp_path / "api",
                   **{a.removeprefix("--").replace("-", "_"): yaml.safe_load(v) for a, v in zip(argv[::2], argv[1::2])})
    recipe = tmp_path / "recipe.yaml"  # the same in a recipe file
    recipe.write_text(yaml.safe_dump({a.removeprefix("--").replace("-", "_"): yaml.safe_load(v)
                                      for a, v in zip(argv[::2], argv[1::2])}))
    line = error_line(capsys, ["train", "--data", "digits", "--config", str(recipe), "--out", str(tmp_path / "run")])
    assert f"{named} in recipe {recipe} is given but would not be used" in line


def test_a_recipe_files_epochs_give_way_to_a_budget_on_the_command_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epochs: 10\n")
    assert load_recipe(recipe, strict=True, time_budget=2).time_budget == 2  # as recipes/cifar10_airbench.yaml says


def test_lora_is_refused_where_it_cannot_adapt_a_pretrained_model(tmp_path):
    pytest.importorskip("peft")
    with pytest.raises(VitlabError, match=r"lora=4 adapts a pretrained model: give --init MODEL"):
        load_recipe(None, lora=4)
    recipe = load_recipe(None, init=str(tmp_path / "init"), lora=100000)
    with pytest.raises(VitlabError, match=r"lora=100000: LoRA adapts Linear layers, and AirBench has none outside its "
                                          r"head .*accepted: a model with Linear layers"):
        apply_lora(vitlab.create_model("airbench_32", num_classes=3), recipe, print)
    with pytest.raises(VitlabError, match=r"lora=100000 is above the width of blocks.0.attn.proj \(64 in, 64 out\); "
                                          r"accepted: a rank of 1..64"):
        apply_lora(vitlab.create_model("vit_micro_patch2_8", num_classes=3), recipe, print)


# ----------------------------------------------------------------------------------------------
# a study's inputs: its seeds and budgets, its calibration file


@pytest.mark.parametrize("option, value, said", [
    ("--seeds", "0,0", "seeds 0,0 are not valid (0 twice)"), ("--seeds", "1,-1", "seeds 1,-1 are not valid"),
    ("--pretrain-budgets", "1,1", "pretrain budgets 1.0,1.0 are not valid")])
def test_a_study_refuses_a_seed_or_budget_given_twice(tmp_path, capsys, option, value, said):
    name = "pretrain" if option == "--pretrain-budgets" else "pos-embed"
    line = error_line(capsys, ["study", name, option, value, "--out", str(tmp_path / "s")])
    assert said in line and "accepted:" in line


@pytest.mark.parametrize("rate", ["fast", 1e12, None, True])
def test_a_calibration_file_edited_by_hand_is_one_line_naming_it(tmp_path, rate):
    common = {"data": "digits", "threads": 1, "time_budget": 1.0}
    key = "digits, 1 thread(s) per run"
    entry = {"images_per_minute": 6000.0, "measured_with": "x", "seconds": 6.0, "steps": 9, "images": 600}
    (tmp_path / "calibration.json").write_text(json.dumps({key: entry}))
    assert calibrate(tmp_path, common, print) == entry  # as vitlab wrote it: read back
    (tmp_path / "calibration.json").write_text(json.dumps({key: {**entry, "images_per_minute": rate}}))
    with pytest.raises(VitlabError, match=re.escape(f"{tmp_path / 'calibration.json'}: the entry '{key}' holds "
                                                    f"images_per_minute {rate!r}, not the rate vitlab measured")):
        calibrate(tmp_path, common, print)


@pytest.mark.slow
def test_a_pipe_closed_by_its_reader_ends_the_command_quietly():
    """`vitlab models 'vit_*' | head -1`: the reader has what it wanted; no 'broken pipe' error, the status of a
    command SIGPIPE stopped (141), as `yes | head -1` ends."""
    read, write = os.pipe()
    os.close(read)  # the reader gone before the first line
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(vitlab.__file__).parents[1])}
        ran = subprocess.run([sys.executable, "-m", "vitlab", "models", "vit_*"], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=120, env=env)
    finally:
        os.close(write)
    assert ran.returncode == 141 and ran.stderr == ""


def test_a_forked_worker_does_not_hold_its_parents_lock(tmp_path):
    """A DataLoader worker (forked) that outlives a run killed with -9 must not keep the run's lock: an immediate
    --resume would be refused naming a dead pid."""
    import multiprocessing
    import time

    from vitlab.runs.folder import take_lock
    fd = take_lock(tmp_path / ".vitlab.lock")
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()

    def work():
        started.set()
        time.sleep(30)
    worker = ctx.Process(target=work)
    worker.start()
    try:
        assert started.wait(20)
        os.close(fd)  # the run dies (the kernel closes its files); its worker lives on
        os.close(take_lock(tmp_path / ".vitlab.lock"))  # free at once
    finally:
        worker.kill()
        worker.join()


@pytest.mark.parametrize("size", ["100B", "3KB"])
def test_pack_closes_a_shard_at_the_size_its_archive_holds(tmp_path, cache_dir, size):
    """--shard-size counts what a shard's tar holds (headers and contents), not the file's position, which lags
    10 KB behind in tarfile's buffer: a shard stops at the first sample that reaches the size."""
    import tarfile

    from test_pack import _folder

    from vitlab.data.pack import pack, parse_size
    limit = parse_size(size)
    info = pack(_folder(tmp_path / "folder", 6, 2), tmp_path / "wds", shard_size=limit, log=lambda m: None)
    for name, count in zip(info["splits"]["train"]["filenames"], info["splits"]["train"]["shard_lengths"]):
        with tarfile.open(tmp_path / "wds" / name) as tar:
            ends = [m.offset_data + -(-m.size // 512) * 512 for m in tar.getmembers()]
        per_sample = [ends[i] for i in range(1, len(ends), 2)]  # each sample: its image, then its .cls
        assert len(per_sample) == count and all(end < limit for end in per_sample[:-1]), (name, per_sample)
    if limit < 1024:
        assert info["splits"]["train"]["shard_lengths"] == [1] * 18  # one sample a shard


def test_a_pretraining_run_of_one_image_is_told_what_works(tmp_path, cache_dir):
    from PIL import Image
    (tmp_path / "one" / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "one" / "a" / "0.png")
    lines = []
    recipe = load_recipe(None, pretrain="dino", data=str(tmp_path / "one"), model="vit_micro_patch2_8", epochs=1,
                         threads=1, precision="fp32", out=str(tmp_path / "run"))
    with pytest.raises(VitlabError, match=r"leaves no test images \(1 training images, val_fraction 0.2\); accepted: "
                                          r"more images, or --val-fraction 0"):
        train(recipe, log=lines.append)
    assert any("val_fraction 0.2 holds out no image of a class of one image" in line for line in lines), lines
    assert not any("val_fraction=0" in line or "val_fraction 0 " in line for line in lines), lines


@pytest.mark.parametrize("info, said", [
    ({"shard_lengths": ["ten", 20, 20]}, "shard_lengths gives 'ten' for train-000000.tar"),
    ({"shard_lengths": [-5, 20, 20]}, "shard_lengths gives -5"),
    ({"shard_lengths": [10.7, 20, 20]}, "shard_lengths gives 10.7"),
    ({"shard_lengths": [None, 20, 20]}, "shard_lengths gives None"), ({"classes": "abc"}, "'classes' is abc"),
    ({"classes": ["a", "a", "b"]}, "'classes' is ['a', 'a', 'b'] (a twice)"),
    ({"mean": ["x", 0.5, 0.5]}, "mean is ['x', 0.5, 0.5]"),
])
def test_an_info_json_field_of_the_wrong_kind_is_one_line_naming_it(shards, cache_dir, info, said):
    folder, train, test = shards
    files = [f"train-{i:06d}.tar" for i in range(3)]
    value = {"classes": ["c0", "c1", "c2"], "splits": {"train": {"filenames": files, "shard_lengths": [20, 20, 20]}}}
    if "shard_lengths" in info:
        value["splits"]["train"]["shard_lengths"] = info["shard_lengths"]
    else:
        value.update(info)
    (folder / "_info.json").write_text(json.dumps(value))
    with pytest.raises(VitlabError, match=re.escape(f"{folder / '_info.json'}: {said}")):
        load_data(train, test_data=test, img_size=8, log=lambda m: None)
