"""The command line: one module per command group, shared options made from their one declaration."""
import argparse
import typing

import pytest
from conftest import error_line

from vitlab.cli import build_parser, main
from vitlab.devices import Device, Precision


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def option(command: str, flag: str) -> argparse.Action:
    return next(a for a in commands()[command]._actions if flag in a.option_strings)


def test_every_command_of_before_is_there():
    assert list(commands()) == ["models", "train", "pretrain", "eval", "predict", "probe", "export", "compare",
                                "study", "inspect", "data", "cache"]


def test_vitlab_help_lists_every_command_as_the_full_parser_does_without_importing_them(monkeypatch):
    import os
    import subprocess
    import sys
    code = ("import sys\nfrom vitlab.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'numpy')))")
    env = {**os.environ, "COLUMNS": "100"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    listing, imported = out.rstrip("\n").rsplit("\n", 1)
    monkeypatch.setenv("COLUMNS", "100")
    assert imported == "[]" and listing + "\n" == build_parser().format_help()
    assert all(f"    {name} " in listing for name in commands())


@pytest.mark.parametrize("command, flag, default", [
    ("eval", "--precision", "auto"), ("train", "--precision", None),  # train: None = the recipe's default
    ("predict", "--precision", "auto"), ("probe", "--precision", "auto"), ("inspect", "--precision", "auto"),
    ("eval", "--batch-size", None), ("inspect", "--batch-size", 64),  # eval: None = 64 on a CPU, 256 on a GPU
    ("eval", "--device", "auto"),
    ("predict", "--device", "auto"), ("inspect", "--device", "auto"), ("study", "--data", "cifar10"),
    ("study", "--epochs", None), ("eval", "--download", False), ("eval", "--tta", False),
])
def test_each_command_keeps_its_defaults(command, flag, default):
    assert option(command, flag).default == default


@pytest.mark.parametrize("argv", [
    ["eval", "m", "--data", "d", "--precision", "half"], ["train", "--precision", "half"],
    ["predict", "m", "x.png", "--device", "tpu"], ["inspect", "m", "--device", "tpu"],
])
def test_a_shared_option_accepts_what_its_one_declaration_says(argv, capsys):
    """The words a command accepts come from the recipe's Literal; a bad one is one line and exit status 2."""
    err = error_line(capsys, argv)
    words = ", ".join(typing.get_args(Precision if "--precision" in argv else Device))
    assert words in err, err


def test_a_shared_option_is_checked_as_the_recipe_checks_it(capsys):
    for argv in (["eval", "m", "--data", "d", "--batch-size", "0"], ["inspect", "m", "--batch-size", "x"],
                 ["study", "pos-embed", "--threads", "0"]):
        assert "accepted: an integer >= 1" in error_line(capsys, argv)
    args = build_parser().parse_args(["eval", "m", "--data", "d", "--batch-size", "7", "--precision", "bf16",
                                      "--no-tta"])
    assert (args.batch_size, args.precision, args.tta) == (7, "bf16", False)


def test_a_command_line_that_names_no_command_prints_the_help(capsys):
    assert main([]) == 2
    assert capsys.readouterr().out.startswith("usage: vitlab")


def test_python_m_vitlab_and_the_console_script_reach_the_same_main():
    from pathlib import Path

    import vitlab.cli
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '\nvitlab = "vitlab.cli:main"\n' in pyproject and vitlab.cli.main is main
    source = (Path(vitlab.cli.__file__).parents[1] / "__main__.py").read_text()
    assert "from .cli import main" in source


def test_null_on_the_command_line_takes_a_recipe_s_value_away(tmp_path, capsys):
    """``--time-budget null`` sets the field to None, as ``time_budget: null`` does in a recipe (an option not given
    leaves the recipe's value); on a field that takes no none, it is the recipe's one-line refusal."""
    from vitlab.cli.train import recipe_of
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: digits\ntime_budget: 30\nrandom_erasing: 0.25\n")  # epochs beside it: never used

    def loaded(*argv: str):
        return recipe_of(build_parser().parse_args(["train", "--config", str(recipe), *argv]))
    assert loaded().time_budget == 30
    assert loaded("--time-budget", "null", "--epochs", "13").time_budget is None
    assert loaded("--time-budget", "~").time_budget is None and loaded("--time-budget", "7").time_budget == 7
    assert loaded("--crop", "none").augment.crop == "none"  # a word of the field's own, not YAML's none
    capsys.readouterr()  # the "auto:" lines of the recipes above (no model named: chosen for the data)
    err = error_line(capsys, ["train", "--config", str(recipe), "--epochs", "null", "--out", str(tmp_path / "x")])
    assert "epochs" in err and "accepted: an integer >= 1" in err, err
    assert not (tmp_path / "x").exists()


def test_top_k_is_named_after_the_classes_there_are(tmp_path, cache_dir, capsys):
    import numpy as np
    from PIL import Image

    import vitlab
    from vitlab.cli.train import result_line
    for c in "abc":
        for i in range(4):
            (tmp_path / "set" / c).mkdir(parents=True, exist_ok=True)
            pixels = np.full((16, 16, 3), 60 * "abc".index(c) + i, np.uint8)
            Image.fromarray(pixels).save(tmp_path / "set" / c / f"{i}.png")
    model = vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=3), tmp_path / "m")
    assert main(["eval", str(model), "--data", str(tmp_path / "set"), "--threads", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "top-3 100.00%" in line and "top-5" not in line  # three classes: every prediction is in the top 3
    summary = {"top1": 0.5, "top5": 1.0, "wall_seconds": 1.0, "per_class": {"a": 0.5, "b": 0.5, "c": 0.5}}
    assert "top-3 100.00%" in result_line(summary, "out")
    assert "top-5 90.00%" in result_line({**summary, "top5": 0.9, "per_class": dict.fromkeys("abcdefg", 0.5)}, "out")
