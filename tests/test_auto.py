"""The recipe chosen when no model is named (train/auto.py and its rule table auto.yaml): which row data of given
facts gets, how the rules fit it to the images, channels and budget, that options given by name win, and that a run
logs the choice in one line and records it in config.yaml and summary.json."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import benchmark

import vitlab
from vitlab.runs.format import read_config
from vitlab.train.auto import Facts, auto_values, choose, choose_row, read_table, stem_widths, wanted

ROOT = Path(__file__).resolve().parents[1]


def facts(side=32, channels=3, n=50000, test=10000, classes=10, balance=1.0) -> Facts:
    return Facts(side, side, channels, n, test, classes, balance)


@pytest.mark.parametrize("side,row", [(8, "micro"), (16, "micro"), (17, "hybrid"), (28, "hybrid"), (32, "hybrid"),
                                      (64, "hybrid"), (96, "hybrid")])
def test_the_row_follows_the_image_size(side, row):
    assert choose_row(facts(side))["name"] == row


@pytest.mark.parametrize("side,widths", [(17, [64, 256]), (28, [64, 256, 256]), (32, [64, 256, 256]),
                                         (64, [64, 128, 256, 256]), (96, [64, 128, 256, 256]),
                                         (224, [64, 128, 128, 128, 256, 256])])
def test_the_hybrid_stem_brings_the_grid_to_five_or_less(side, widths):
    assert stem_widths(side, read_table()["rows"][1]["stem"]) == widths
    grid = side - 1
    for _ in widths:
        grid //= 2
    assert 1 <= grid <= 5


def test_cifar_shaped_data_gets_the_speed_run_recipe():
    speedrun = __import__("yaml").safe_load((ROOT / "recipes" / "cifar10_hybrid_speedrun.yaml").read_text())
    c = choose(facts(), {})
    assert c.row == "hybrid" and c.values["model"] == speedrun["model"] and c.values["epochs"] == speedrun["epochs"]
    assert c.values["model_args"]["stem_widths"] == speedrun["model_args"]["stem_widths"]
    flat = {**c.values, **c.values["augment"]}
    for key in ("batch_size", "lr", "weight_decay", "label_smoothing", "crop", "tta", "tta_translate",
                "progressive_scale", "lookahead_every"):
        assert flat[key] == speedrun[key], key


def test_digits_shaped_data_gets_the_digits_recipe():
    c = choose(facts(8, 1, 1437, 360), {})
    assert c.values["model"] == "vit_micro_patch2_8" and c.values["model_args"] == {}  # the model's own 8x8, patch 2
    assert c.values["epochs"] == 50 and c.values["batch_size"] == 32 and c.values["lr"] == 0.005
    assert c.values["augment"]["crop"] == "none" and c.values["augment"]["cutmix"] == 1.0


def test_a_few_hundred_images_get_a_smaller_batch_and_its_lr():
    c = choose(facts(64, 3, 400, 200, classes=2), {})
    assert c.values["batch_size"] == 32 and c.values["lr"] == pytest.approx(0.003 * (32 / 256) ** 0.5, rel=1e-2)
    assert c.values["epochs"] == 200  # the row's most: its target images would take 1,250 epochs of 400
    assert c.values["model_args"]["stem_widths"] == [64, 128, 256, 256] and c.values["img_size"] == 64


def test_greyscale_is_not_mirrored_and_keeps_one_channel():
    c = choose(facts(28, 1, 10000, 2000), {})
    assert c.values["augment"]["hflip"] is False and c.values["model_args"]["in_chans"] == 1
    assert "no mirror flips" in c.reason


def test_options_given_by_name_win():
    c = choose(facts(), {"lr": 0.01, "hflip": False, "model_args": {"depth": 4}, "epochs": 3, "batch_size": 64})
    assert "lr" not in c.values and "epochs" not in c.values and "batch_size" not in c.values
    assert "hflip" not in c.values["augment"]
    assert c.values["model_args"]["depth"] == 4 and c.values["model_args"]["stem_widths"] == [64, 256, 256]
    assert "given: batch_size, epochs, lr, model_args, hflip" in c.reason


def test_a_budget_drops_the_test_time_views_the_final_evaluation_cannot_afford():
    slow = choose(facts(), {"time_budget": 10}, {"train": 54, "eval": 200})  # 6 views: 300 s, 2: 100 s, 1: 50 s
    assert slow.values["tta"] is False and slow.values["tta_translate"] == 0
    assert "final evaluation 50 s with 1 view" in slow.reason and "is 0.65 epochs" in slow.reason
    mid = choose(facts(), {"time_budget": 30}, {"train": 54, "eval": 200})  # 180 s may go to it: 2 views
    assert mid.values["tta"] is True and mid.values["tta_translate"] == 0
    fast = choose(facts(), {"time_budget": 10}, {"train": 500, "eval": 2000})
    assert fast.values["tta"] is True and fast.values["tta_translate"] == 1
    given = choose(facts(), {"time_budget": 10, "tta": True}, {"train": 54, "eval": 200})
    assert "tta" not in given.values  # given: kept, however long it takes


def test_the_choice_is_wanted_only_without_a_model():
    assert wanted({"data": "digits"}) and wanted({"model": "auto"})
    assert not wanted({"model": "vit_micro_patch2_8"}) and not wanted({"init": "runs/x"})
    assert not wanted({"pretrain": "mae"})


def test_auto_values_logs_one_line_and_records_the_choice():
    lines = []
    values = auto_values({"data": "digits", "epochs": 2}, lines.append,
                         measure=lambda values, facts, threads=None: {"train": 100.0, "eval": 400.0})
    assert len(lines) == 1 and lines[0].startswith("auto: vit_micro_patch2_8 (") and "row 'micro'" in lines[0]
    assert values["model"] == "vit_micro_patch2_8" and values["epochs"] == 2
    assert values["auto"]["row"] == "micro" and values["auto"]["facts"]["num_train"] == 1437
    untouched = {"data": "digits", "model": "vit_micro_patch2_8"}
    assert auto_values(untouched, lines.append) is untouched and len(lines) == 1


def test_fit_with_data_alone_records_the_choice(tmp_path, capsys):
    d = np.load(Path(vitlab.__file__).parent / "data" / "digits.npz")
    x, y = d["images"][:300, ..., None], d["labels"][:300]
    result = vitlab.fit(data=(x, y), out=tmp_path / "run", epochs=1, threads=1, cache_dir=str(tmp_path / "cache"))
    auto = result.summary["auto"]
    assert auto["row"] == "micro" and auto["rate"] > 0 and "given: epochs" in auto["reason"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["auto"] == auto
    assert read_config(tmp_path / "run")["auto"]["row"] == "micro"
    assert result.summary["model"] == "vit_micro_patch2_8"
    assert sum(line.startswith("auto: ") for line in capsys.readouterr().err.splitlines()) == 1


@pytest.mark.slow
def test_the_benchmark_runs_a_quick_cell(tmp_path):
    bench = benchmark("fit_auto")
    assert bench.main(["--quick", "--cells", "digits8@2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    arms = results["digits8@2 (quick)"]["arms"]
    assert set(arms) == {"auto", "generic", "row:hybrid"}
    assert arms["auto"]["auto"] == "micro" and all("top1" in r for r in arms.values()), arms
