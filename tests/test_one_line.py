"""Rough edges a newcomer meets, each one class of input: a one-line message naming the option and what it
accepts (exit 2, or 1 where the file system failed the work), no traceback, and the user's files unchanged."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import checksums, error_line, run_cli

import vitlab
from vitlab.train.recipe import make_recipe

TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]


# ----------------------------------------------------------------------------------------------
# recipe files get the command line's strict types


@pytest.mark.parametrize("values, option", [
    ({"epochs": True}, "epochs"), ({"lr": False}, "lr"), ({"img_size": True}, "img_size"),
    ({"tta": 1}, "tta"), ({"hflip": 0}, "hflip"), ({"augment": {"mixup": True}}, "mixup"),
])
def test_a_recipe_file_refuses_true_for_a_number_and_a_number_for_true(tmp_path, capsys, values, option):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    before = checksums(tmp_path)
    line = error_line(capsys, ["train", "--config", str(recipe), "--out", str(tmp_path / "run")])
    assert f"{option}=" in line and "accepted:" in line
    assert checksums(tmp_path) == before and not (tmp_path / "run").exists()


def test_the_command_line_and_a_recipe_file_agree_on_what_a_number_is():
    assert make_recipe({"epochs": "3"}).epochs == make_recipe({"epochs": 3}).epochs == 3
    for bad in (True, "true", 1.5):
        with pytest.raises(ValueError, match="epochs="):
            make_recipe({"epochs": bad})


# ----------------------------------------------------------------------------------------------
# model arguments that cannot build a model


BAD_MODEL_ARGS = [("depth", "six", "an integer"), ("num_heads", 0, "an integer > 0"),
                  ("embed_dim", -8, "an integer > 0"), ("mlp_ratio", float("nan"), "a finite number"),
                  ("qkv_bias", 1, "true or false"), ("img_size", [8, 8, 8], "a pair"),
                  ("drop_path_rate", 2.0, "[0, 1)")]


@pytest.mark.parametrize("name, value, accepted", BAD_MODEL_ARGS)
def test_a_model_argument_of_the_wrong_kind_or_range_is_one_line_naming_it(tmp_path, capsys, name, value, accepted):
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    argv = ["train", *TINY, "--model-arg", f"{name}={text}", "--out", str(tmp_path / "a")]
    line = error_line(capsys, argv)
    assert f"model argument {name}=" in line and accepted in line
    recipe = tmp_path / "r.yaml"  # the same in a recipe file
    recipe.write_text(yaml.safe_dump({"model": "vit_micro_patch2_8", "model_args": {name: value}}))
    line = error_line(capsys, ["train", "--config", str(recipe), "--out", str(tmp_path / "b")])
    assert f"model argument {name}=" in line and accepted in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("name, value, accepted", BAD_MODEL_ARGS)
def test_a_saved_models_bad_argument_is_one_line(tmp_path, name, value, accepted):
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2),
                         tmp_path / "model")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_args"][name] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    before = checksums(folder)
    with pytest.raises(ValueError) as e:
        vitlab.load(folder)
    assert name in str(e.value) and "\n" not in str(e.value)
    assert checksums(folder) == before


def test_arguments_valid_alone_that_do_not_build_together_are_one_line():
    with pytest.raises(ValueError, match="embed_dim 10 is not divisible by num_heads 3"):
        vitlab.create_model("vit_micro_patch2_8", embed_dim=10, num_heads=3)
    with pytest.raises(ValueError, match=r"^VisionTransformer cannot be built with init_values='x' \(") as e:
        vitlab.create_model("vit_micro_patch2_8", init_values="x")  # any kind of value: a default of None
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# --resume with an option value that is no number


def test_resume_with_a_bad_epochs_value_names_the_option(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(make_recipe({"epochs": 2, "out": str(run)}).to_dict()))
    before = checksums(run)
    for value in ("abc", "0", "nan"):
        line = error_line(capsys, ["train", "--resume", str(run), "--epochs", value])
        assert line.startswith("vitlab train: error: --epochs ") and value in line, line
        assert line.endswith("is not valid on --resume; accepted: a number >= 1 (the epochs done)"), line
    assert checksums(run) == before


# ----------------------------------------------------------------------------------------------
# a Hugging Face folder without preprocessor_config.json


def test_a_hf_folder_without_its_preprocessor_is_decoded_as_its_model_type_publishes(tmp_path, capsys, cache_dir):
    from vitlab.export import export_hf
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=16, depth=1, num_heads=2, num_classes=10)
    folder = export_hf(model, tmp_path / "hf")
    (folder / "preprocessor_config.json").unlink()  # what save_pretrained of a model alone writes
    before = checksums(folder)
    cfg = vitlab.load(folder).pretrained_cfg
    assert (cfg["mean"], cfg["std"], cfg["crop_mode"], cfg["interpolation"]) == ((0.5,) * 3, (0.5,) * 3, "squash",
                                                                                 "bilinear")
    assert "has no preprocessor_config.json" in cfg["preprocess_from"] and "model_type vit" in cfg["preprocess_from"]
    code, err, out = run_cli(capsys, ["train", "--init", str(folder), "--data", "digits", "--epochs", "1",
                                      "--batch-size", "256", "--threads", "1", "--precision", "fp32",
                                      "--train-fraction", "0.1", "--out", str(tmp_path / "run")])
    log = "\n".join([out, err])
    assert code == 0, log
    (line,) = [x for x in log.splitlines() if "images are decoded as" in x]
    assert "model_type vit" in line and "resized to 32x32 (bilinear)" in line and "mean 0.5, 0.5, 0.5" in line
    assert checksums(folder) == before


@pytest.mark.parametrize("model_type, mean, crop_mode, crop_pct", [
    ("dinov2", (0.485, 0.456, 0.406), "center", 224 / 256), ("dinov2_with_registers", (0.485, 0.456, 0.406),
                                                             "center", 224 / 256),
    ("clip_vision_model", (0.48145466, 0.4578275, 0.40821073), "center", 1.0), ("siglip_vision_model", (0.5,) * 3,
                                                                                "squash", 1.0),
    ("deit", (0.485, 0.456, 0.406), "squash", 224 / 256), ("vit", (0.5,) * 3, "squash", 1.0)])
def test_each_model_types_published_preprocessing(tmp_path, model_type, mean, crop_mode, crop_pct):
    from vitlab.data.views import Preprocess
    from vitlab.interop.hf import preprocessing
    keys = preprocessing(tmp_path, {"model_type": model_type, "image_size": 224})
    prep = Preprocess.from_cfg({"input_size": (3, 224, 224), **keys})
    assert (prep.mean, prep.crop_mode, prep.interpolation) == (mean, crop_mode,
                                                               "bilinear" if model_type == "vit" else "bicubic")
    assert prep.crop_pct == pytest.approx(crop_pct, abs=1e-6) and model_type in keys["preprocess_from"]


# ----------------------------------------------------------------------------------------------
# a mistyped option gets the closest ones, as a mistyped model name does


@pytest.mark.parametrize("argv, meant", [
    (["train", "--layer-decy", "0.7"], "--layer-decay"), (["eval", "run", "--batchsize", "8"], "--batch-size"),
    (["predict", "run", "x.png", "--topk", "3"], "--top-k"), (["cache", "clean", "--dryrun"], "--dry-run")])
def test_a_mistyped_option_gets_a_suggestion(capsys, argv, meant):
    line = error_line(capsys, argv)
    assert f"unrecognized arguments: {' '.join(argv[-2:]) if argv[-1][0] != '-' else argv[-1]}" in line
    assert f"did you mean {meant}?" in line


def test_an_unknown_option_far_from_any_names_none(capsys):
    line = error_line(capsys, ["train", "--zzzzzz"])
    assert "did you mean" not in line and "`vitlab train --help` lists them" in line


# ----------------------------------------------------------------------------------------------
# a missing optional package, a dangling --out link


def test_an_onnx_export_without_the_onnx_package_names_what_to_install(tmp_path, capsys, monkeypatch):
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2),
                         tmp_path / "model")
    before = checksums(folder)
    monkeypatch.setitem(__import__("sys").modules, "onnx", None)  # import onnx fails as where it is not installed
    line = error_line(capsys, ["export", str(folder), "--to", "onnx", "--out", str(tmp_path / "onnx")])
    assert "needs the onnx package" in line and "pip install 'vitlab[onnx]'" in line
    assert checksums(folder) == before and not (tmp_path / "onnx").exists()


def test_any_missing_package_is_one_line_naming_it(capsys, monkeypatch):
    from vitlab.cli import build_parser

    def needs_a_package(args):
        raise ModuleNotFoundError("No module named 'tensorboard'", name="tensorboard")
    parser = build_parser()
    monkeypatch.setattr("vitlab.cli.build_parser", lambda *args: parser)
    parser._subparsers._group_actions[0].choices["models"].set_defaults(func=needs_a_package)
    line = error_line(capsys, ["models"])
    assert "'tensorboard'" in line and "pip install tensorboard" in line


@pytest.mark.parametrize("command", [["train", *TINY, "--epochs", "1"], ["inspect", "vit_micro_patch2_8"]])
def test_a_dangling_out_link_is_one_line(tmp_path, capsys, command):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone" / "nowhere")
    line = error_line(capsys, [*command, "--out", str(link)])
    assert f"--out {link} is a symbolic link to {tmp_path / 'gone' / 'nowhere'}, which does not exist" in line
    assert link.is_symlink() and not (tmp_path / "gone").exists()


# ----------------------------------------------------------------------------------------------
# data: an image listed twice, a class with no readable image


def _images(root, classes=("a", "b"), per_class=4):
    from test_faults import make_folder
    return make_folder(root, classes=classes, per_class=per_class, size=(8, 8))


def test_a_csv_listing_an_image_twice_uses_it_once_and_says_so(tmp_path, capsys):
    from vitlab.data import load_data
    _images(tmp_path / "pets")
    lines = [f"pets/{c}/{i}.bmp,{c}" for c in "ab" for i in range(4)]
    (tmp_path / "list.csv").write_text("\n".join([*lines, lines[0], lines[5], f"./pets/a/../a/{0}.bmp,a"]) + "\n")
    before = checksums(tmp_path)
    logs = []
    bundle = load_data(str(tmp_path / "list.csv"), cache_dir=tmp_path / "c", val_fraction=0.5, log=logs.append)
    assert len(bundle.train.labels) + len(bundle.test.labels) == 8  # each image once: never in both splits
    (said,) = [x for x in logs if "already listed removed" in x]
    assert "3 lines" in said and "line 9 repeats line 1" in said
    (tmp_path / "list.csv").write_text("\n".join([*lines, "pets/a/0.bmp,b"]) + "\n")  # another label: refused
    line = error_line(capsys, ["train", *TINY, "--data", str(tmp_path / "list.csv"), "--cache-dir",
                                   str(tmp_path / "c"), "--out", str(tmp_path / "run")])
    assert "line 9 lists pets/a/0.bmp as 'b', line 1 as 'a'" in line and not (tmp_path / "run").exists()
    assert {k: v for k, v in checksums(tmp_path).items() if k.startswith("pets")} == \
        {k: v for k, v in before.items() if k.startswith("pets")}


def test_a_class_with_no_readable_image_is_refused(tmp_path, capsys):
    root = _images(tmp_path / "pets", classes=("a", "b", "c"))
    for f in (root / "c").iterdir():
        f.write_bytes(b"not an image")
    before = checksums(root)
    argv = ["train", *TINY, "--data", str(root), "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "r")]
    for _ in range(2):  # built, then from the cache
        line = error_line(capsys, argv, after_log=True)
        assert "class 'c' has no readable image" in line and "fix the files or remove the class" in line
    assert checksums(root) == before and not (tmp_path / "r").exists()


def test_a_class_folder_whose_name_is_not_utf8_trains_draws_and_resumes(tmp_path, capsys):
    import os
    root = _images(tmp_path / "pets", classes=("a", "b"))
    os.rename(bytes(root / "b"), bytes(root) + b"/caf\xe9")  # a name written on a Latin-1 system
    run = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(root), "--epochs", "1", "--val-fraction", "0.5", "--cache-dir",
            str(tmp_path / "c"), "--out", str(run)]
    code, err, out = run_cli(capsys, argv)
    assert code == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert "caf\\xe9" in summary["per_class"] and (run / "confusion.png").stat().st_size > 0
    (run / "summary.json").unlink()  # as if killed before the end: the resume draws the figures again
    code, err, _ = run_cli(capsys, ["train", "--resume", str(run)])
    assert code == 0, err


# ----------------------------------------------------------------------------------------------
# --threads for every command that runs a model; probe at another input size


@pytest.mark.parametrize("command", [["eval", "M"], ["predict", "M", "x.png"], ["inspect", "M"],
                                     ["export", "M", "--to", "hf", "--out", "o"], ["probe", "M"]])
def test_every_command_that_runs_a_model_takes_threads(command):
    from vitlab.cli import build_parser
    assert build_parser().parse_args([*command, "--threads", "3"]).threads == 3


def test_threads_sets_the_cpu_threads_of_the_forward_passes(tmp_path, capsys):
    import torch
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2),
                         tmp_path / "model")
    threads = torch.get_num_threads()
    try:
        code, err, _ = run_cli(capsys, ["export", str(folder), "--to", "timm", "--out", str(tmp_path / "t"),
                                        "--threads", "1"])
        assert code == 0 and torch.get_num_threads() == 1, err
    finally:
        torch.set_num_threads(threads)


def test_probe_runs_a_model_at_another_input_size(tmp_path):
    from vitlab.probe.run import open_model
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2),
                         tmp_path / "model")
    for spec in (folder, "vit_micro_patch2_8"):
        model, _ = open_model(spec, img_size=16)
        assert tuple(model.pretrained_cfg["input_size"][1:]) == (16, 16)


# ----------------------------------------------------------------------------------------------
# predict: one unreadable file among good ones


def test_predict_predicts_the_readable_files_and_reports_the_others(tmp_path, capsys):
    from PIL import Image
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2),
                         tmp_path / "model")
    good = [tmp_path / f"{i}.png" for i in range(2)]
    for i, p in enumerate(good):
        Image.new("L", (8, 8), 40 * i).save(p)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    before = checksums(tmp_path)
    code, err, out = run_cli(capsys, ["predict", str(folder), str(good[0]), str(bad), str(good[1]), "--top-k", "2"])
    assert code == 1 and out.count("%") == 4 and f"{bad}  (not predicted: unreadable)" in out
    err = err.splitlines()
    assert len(err) == 2 and str(bad) in err[0] and err[1].startswith("vitlab predict: 1 of 3 images")
    code, err, out = run_cli(capsys, ["predict", str(folder), str(good[0]), str(bad), "--json"])
    results = json.loads(out)
    assert code == 1 and "top" in results[0] and "error" in results[1] and "top" not in results[1]
    line = error_line(capsys, ["predict", str(folder), str(bad)])  # nothing readable: refused
    assert str(bad) in line
    assert checksums(tmp_path) == before


def test_predict_in_batches_gives_each_file_its_own_answer_in_order(tmp_path, capsys):
    from PIL import Image

    from vitlab.infer.predict import predict_files
    torch.manual_seed(0)
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2,
                                             num_classes=5), tmp_path / "model")
    files = []
    for i in range(7):
        files.append(tmp_path / f"{i}.png")
        if i in (2, 3):  # a whole batch of two unreadable between readable ones
            files[-1].write_bytes(b"not a png")
        else:
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (8, 8), dtype=np.uint8)).save(files[-1])
    def same(results, expected):  # each file in its place, its classes in order, the probabilities within 1e-5
        def names(rs):
            return [(r["image"], [p["class"] for p in r.get("top", [])]) for r in rs]

        def probabilities(rs):
            return [p["probability"] for r in rs for p in r.get("top", [])]
        return names(results) == names(expected) and np.allclose(probabilities(results), probabilities(expected),
                                                                 atol=1e-5)

    whole = predict_files(folder, files, top_k=5, batch_size=16, precision="fp32")
    for batch in (1, 2, 3):
        assert same(predict_files(folder, files, top_k=5, batch_size=batch, precision="fp32"), whole)
    assert [("error" in r, r["image"]) for r in whole] == [(i in (2, 3), str(f)) for i, f in enumerate(files)]
    assert len({r["top"][0]["probability"] for r in whole if "top" in r}) > 1  # the images differ in answers
    code, err, out = run_cli(capsys, ["predict", str(folder), *map(str, files), "--batch-size", "2", "--json"])
    assert code == 1 and same(json.loads(out), whole)
    assert "predict" in err and "7/7" in err  # more files than one batch: a progress bar on stderr, stdout clean
    line = error_line(capsys, ["predict", str(folder), str(files[0]), "--batch-size", "0"])
    assert "--batch-size" in line and "accepted: an integer >= 1" in line


# ----------------------------------------------------------------------------------------------
# inspect says what it wrote; its files are written whole


def test_inspect_shows_its_progress_and_names_only_the_files_it_wrote(tmp_path, capsys):
    from PIL import Image
    encoder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2,
                                              num_classes=0), tmp_path / "encoder")  # no classes: no faithfulness
    Image.new("L", (8, 8), 50).save(tmp_path / "x.png")
    code, err, out = run_cli(capsys, ["inspect", str(encoder), "--images", str(tmp_path / "x.png"), "--out",
                                      str(tmp_path / "o"), "--threads", "1"])
    assert code == 0, err
    assert "faithfulness.json" not in out and "analysis.json" in out
    assert not (tmp_path / "o" / "faithfulness.json").exists()
    from vitlab.analysis.sections import SECTIONS
    n = len(SECTIONS)  # its progress, section by section, with the time left
    assert any(line.startswith("inspect: 100%") and f"{n}/{n} [" in line and "<00:00" in line
               for line in err.splitlines()), err


def test_a_full_disk_while_writing_a_figure_or_json_keeps_the_old_file_and_is_one_line(tmp_path, monkeypatch):
    import errno

    from vitlab.analysis.plots import new_figure, save_figure
    from vitlab.analysis.report import write_report
    old = tmp_path / "fig.png"
    old.write_bytes(b"the previous figure")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    fig = new_figure(2, 2)
    monkeypatch.setattr(type(fig), "savefig", full)
    with pytest.raises(ValueError, match=r"^disk full: writing .*fig\.png") as e:
        save_figure(fig, old)
    assert "\n" not in str(e.value) and old.read_bytes() == b"the previous figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png"]  # no 0-byte or temporary file left
    monkeypatch.setattr("vitlab.atomic.os.fsync", full)
    with pytest.raises(ValueError, match=r"^disk full: writing .*report\.html"):
        write_report(tmp_path, "t", "", [], [], [], [], None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png"]


def test_the_files_a_run_skipped_are_in_its_summary(tmp_path, capsys):
    from vitlab.runs.format import read_summary
    root = _images(tmp_path / "pets")
    (root / "a" / "9.bmp").write_bytes(b"not an image")
    run = tmp_path / "run"
    code, err, _ = run_cli(capsys, ["train", *TINY, "--data", str(root), "--epochs", "1", "--val-fraction", "0.5",
                                    "--cache-dir", str(tmp_path / "c"), "--out", str(run)])
    assert code == 0, err
    assert read_summary(run).unreadable == ["a/9.bmp"]


def test_a_refused_out_names_the_command_that_trains_that_run(tmp_path):
    from vitlab.runs.format import check_out_dir, write_config_values
    for pretrain, command in (("mae", "vitlab pretrain"), ("none", "vitlab train")):
        out = tmp_path / pretrain
        out.mkdir()
        write_config_values(out, make_recipe({"out": str(out)}).to_dict() | {"pretrain": pretrain})
        (out / "checkpoint.pt").write_bytes(b"")
        with pytest.raises(ValueError, match=f"continue it with `{command} --resume {out}`"):
            check_out_dir(out, resume=False)


def test_probe_with_a_cache_that_takes_no_writes(tmp_path, capsys, monkeypatch):
    """A cache folder that takes no writes: one line saying so; one whose features folder cannot be made: the probe
    runs, its features computed and not kept (said)."""
    import errno
    from pathlib import Path
    cache = tmp_path / "c"
    argv = ["probe", "vit_micro_patch2_8", "--data", "digits", "--cache-dir", str(cache), "--threads", "1"]

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    with monkeypatch.context() as m:
        m.setattr(Path, "touch", read_only)
        line = error_line(capsys, argv)
    assert "cannot write the data cache" in line and "read-only file system" in line and "Errno" not in line
    monkeypatch.setattr("vitlab.probe.features.make_owned_folder", read_only)  # the features' folder refused
    code, err, out = run_cli(capsys, argv)
    assert code == 0 and "features not cached" in err, err
    assert "linear probe" in out and not (cache / "features").exists()
