"""A run stopped after any epoch and resumed ends byte for byte where the run never stopped ends, whatever its task;
and a resume goes on only from what the run was built from (its teacher, its --init model, its data)."""
import json

import pytest
import torch
from conftest import stop_at_checkpoint
from safetensors import safe_open

import vitlab
from vitlab.cli import main
from vitlab.runs.format import read_history, read_summary
from vitlab.train import load_recipe, train

TINY = dict(model="vit_micro_patch2_8", batch_size=64, train_fraction=0.1, precision="fp32", threads=1, epochs=3)
ROW = ("epoch", "step", "train_loss", "train_acc", "lr", "test_loss", "test_top1", "ema_test_top1")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A teacher of the digits' ten classes (untrained: its predictions differ from the labels, which is all a
    distillation's resume needs)."""
    torch.manual_seed(1)
    model = vitlab.create_model("vit_micro_patch2_8", num_classes=10)
    model.pretrained_cfg.update(mean=[0.5], std=[0.25])
    return vitlab.save(model, tmp_path_factory.mktemp("teacher") / "teacher")


TASKS = {
    "supervised": {"ema_decay": 0.9},
    "hard": {"distill": "hard"},
    "soft": {"distill": "soft", "tau": 2.0},
    "self": {"distill": "self"},
    "teacher-once": {"distill": "soft", "teacher_once": True, "mixup": 0.0, "cutmix": 0.0},
    "mae": {"pretrain": "mae", "pretrain_args": {"decoder_depth": 1}},
    "mpp": {"pretrain": "mpp"},
    "dino": {"pretrain": "dino", "pretrain_args": {"out_dim": 64, "local_crops": 2}},
    "ibot": {"pretrain": "ibot", "pretrain_args": {"out_dim": 64, "local_crops": 2}},
    "distill": {"pretrain": "distill"},
}


def recipe(values: dict, teacher, out) -> object:
    values = dict(values)
    if values.get("distill") in ("hard", "soft") or values.get("pretrain") == "distill":
        values["teacher"] = str(teacher)
    return load_recipe(None, **TINY, **values, out=str(out))


def rows(out) -> list[dict]:
    return [{k: getattr(r, k) for k in ROW} for r in read_history(out)]


@pytest.mark.parametrize("task", [pytest.param(t, marks=[] if t in ("supervised", "self") else pytest.mark.slow)
                                  for t in TASKS])
def test_every_task_stopped_and_resumed_ends_as_if_never_stopped(task, teacher, tmp_path, cache_dir, monkeypatch):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(recipe(TASKS[task], teacher, whole), log=lambda s: None)
    with monkeypatch.context() as m:
        stop_at_checkpoint(m, 1)
        with pytest.raises(KeyboardInterrupt):
            train(recipe(TASKS[task], teacher, stopped), log=lambda s: None)
    assert (stopped / "checkpoint.pt").is_file() and not (stopped / "summary.json").exists()
    train(recipe(TASKS[task], teacher, stopped), resume=True, log=lambda s: None)
    assert rows(stopped) == rows(whole)
    weights = [p.name for p in whole.iterdir() if p.suffix == ".safetensors"]
    assert weights and all(same_file(stopped / n, whole / n) for n in weights)


def same_file(a, b) -> bool:
    """The same tensors byte for byte and the same metadata (whose order safetensors does not keep)."""
    with safe_open(a, "pt") as x, safe_open(b, "pt") as y:
        return x.metadata() == y.metadata() and sorted(x.keys()) == sorted(y.keys()) and all(
            x.get_tensor(k).dtype == y.get_tensor(k).dtype
            and x.get_tensor(k).numpy().tobytes() == y.get_tensor(k).numpy().tobytes() for k in x.keys())


def test_a_model_named_beside_init_must_be_the_one_it_holds(tmp_path, cache_dir, capsys):
    """--init trains the model it holds: --model names it (or the same architecture under another name), or is
    refused in one line before any data is read; the run records the name it was given."""
    init = vitlab.save(vitlab.create_model("deit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8,
                                           embed_dim=32, depth=1, num_heads=2), tmp_path / "init")
    common = ["train", "--init", str(init), "--data", "digits", "--img-size", "16", "--epochs", "1",
              "--train-fraction", "0.1", "--threads", "1", "--precision", "fp32"]
    assert main([*common, "--model", "vit_micro_patch2_8", "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--model vit_micro_patch2_8 is not the model of --init" in err, err
    assert "accepted: no --model, or --model deit_tiny_patch16_224" in err and not (tmp_path / "other").exists()
    for name in ("deit_tiny_patch16_224", "vit_tiny_patch16_224"):  # its name, and the same ViT under timm's other
        assert main([*common, "--model", name, "--out", str(tmp_path / name)]) == 0
        assert read_summary(tmp_path / name).model == name and vitlab.load(tmp_path / name).arch == name


def replace_model(folder, seed: int) -> None:
    """Another model of the same architecture written over ``folder`` (as a user copying a new teacher in)."""
    torch.manual_seed(seed)
    model = vitlab.create_model("vit_micro_patch2_8", num_classes=10)
    model.pretrained_cfg.update(mean=[0.5], std=[0.25])
    vitlab.save(model, folder)


BUILT_FROM = {"teacher": {"distill": "soft", "teacher_once": True, "mixup": 0.0, "cutmix": 0.0},
              "pretrain-teacher": {"pretrain": "distill"}, "init": {}}


@pytest.mark.parametrize("case", list(BUILT_FROM))
def test_a_resume_refuses_a_teacher_or_init_model_changed_since_the_run_started(case, teacher, tmp_path, cache_dir,
                                                                              monkeypatch):
    source = tmp_path / "source"
    replace_model(source, seed=2)
    role = "init" if case == "init" else "teacher"
    values = {**BUILT_FROM[case], role: str(source)}
    r = load_recipe(None, **TINY, **values, out=str(tmp_path / "run"))
    with monkeypatch.context() as m:
        stop_at_checkpoint(m, 1)
        with pytest.raises(KeyboardInterrupt):
            train(r, log=lambda s: None)
    assert set(json.loads((tmp_path / "run" / "run.json").read_text())["built_from"]) == {role}
    replace_model(source, seed=3)
    with pytest.raises(ValueError) as e:
        train(r, resume=True, log=lambda s: None)
    said = str(e.value)
    assert said.startswith(f"the {'teacher' if role == 'teacher' else '--init model'} of {tmp_path / 'run'} changed "
                           f"since the run started ({source}: config.json, model.safetensors are not the files it "
                           "started with)")
    assert said.endswith("accepted: the {} as the run started with it, or a new run (vitlab train --out NEW_FOLDER)"
                         .format("teacher" if role == "teacher" else "--init model")) and "\n" not in said
    replace_model(source, seed=2)  # the files it started with: it resumes and ends
    assert train(r, resume=True, log=lambda s: None)["epochs"] == 3
