"""Hostile model folders, data files and options: each is one line naming the file, the field and what is accepted
(exit 2), never a traceback, a silent wrong figure or an allocation the files do not justify."""
from __future__ import annotations

import json
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
from conftest import error_line as one_line
from conftest import run_cli
from PIL import Image
from safetensors.torch import load_file, save_file

import vitlab
from vitlab.text import clip_quotes, quote

MODEL = "vit_micro_patch2_8"


def error_line(capsys, argv, code=2):
    """The one error line of a refused command (log and progress lines may come before it)."""
    return one_line(capsys, argv, code, after_log=True)


@pytest.fixture
def pngs(tmp_path):
    """A 3-class folder of 16x16 RGB PNGs, 4 a class, each class its own brightness."""
    rng = np.random.default_rng(0)
    root = tmp_path / "set"
    for c, name in enumerate("abc"):
        (root / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray((rng.integers(0, 60, (16, 16, 3)) + 80 * c).astype(np.uint8)).save(root / name / f"{i}.png")
    return root


@pytest.fixture
def saved(tmp_path):
    """A saved 16x16 RGB model of the 3 classes a, b, c."""
    model = vitlab.create_model(MODEL, img_size=16, in_chans=3, num_classes=3)
    model.pretrained_cfg["label_names"] = ["a", "b", "c"]
    return vitlab.save(model, tmp_path / "model")


def edit_config(folder, **pretrained_cfg):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["pretrained_cfg"].update(pretrained_cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def commands(model, pngs, tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache"), "--threads", "1"]
    return {"eval": ["eval", str(model), "--data", str(pngs), *cache],
            "predict": ["predict", str(model), str(pngs / "a" / "0.png"), "--threads", "1"],
            "probe": ["probe", str(model), "--data", str(pngs), "--k", "3", *cache],
            "inspect": ["inspect", str(model), "--images", str(pngs / "a" / "0.png"), "--out", str(tmp_path / "i"),
                        "--threads", "1"]}


# ----------------------------------------------------------------------------------------------
# outputs that are not numbers are refused, never scored


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("command", ["eval", "predict", "probe", "inspect"])
def test_a_model_whose_outputs_are_not_finite_is_refused_by_every_command(tmp_path, capsys, pngs, value, command):
    model = vitlab.create_model(MODEL, img_size=16, in_chans=3, num_classes=3)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight[0, 0] = value  # every feature and every logit after it
    folder = vitlab.save(model, tmp_path / "broken")
    line = error_line(capsys, commands(folder, pngs, tmp_path)[command])
    assert "non-finite" in line and "NaN or Inf" in line and str(folder) in line or command == "inspect"
    assert "accepted:" in line
    assert not (tmp_path / "i" / "report.html").exists()


@pytest.mark.parametrize("field, value, says", [
    ("std", [0], "std is [0]"), ("std", [1.0, 0.0, 1.0], "each > 0"), ("mean", "abc", "mean is 'abc'"),
    ("mean", [0.5, 0.5], "3 finite numbers"), ("std", [True, 1, 1], "std is [true, 1, 1]"),
])
def test_a_mean_or_std_that_breaks_the_input_is_refused_naming_the_file_and_field(tmp_path, capsys, pngs, saved,
                                                                                   field, value, says):
    edit_config(saved, **{field: value})
    with pytest.raises(ValueError, match=f"config.json: pretrained_cfg {field} is"):
        vitlab.load(saved)
    for command in ("eval", "predict"):
        line = error_line(capsys, commands(saved, pngs, tmp_path)[command])
        assert str(saved / "config.json") in line and f"pretrained_cfg {field}" in line and "accepted: 3 finite" in line
        assert says.replace("true", "True") in line or says in line


def test_a_changed_feature_cache_is_computed_again(tmp_path, pngs, saved):
    from vitlab.probe.run import probe
    logs = []
    first = probe(saved, str(pngs), k=3, cache_dir=str(tmp_path / "cache"), progress=False, log=logs.append)
    caches = sorted((tmp_path / "cache" / "features").glob("features-*.safetensors"))
    assert caches
    features = {path: load_file(path)["features"] for path in caches}
    for path in caches:  # rewritten with NaN, the metadata (its key and checksum) kept
        meta = __import__("safetensors").safe_open(str(path), "pt").metadata()
        save_file({"features": torch.full_like(load_file(path)["features"], float("nan"))}, str(path), metadata=meta)
    logs.clear()
    again = probe(saved, str(pngs), k=3, cache_dir=str(tmp_path / "cache"), progress=False, log=logs.append)
    assert again["knn"] == first["knn"] and again["linear"] == first["linear"]
    assert all(torch.equal(load_file(path)["features"], f) for path, f in features.items())  # written again
    assert sum("does not match its checksum" in line for line in logs) == len(caches), logs
    logs.clear()
    probe(saved, str(pngs), k=3, cache_dir=str(tmp_path / "cache"), progress=False, log=logs.append)
    assert any("read from" in line for line in logs) and not any("checksum" in line for line in logs)


# ----------------------------------------------------------------------------------------------
# quoting a user's content


def test_a_csv_line_of_junk_is_quoted_cut_to_80_characters(tmp_path, capsys):
    junk = tmp_path / "junk.csv"
    junk.write_text("".join(chr(33 + i % 90) for i in range(3000)).replace(",", ";").replace('"', "'") + "\n")
    line = error_line(capsys, ["train", "--data", str(junk), "--out", str(tmp_path / "r")])
    assert "line 1: expected 'path,label', got \"!" in line and "…\" (2953 more characters)" in line
    assert len(line) < 300, len(line)


def test_quoted_content_is_cut_to_80_characters():
    assert quote("x" * 200) == "'" + "x" * 80 + "…' (120 more characters)"
    assert quote("short") == "'short'"
    line = clip_quotes(f"the model's file {'y' * 200!r} and its maker's")
    assert line == f"the model's file {quote('y' * 200)} and its maker's"


# ----------------------------------------------------------------------------------------------
# model folders whose files lie


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the values of every tensor a factory op (empty, zeros, ...) makes off the meta device."""

    def __init__(self):
        super().__init__()
        self.values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("empty", "zeros", "ones", "full", "rand")) and out.device.type != "meta":
            self.values += out.numel()
        return out


def test_a_config_far_larger_than_its_weights_is_refused_before_anything_is_allocated(tmp_path, capsys, saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model_args"].update(depth=12, embed_dim=512)  # 25 M values described, 0.1 M in the file
    (saved / "config.json").write_text(json.dumps(cfg))
    with Allocations() as made, pytest.raises(ValueError) as e:
        vitlab.load(saved)
    assert made.values < 1_000_000, made.values
    line = str(e.value)
    assert "config.json describes 25.28 M values, its weights hold 1" in line and "missing tensors" in line
    line = error_line(capsys, ["export", str(saved), "--to", "onnx", "--out", str(tmp_path / "x")])
    assert "does not fit a VisionTransformer" in line and not (tmp_path / "x").exists()


def test_a_sharded_index_without_its_weight_map_is_one_line(tmp_path, capsys, saved, pngs):
    (saved / "model.safetensors").rename(saved / "shard-1.safetensors")
    cfg = json.loads((saved / "config.json").read_text())
    del cfg["sha256"]
    (saved / "config.json").write_text(json.dumps(cfg))
    index = saved / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors"}}))
    assert vitlab.load(saved).num_classes == 3  # a good index loads
    for bad, says in (({"metadata": {}}, "'weight_map' is missing"), ({"weight_map": [1]}, "'weight_map' is [1]"),
                      ({"weight_map": {"x": "../elsewhere"}}, "'weight_map' is {'x': '../elsewhere'}")):
        index.write_text(json.dumps(bad))
        line = error_line(capsys, commands(saved, pngs, tmp_path)["predict"])
        assert f"{index}: {says}" in line and "accepted: an object mapping each tensor name to a shard" in line


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c", "d"], "abc", ["a", 2, "c"]])
def test_label_names_that_are_not_one_per_class_are_one_line(tmp_path, capsys, saved, pngs, names):
    edit_config(saved, label_names=names)
    line = error_line(capsys, commands(saved, pngs, tmp_path)["predict"])
    assert f"{saved / 'config.json'}: pretrained_cfg label_names holds" in line
    assert "for a model of 3 classes; accepted: 3 names" in line


def test_a_config_nested_beyond_reading_is_one_line(tmp_path, capsys, saved, pngs):
    (saved / "config.json").write_text("[" * 100_000)
    line = error_line(capsys, commands(saved, pngs, tmp_path)["predict"])
    assert f"{saved / 'config.json'} nests its JSON values deeper than vitlab reads" in line


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_symlink_loop_is_said_as_such_not_as_missing(tmp_path, capsys, saved, pngs, name):
    (saved / name).unlink()
    (saved / name).symlink_to(saved / name)
    line = error_line(capsys, commands(saved, pngs, tmp_path)["predict"])
    assert f"{saved / name} is a symlink loop" in line
    (saved / name).unlink()
    (saved / name).symlink_to(tmp_path / "gone")
    line = error_line(capsys, commands(saved, pngs, tmp_path)["predict"])
    assert f"{saved / name} is a symlink to {tmp_path / 'gone'}, which does not exist" in line


# ----------------------------------------------------------------------------------------------
# labels held to the classes, whatever the source


def parquet_set(path, labels, names=None):
    pytest.importorskip("pyarrow")
    from test_tables import png, write_parquet
    write_parquet(path, [(png(40 * (i % 3 + 1), i + 1), y) for i, y in enumerate(labels)], names)
    return path


def test_an_integer_label_far_beyond_the_others_is_refused_naming_its_row(tmp_path):
    path = parquet_set(tmp_path / "set.parquet", [0, 1, 2] * 3 + [1000])
    with pytest.raises(ValueError) as e:
        vitlab.data.load_data(str(path), img_size=8, cache_dir=str(tmp_path / "c"))
    assert "set.parquet row 9 has label 1000, which makes 1001 classes" in str(e.value)
    assert "997 of them with no image (e.g. 3, 4, 5)" in str(e.value) and "accepted: labels 0..K-1" in str(e.value)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").glob("*/store*"))


def test_a_label_beyond_the_class_names_is_refused_naming_its_row(tmp_path):
    path = parquet_set(tmp_path / "set.parquet", [0, 1, 2] * 3 + [7], names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"set.parquet row 9 has label 7, out of range for the 3 classes; "
                                         r"accepted: 0\.\.2"):
        vitlab.data.load_data(str(path), img_size=8, cache_dir=str(tmp_path / "c"))


def test_a_null_label_is_said_as_null_at_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from test_tables import png
    table = pa.table({"image": pa.array([{"bytes": png(40, i), "path": f"{i}.png"} for i in range(6)]),
                      "label": pa.array([0, 1, None, 0, 1, None], type=pa.int64())})
    pq.write_table(table, tmp_path / "set.parquet")
    with pytest.raises(ValueError) as e:
        vitlab.data.load_data(str(tmp_path / "set.parquet"), img_size=8, cache_dir=str(tmp_path / "c"))
    said = "set.parquet row 2 has a null label (2 of 6 rows have one); accepted: a label for every image"
    assert said in str(e.value)
    assert "label -1" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# images too large to decode


def bomb_png(path, side=20000):
    """A PNG of side x side black pixels (400 M for 20000) in 0.4 MB: a decompression bomb."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    z = zlib.compressobj(9)
    pixels = b"".join(z.compress(bytes(side + 1)) for _ in range(side)) + z.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


def test_an_image_beyond_the_decompression_bomb_limit_is_named_with_its_size(tmp_path, capsys, pngs, saved):
    big = bomb_png(pngs / "a" / "big.png")
    logs = []
    bundle = vitlab.data.load_data(str(pngs), img_size=16, cache_dir=str(tmp_path / "c"), log=logs.append)
    said = "20000x20000 pixels (400 M), over Pillow's decompression-bomb limit of 179 M pixels"
    assert any("skipped 1 unreadable files" in line and f"a/big.png ({said})" in line for line in logs), logs
    assert bundle.skipped == 1 and any(said in name for name in bundle.unreadable)
    line = error_line(capsys, ["predict", str(saved), str(big)])
    assert f"{big} is {said}; accepted: images of at most 179 M pixels" in line


# ----------------------------------------------------------------------------------------------
# pre-training takes the options it uses, and only those


def test_pretrain_help_lists_only_the_options_pretraining_uses(capsys):
    from vitlab.cli.options import flag
    from vitlab.train.recipe import PRETRAIN_TAKES, SUPERVISED_ONLY
    helps = {command: run_cli(capsys, [command, "--help"]).out for command in ("pretrain", "train")}
    listed = lambda text, name: f"{flag(name)} " in text or f"{flag(name)}\n" in text  # noqa: E731
    assert all(listed(helps["train"], name) for name in SUPERVISED_ONLY)
    taken = PRETRAIN_TAKES["distill"]  # the frozen backbone of pretrain distill
    assert taken == ("teacher",) and all(listed(helps["pretrain"], name) for name in taken)
    assert not [name for name in SUPERVISED_ONLY if name not in taken and listed(helps["pretrain"], name)]
    assert all(listed(helps["pretrain"], name) for name in ("epochs", "lr", "crop", "hflip", "val_fraction"))


@pytest.mark.parametrize("argv, named", [
    (["--mixup", "0.8"], "--mixup"), (["--tta"], "--tta"),
    (["--label-smoothing", "0.1", "--cutmix", "1"], "--cutmix, --label-smoothing"),
    (["--tau", "2", "--alpha", "0.3"], "--tau, --alpha"), (["--layer-decay", "0.7"], "--layer-decay"),
])
def test_supervised_options_given_to_pretrain_are_refused_naming_them(tmp_path, capsys, argv, named):
    line = error_line(capsys, ["pretrain", "--method", "mae", *argv, "--out", str(tmp_path / "r")])
    assert f"error: {named}: supervised training's, which pre-training does not use" in line
    assert "accepted: the options `vitlab pretrain --help` lists" in line and not (tmp_path / "r").exists()


@pytest.mark.parametrize("values, named", [({"mixup": 0.8}, "mixup"), ({"label_smoothing": 0.1}, "label_smoothing"),
                                           ({"tta": True}, "tta"), ({"tau": 3.0}, "tau")])
def test_a_pretraining_recipe_that_sets_a_supervised_option_is_refused(values, named):
    from vitlab.train.recipe import make_recipe
    with pytest.raises(ValueError, match=f"^{named}: not valid with pretrain='mae', which uses no labels"):
        make_recipe({"pretrain": "mae", "data": "cifar10", **values})
    assert make_recipe({"data": "cifar10", **values})  # the same values train a supervised run


def test_pretraining_can_hold_out_nothing_and_says_what_it_evaluates(tmp_path, cache_dir):
    from test_pretrain_run import flat_folder, tiny_pretrain

    from vitlab.train import train
    from vitlab.train.recipe import make_recipe
    lines = []
    summary = train(tiny_pretrain(str(flat_folder(tmp_path / "flat")), tmp_path / "run", val_fraction=0),
                    log=lines.append)
    assert summary["num_train"] == 30 and summary["num_test"] == 0 and np.isfinite(summary["test_loss"])
    assert any("val_fraction 0: no image is held out, so each evaluation measures the pre-training loss on the "
               "training images" in line for line in lines), lines
    with pytest.raises(ValueError, match="val_fraction=0 holds no image out, and a supervised run needs test images"):
        make_recipe({"data": "cifar10", "val_fraction": 0})


# ----------------------------------------------------------------------------------------------
# another library's config.json with a field of the wrong kind


@pytest.mark.parametrize("kind, field, value", [
    ("hf_vit", "id2label", "abc"), ("hf_vit", "id2label", [1]), ("hf_vit", "id2label", -5),
    ("hf_vit", "num_hidden_layers", None), ("hf_vit", "num_hidden_layers", [1]), ("hf_vit", "image_size", {"a": 1}),
    ("hf_vit", "image_size", 1e309), ("hf_vit", "hidden_size", "<missing>"),
    ("timm_vit_token", "label_names", -5), ("timm_vit_token", "label_names", 1e309),
])
def test_a_foreign_config_field_of_the_wrong_kind_is_one_line(tmp_path, capsys, pngs, kind, field, value):
    from conftest import PARITY
    if not (PARITY / kind).is_dir():
        pytest.skip(f"the parity fixtures are not here ({PARITY})")
    folder = tmp_path / kind
    shutil.copytree(PARITY / kind, folder)
    cfg = json.loads((folder / "config.json").read_text())
    if value == "<missing>":
        del cfg[field]
    else:
        cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    line = error_line(capsys, ["predict", str(folder), str(pngs / "a" / "0.png"), "--threads", "1"])
    assert f"{folder / 'config.json'}" in line


def test_files_nested_beyond_reading_are_one_line_wherever_they_are_read(tmp_path, capsys, saved, pngs, monkeypatch):
    from conftest import PARITY
    recipe = tmp_path / "deep.yaml"
    recipe.write_text("epochs: " + "[" * 100_000)
    line = error_line(capsys, ["train", "--config", str(recipe), "--out", str(tmp_path / "r")])
    assert f"recipe {recipe} nests its YAML values deeper than vitlab reads" in line
    if (PARITY / "hf_vit").is_dir():
        shutil.copytree(PARITY / "hf_vit", tmp_path / "hf")
        (tmp_path / "hf" / "preprocessor_config.json").write_text("[" * 100_000)
        line = error_line(capsys, ["predict", str(tmp_path / "hf"), str(pngs / "a" / "0.png")])
        assert f"{tmp_path / 'hf' / 'preprocessor_config.json'} nests its JSON values deeper" in line

    def deep(*args, **kwargs):  # any other reader: the command line's last guard says it in one line
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(vitlab.checkpoint, "read_model_config", deep)
    line = error_line(capsys, ["predict", str(saved), str(pngs / "a" / "0.png")])
    assert "an input file nests deeper than vitlab reads" in line


def test_nonfinite_rows_counts_rows_with_a_nan_or_an_inf_and_no_large_finite_row():
    from vitlab.finite import nonfinite_rows
    x = torch.randn(6, 3, 2)
    x[1, 2, 0] = float("nan")
    x[3, 0, 1] = float("inf")
    x[4, :, :] = 3e38  # a sum in float32 would overflow
    x[5, 0, 0], x[5, 1, 0] = float("inf"), float("-inf")
    assert int(nonfinite_rows(x)) == 3
    assert nonfinite_rows(x).dtype == torch.long
