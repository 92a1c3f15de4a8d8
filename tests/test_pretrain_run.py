"""Pre-training runs: the run folder's objective (encoder + pretrain.safetensors), the pre-training command on
an unlabelled folder, resume after kill -9, fine-tuning from a pre-training run, and the families it refuses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port
from PIL import Image
from test_train import comparable, kill_at, metrics, run_cli

import vitlab
from vitlab.cli import main
from vitlab.objectives import create_objective, load_objective, save_objective
from vitlab.objectives.objective import read_pretrain, write_pretrain
from vitlab.runs.compare import read_run
from vitlab.runs.format import PRETRAIN_WEIGHTS, load_checkpoint, read_history
from vitlab.train import load_recipe, train
from vitlab.train.build import build_model_and_data
from vitlab.train.distributed import init_distributed
from vitlab.train.tasks import task_for
from vitlab.train.tasks.masked import held_out_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread beats two fighting over a busy machine


def encoder(**kw):
    return vitlab.create_model("vit_micro_patch2_8", num_classes=0, **kw)


@pytest.mark.parametrize("method,options", [("mae", {"mask_ratio": 0.5, "decoder_depth": 1}),
                                            ("mpp", {"mean": [0.3], "std": [0.2]}),
                                            ("dino", {"out_dim": 16, "local_crops": 2}),
                                            ("ibot", {"out_dim": 16, "local_crops": 1, "mask_ratio": 0.5})])
def test_a_saved_objective_loads_back_whole_in_eval_mode(tmp_path, method, options):
    objective = create_objective(method, encoder(), **options)
    save_objective(objective, tmp_path, method, options)
    assert read_pretrain(tmp_path)[:2] == (method, options)
    assert not any(k.startswith("encoder.") for k in read_pretrain(tmp_path)[2])  # the encoder is the model
    loaded = load_objective(tmp_path)
    assert type(loaded) is type(objective) and loaded.method == method and not loaded.training
    saved, back = objective.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    model = vitlab.load(tmp_path)  # the encoder alone is a model vitlab reads, without a head
    assert model.num_classes == 0
    x = torch.randn(2, 1, 8, 8)
    first, again = (m(x, generator=torch.Generator().manual_seed(0)).loss for m in (objective.eval(), loaded))
    assert torch.equal(first, again)


def test_a_folder_without_or_with_a_broken_pretrain_file_is_one_line(tmp_path):
    vitlab.save(encoder(), tmp_path)
    with pytest.raises(FileNotFoundError, match="not a finished pre-training run"):
        load_objective(tmp_path)
    (tmp_path / PRETRAIN_WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_objective(tmp_path)


def test_a_decoder_of_another_shape_is_refused(tmp_path):
    objective = create_objective("mae", encoder(), decoder_depth=1)
    save_objective(objective, tmp_path, "mae", {"decoder_depth": 1})
    method, _, rest = read_pretrain(tmp_path)
    write_pretrain(tmp_path, method, {"decoder_depth": 2}, rest)
    with pytest.raises(ValueError, match="does not fit"):
        load_objective(tmp_path)


# ---------------------------------------------------------------------------------------------
# pre-training runs


def flat_folder(root: Path, n: int = 30, size: int = 8) -> Path:
    """A flat folder of unlabelled RGB images (no class folders): halves of two random colours each."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(n):
        a = np.empty((size, size, 3), dtype=np.uint8)
        a[: size // 2], a[size // 2:] = rng.integers(0, 255, 3), rng.integers(0, 255, 3)
        Image.fromarray(a).save(root / f"img{i:03d}.png")
    return root


def tiny_pretrain(data: str, out: Path, method: str = "mae", **kw):
    values = dict(data=data, model="vit_micro_patch2_8", pretrain=method, epochs=2, batch_size=8, precision="fp32",
                  threads=1, out=str(out))
    if data != "digits":
        values["model_args"] = {"in_chans": 3}
    return load_recipe(None, **{**values, **kw})


@pytest.mark.parametrize("method", ["mae", "mpp", "dino"])
def test_pretraining_on_a_flat_folder_writes_a_run_of_encoder_and_objective(tmp_path, cache_dir, method):
    lines = []
    summary = train(tiny_pretrain(str(flat_folder(tmp_path / "flat")), tmp_path / "run", method), log=lines.append)
    run = tmp_path / "run"
    for name in ("config.yaml", "checkpoint.pt", "metrics.jsonl", "config.json", "model.safetensors",
                 PRETRAIN_WEIGHTS, "curves.png", "summary.json"):
        assert (run / name).is_file(), name
    assert not (run / "confusion.png").exists()  # no labels, no confusion matrix
    assert summary["pretrain"] == method and summary["top1"] is None and summary["per_class"] is None
    assert summary["num_train"] + summary["num_test"] == 30 and summary["num_test"] == 6  # held out by val_fraction
    rows = read_history(run)
    assert [r.epoch for r in rows] == [1, 2] and all(r.train_acc is None and r.test_top1 is None for r in rows)
    assert all(np.isfinite(r.test_loss) and r.evaluated for r in rows) and summary["test_loss"] == rows[-1].test_loss
    assert any("unlabelled" in line for line in lines) and any("pre-training objective" in line for line in lines)
    objective = load_objective(run)
    assert objective.method == method and objective.encoder.num_classes == 0
    model = vitlab.load(run)
    assert model.num_classes == 0 and model.pretrained_cfg["label_names"] is None
    final = load_checkpoint(run)["model"]  # the checkpoint holds the whole objective, the run folder its parts
    assert {k for k in final if not k.startswith("encoder.")} == set(read_pretrain(run)[2])
    assert all(torch.equal(final[f"encoder.{k}"], v) for k, v in model.state_dict().items())
    row = read_run(run)
    assert row["status"] == "finished" and row["top1"] is None


def test_the_held_out_loss_uses_the_same_masks_every_time(tmp_path):
    objective = create_objective("mae", encoder()).eval()
    images = torch.randint(0, 256, (10, 1, 8, 8), dtype=torch.uint8)
    first = held_out_loss(objective, images, (0.5,), (0.25,), batch_size=4)
    again = held_out_loss(objective, images, (0.5,), (0.25,), batch_size=4)
    assert torch.equal(first, again) and first[1] == 10
    shard = held_out_loss(objective, images[4:], (0.5,), (0.25,), first=4, batch_size=4)  # a rank's shard
    assert torch.allclose(first - held_out_loss(objective, images[:4], (0.5,), (0.25,), batch_size=4), shard)


def test_a_flat_folder_is_refused_for_supervised_training_in_one_line(tmp_path, cache_dir, capsys):
    flat = flat_folder(tmp_path / "flat")
    code = main(["train", "--data", str(flat), "--model", "vit_micro_patch2_8", "--model-arg", "in_chans=3",
                 "--epochs", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the lines before it are the data's log
    assert code == 2 and err.startswith("vitlab train: error: ") and "unlabelled" in err and "vitlab pretrain" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["convit_tiny", "vit_tiny_r18_32", "cct_7_3x1_32", "resnet18", "cait_xxs24_224"])
def test_a_family_masking_does_not_apply_to_is_refused_before_any_data(tmp_path, cache_dir, capsys, model):
    code = main(["pretrain", "--method", "mae", "--model", model, "--data", "cifar10", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "does not apply to" in err, err
    assert not cache_dir.exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("args,message", [
    (["--pretrain-arg", "colour=red"], "unknown mae option(s) colour in pretrain_args; accepted: mask_ratio"),
    (["--pretrain-arg", "mask_ratio=lots"], "pretrain_args mask_ratio='lots' is not valid; accepted: a number"),
    (["--pretrain-arg", "mask_ratio"], "--pretrain-arg 'mask_ratio' is not KEY=VALUE"),
    (["--teacher", "somewhere"], "teacher='somewhere' is not valid with pretrain='mae', which learns without a "
                                 "teacher; accepted: pretrain distill with --teacher"),
])
def test_bad_pretraining_options_are_one_line(tmp_path, capsys, args, message):
    code = main(["pretrain", "--method", "mae", *args, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_pretraining_defaults_are_maes_and_given_options_win():
    r = load_recipe(None, data="cifar10", pretrain="mae")
    a = r.augment
    assert (a.crop, a.rrc_scale, a.hflip, a.auto_augment, a.mixup, a.cutmix, a.random_erasing, a.label_smoothing) == \
        ("rrc", (0.2, 1.0), True, "none", 0.0, 0.0, 0.0, 0.0)
    assert r.lr == pytest.approx(1.5e-4 * r.batch_size / 256) and r.min_lr == 0 and r.drop_path == 0
    r = load_recipe(None, data="cifar10", pretrain="mae", batch_size=512, hflip=False, lr=1e-3)
    assert (r.augment.hflip, r.lr) == (False, 1e-3)
    assert load_recipe(None, data="cifar10", pretrain="mae", batch_size=512).lr == pytest.approx(3e-4)
    assert load_recipe(None, data="cifar10").augment.mixup == 0.8  # supervised defaults untouched
    r = load_recipe(None, data="cifar10", pretrain="dino", batch_size=512)  # DINO's lr, and it cuts its own crops
    assert r.lr == pytest.approx(1e-3) and r.augment.crop == "none" and r.augment.hflip
    assert load_recipe(None, data="cifar10", pretrain="dino", crop="rrc").augment.crop == "rrc"


@pytest.mark.parametrize("method", ["mae", "dino", "ibot"])
def test_init_from_a_pretraining_run_loads_every_encoder_tensor(tmp_path, cache_dir, method):
    run = tmp_path / "pre"
    train(tiny_pretrain("digits", run, method, epochs=1, train_fraction=0.1), log=lambda s: None)
    lines = []
    r = load_recipe(None, init=str(run), data="digits", epochs=1, precision="fp32", threads=1, out=str(tmp_path / "ft"))
    model, data, _ = build_model_and_data(r, init_distributed("cpu"), task_for(r, lines.append), lines.append)
    encoder_state = vitlab.load(run).state_dict()
    state = model.state_dict()
    assert set(state) - set(encoder_state) == {"head.weight", "head.bias"} and model.num_classes == 10
    assert all(torch.equal(state[k], v) for k, v in encoder_state.items())  # every encoder tensor, as saved
    said = [line for line in lines if line.startswith("--init")]
    assert said == [f"--init {run}: loaded {len(encoder_state)} encoder tensors (its decoder, {PRETRAIN_WEIGHTS}, "
                    "is not used); new: head.weight, head.bias"]
    summary = train(r.model_copy(update={"train_fraction": 0.05}), log=lambda s: None)  # and it fine-tunes
    assert summary["pretrain"] == "none" and summary["top1"] is not None and vitlab.load(r.out).num_classes == 10


# ---------------------------------------------------------------------------------------------
# the trainer's machinery: kill -9 and --resume, torchrun


PRE = ["--model", "vit_micro_patch2_8", "--batch-size", "32", "--precision", "fp32", "--threads", "1",
       "--train-fraction", "0.15"]
LIGHT = {"mae": ["--pretrain-arg", "decoder_depth=1"], "mpp": ["--pretrain-arg", "corrupt_ratio=0.5"],
         "dino": ["--pretrain-arg", "out_dim=64", "--pretrain-arg", "momentum_steps=20"],
         "ibot": ["--pretrain-arg", "out_dim=64", "--pretrain-arg", "momentum_steps=20", "--pretrain-arg",
                  "local_crops=1"]}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mae", "mpp", "dino", "ibot"])
def test_pretraining_resumed_after_kill_matches_uninterrupted(tmp_path, cache_dir, method):
    common = ["--method", method, *PRE, *LIGHT[method], "--epochs", "6", "--ema-decay", "0.9", "--cache-dir", cache_dir]
    run_cli("pretrain", *common, "--out", tmp_path / "full")
    victim = tmp_path / "killed"
    kill_at("epoch 3:", "pretrain", *common, "--out", victim)
    assert not (victim / "summary.json").exists() and len(metrics(victim)) < 6
    run_cli("pretrain", "--resume", victim)
    assert comparable(metrics(victim)) == comparable(metrics(tmp_path / "full"))
    a = json.loads((victim / "summary.json").read_text())
    b = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert (a["test_loss"], a["ema"], a["pretrain"]) == (b["test_loss"], b["ema"], method)
    resumed, full = load_objective(victim).state_dict(), load_objective(tmp_path / "full").state_dict()
    assert all(torch.equal(resumed[k], full[k]) for k in full)  # encoder and decoder alike


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mae", "ibot", "distill"])
def test_two_torchrun_processes_pretrain_in_sync(tmp_path, cache_dir, method):
    """DistributedDataParallel over the objective: both replicas (encoder and decoder, or student, teacher and
    centres, or student and heads beside a frozen teacher on each process) end identical."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    light = LIGHT.get(method, [])
    if method == "distill":
        teacher = vitlab.create_model("deit_tiny_patch16_224", num_classes=10, img_size=16, patch_size=8,
                                      embed_dim=32, depth=1, num_heads=2)
        light = ["--teacher", vitlab.save(teacher, tmp_path / "teacher")]
    args = ["pretrain", "--method", method, *PRE, *light, "--epochs", "2", "--cache-dir", cache_dir,
            "--out", tmp_path / "two"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "vitlab", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["replicas_in_sync"] is True and summary["pretrain"] == method
    assert [r["epoch"] for r in metrics(tmp_path / "two")] == [1, 2] and np.isfinite(summary["test_loss"])
    assert load_objective(tmp_path / "two").method == method


def test_pretraining_takes_maes_adamw_betas(tmp_path, cache_dir):
    train(tiny_pretrain("digits", tmp_path / "run", epochs=1, train_fraction=0.05), log=lambda s: None)
    groups = load_checkpoint(tmp_path / "run")["optimizer"]["param_groups"]
    assert {tuple(g["betas"]) for g in groups} == {(0.9, 0.95)}


def test_predict_and_eval_of_a_headless_encoder_are_one_line(tmp_path, cache_dir, capsys):
    vitlab.save(encoder(), tmp_path / "enc")
    Image.new("L", (8, 8)).save(tmp_path / "x.png")
    assert main(["predict", str(tmp_path / "enc"), str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no classifier head" in err and "vitlab train --init" in err
    assert main(["eval", str(tmp_path / "enc"), "--data", "digits"]) == 2
    err = capsys.readouterr().err.strip()  # said as predict says it, before any data is read
    assert len(err.splitlines()) == 1 and "has no classifier head (a pre-trained encoder): nothing to evaluate" in err


@pytest.mark.parametrize("method", ["mae", "mpp"])
def test_an_objective_decays_what_supervised_training_decays(method):
    from vitlab.train.optim import param_groups
    objective = create_objective(method, encoder())
    decay, no_decay = param_groups(objective, 0.05)
    names = {id(p): n for n, p in objective.named_parameters()}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    tokens = {n for n in names.values() if n.endswith(("pos_embed", "cls_token", "reg_token", "mask_token"))}
    assert {"encoder.pos_embed", "mask_token" if method == "mpp" else "decoder.mask_token"} <= tokens <= undecayed
    assert all(names[id(p)].endswith("weight") and p.ndim > 1 for p in decay["params"])
