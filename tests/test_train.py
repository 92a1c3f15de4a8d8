"""vitlab train / eval / predict: run folders, resume after kill -9, torchrun, fine-tuning, clear errors."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port
from PIL import Image
from safetensors.torch import load_file

import vitlab
from vitlab.cli import main
from vitlab.train import load_recipe, train

# A small, fast setting on the embedded digits: no randomness beyond init and order.
TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1"]


def run_cli(*args, env_extra=None, check=True, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "vitlab", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"vitlab {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return proc


def kill_at(prefix: str, *args) -> None:
    """Run ``vitlab ARGS`` and kill -9 it as soon as it reports a line starting with ``prefix`` (for an epoch: while
    it writes that epoch's checkpoint)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vitlab", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if line.startswith(prefix):
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


class Ticks:
    """A fake clock for ``train(now=...)``: every reading is ``dt`` seconds after the one before."""

    def __init__(self, dt: float):
        self.t, self.dt = 0.0, dt

    def __call__(self) -> float:
        self.t += self.dt
        return self.t


def metrics(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def comparable(rows):
    """Metrics without the wall-clock figures, which differ between any two runs."""
    return [{k: v for k, v in r.items() if k not in ("images_per_second", "elapsed_seconds")} for r in rows]


def test_run_folder_has_everything(tmp_path, cache_dir):
    out = tmp_path / "run"
    recipe = load_recipe(None, model="vit_micro_patch2_8", epochs=3, precision="fp32", out=str(out), threads=1)
    summary = train(recipe)
    for name in ("config.yaml", "metrics.jsonl", "config.json", "model.safetensors", "curves.png",
                 "confusion.png", "summary.json", "checkpoint.pt"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    saved = json.loads((out / "summary.json").read_text())
    for key in ("top1", "top5", "per_class", "images_per_second", "wall_seconds"):
        assert key in saved
    assert set(saved["per_class"]) == {str(i) for i in range(10)}
    assert saved == json.loads(json.dumps(summary))
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert all({"train_loss", "train_acc", "lr", "images_per_second"} <= r.keys() for r in rows)
    model = vitlab.load(out)
    assert model.pretrained_cfg["label_names"] == [str(i) for i in range(10)]
    # eval reproduces the run's own figure on the same split
    result = main(["eval", str(out), "--data", "digits", "--out", str(tmp_path / "ev")])
    assert result == 0
    ev = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert abs(ev["top1"] - saved["top1"]) < 1e-9
    assert (tmp_path / "ev" / "confusion.png").stat().st_size > 0


def test_refuses_to_overwrite_and_resume_needs_run(tmp_path, cache_dir):
    out = tmp_path / "run"
    train(load_recipe(None, model="vit_micro_patch2_8", epochs=1, precision="fp32", out=str(out), threads=1))
    with pytest.raises(ValueError, match="holds a finished run"):
        train(load_recipe(None, epochs=1, out=str(out)))


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(tmp_path, cache_dir):
    common = [*TINY, "--epochs", "8", "--train-fraction", "0.2", "--cache-dir", cache_dir]
    run_cli("train", *common, "--out", tmp_path / "full")
    victim = tmp_path / "killed"
    kill_at("epoch 3:", "train", *common, "--out", victim)
    assert not (victim / "summary.json").exists(), "a killed run must not look finished"
    assert len(metrics(victim)) < 8, "the run finished before it could be killed"
    run_cli("train", "--resume", victim)
    assert comparable(metrics(victim)) == comparable(metrics(tmp_path / "full"))
    a = json.loads((victim / "summary.json").read_text())
    b = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert (a["top1"], a["test_loss"], a["per_class"]) == (b["top1"], b["test_loss"], b["per_class"])


def test_sigterm_stops_a_run_as_ctrl_c_does_and_names_the_command_that_continues_it(tmp_path, cache_dir):
    """`kill PID` (SIGTERM, a scheduler's stop) mid-run: exit 130 with one last line that names the --resume
    command, nothing looks finished, and that command finishes the run."""
    common = [*TINY, "--epochs", "8", "--train-fraction", "0.2", "--cache-dir", cache_dir]
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "vitlab", "train", *map(str, common), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stderr:
        if line.startswith("epoch 2:"):
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == 130, rest
    assert rest.strip().splitlines()[-1] == ("vitlab train: interrupted; continue from its last finished epoch with: "
                                             f"vitlab train --resume {out}")
    assert not (out / "summary.json").exists() and len(metrics(out)) < 8
    run_cli("train", "--resume", out)
    assert len(metrics(out)) == 8 and (out / "summary.json").is_file()


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_the_interrupted_line_names_the_run_folder_the_config_chose(command, tmp_path, capsys, monkeypatch):
    """A run whose folder comes from the config file (no --out), stopped after a checkpoint: the last line names
    that folder's --resume command; stopped before any checkpoint, it names none."""
    import vitlab.train as training
    out = tmp_path / "from-config"
    config = tmp_path / "recipe.yaml"
    config.write_text(f"out: {out}\nepochs: 2\n")
    checkpointed = [True]

    def stopped(recipe, resume=False):
        out.mkdir(exist_ok=True)
        if checkpointed[0]:
            (out / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "train", stopped)
    method = ["--method", "mae"] if command == "pretrain" else []
    assert main([command, "--config", str(config), *method]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"vitlab {command}: interrupted; continue from its last finished epoch with: vitlab {command} --resume {out}")
    (out / "checkpoint.pt").unlink()
    checkpointed[0] = False
    assert main([command, "--config", str(config), *method]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"vitlab {command}: interrupted"


def test_under_torchrun_one_rank_says_interrupted_and_names_the_torchrun_command(tmp_path, capsys, monkeypatch):
    """torchrun stops every rank: rank 0 prints the one 'interrupted' line, and its --resume command is launched
    as the run was; the other ranks print none."""
    import vitlab.train as training
    out = tmp_path / "run"
    config = tmp_path / "recipe.yaml"
    config.write_text(f"out: {out}\nepochs: 2\n")

    def stopped(recipe, resume=False):
        out.mkdir(exist_ok=True)
        (out / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "train", stopped)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--config", str(config)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "vitlab train: interrupted; continue from its last finished epoch with: "
        f"torchrun --nproc-per-node 4 -m vitlab train --resume {out}")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two
    assert main(["train", "--config", str(config)]) == 130
    assert "torchrun --nnodes 2 (and the same rendezvous options) --nproc-per-node 2 -m vitlab train --resume" in (
        capsys.readouterr().err)
    for rank in ("1", "3"):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--config", str(config)]) == 130
        assert "interrupted" not in capsys.readouterr().err


@pytest.mark.slow
def test_two_process_torchrun_matches_one_process(tmp_path, cache_dir):
    """Two DDP ranks end with the very weights of one process that cuts each batch into the same two micro-batches
    (crops and cutmix drawn per part from the part's own seed; the ranks' gradients averaged as the micro-batches'
    add up)."""
    common = [*TINY, "--epochs", "2", "--cache-dir", cache_dir, "--drop-path", "0.1", "--padding", "1",
              "--label-smoothing", "0.1", "--cutmix", "1.0", "--mix-prob", "0.5"]
    run_cli("train", *common, "--accum-steps", "2", "--out", tmp_path / "one")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "vitlab", "train", *map(str, common),
                           "--out", str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-6  # the ranks' loss sums add in another order
        assert a["test_top1"] == b["test_top1"]
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("one", "two"))
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["processes"] == 2


@pytest.mark.slow
def test_torchrun_under_a_time_budget_keeps_replicas_identical(tmp_path, cache_dir):
    """Rank 0 owns the clock: both ranks take the same steps with the same learning rates and sizes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "vitlab", "train", *TINY, "--time-budget", "0.15",
                           "--progressive-scale", "0.5", "--cache-dir", str(cache_dir), "--out", str(tmp_path / "tb")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "tb" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["replicas_in_sync"] is True
    assert summary["time_budget_minutes"] == 0.15 and summary["epochs"] >= 1


def _noise_folder(root: Path, per_class: int, shape: tuple[int, int, int], classes: int = 3) -> Path:
    """An image folder of random-noise PNGs: root/class<i>/<n>.png."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return root


def test_a_batch_larger_than_the_training_set_uses_the_whole_set(tmp_path, cache_dir):
    root = _noise_folder(tmp_path / "tiny", per_class=15, shape=(8, 8, 3))
    lines = []
    summary = train(load_recipe(None, data=str(root), model="vit_micro_patch2_8", model_args={"in_chans": 3},
                                epochs=2, batch_size=128, precision="fp32", threads=1, out=str(tmp_path / "run")),
                    log=lines.append)
    assert summary["num_train"] == 36 and summary["steps"] == 2  # one step per epoch, all 36 images
    assert any("larger than the 36 training images" in line for line in lines), lines


def _uci_digits():
    """(images 0..16, labels) of the digits shipped inside vitlab."""
    from vitlab.data import sources

    with np.load(Path(sources.__file__).with_name("digits.npz")) as z:
        return z["images"], z["labels"]


def _digit_folder(root: Path, classes, size: int, per_class: int, seed: int = 0):
    """Digits 0..4 as PNG files of another size, under other class names: a new task for transfer."""
    images, target = _uci_digits()
    rng = np.random.default_rng(seed)
    for label, name in classes.items():
        idx = rng.permutation(np.flatnonzero(target == label))
        for split, chosen in (("train", idx[:per_class]), ("test", idx[per_class:per_class + 40])):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                img = Image.fromarray((images[i] * 255 / 16).astype(np.uint8), mode="L")
                img.resize((size, size), Image.BICUBIC).save(folder / f"{i}.png")


@pytest.mark.slow
def test_finetune_beats_scratch_on_new_classes_and_size(tmp_path, cache_dir):
    pre = tmp_path / "pretrained"
    run_cli("train", *TINY, "--epochs", "20", "--cache-dir", cache_dir, "--out", pre)
    target = tmp_path / "target"
    _digit_folder(target, {0: "zero", 1: "one", 2: "two", 3: "three", 4: "four"}, size=16, per_class=12)
    budget = ["--epochs", "15", "--batch-size", "20", "--precision", "fp32", "--threads", "1", "--hflip",
              "--no-hflip", "--mixup", "0", "--cutmix", "0", "--auto-augment", "none", "--random-erasing", "0",
              "--padding", "1", "--data", target, "--cache-dir", cache_dir]
    run_cli("train", *budget, "--init", pre, "--img-size", "16", "--out", tmp_path / "ft")
    run_cli("train", *budget, "--model", "vit_micro_patch2_8", "--img-size", "16", "--out", tmp_path / "scratch")
    ft = json.loads((tmp_path / "ft" / "summary.json").read_text())
    scratch = json.loads((tmp_path / "scratch" / "summary.json").read_text())
    model = vitlab.load(tmp_path / "ft")
    assert model.patch_embed.img_size == (16, 16) and model.num_classes == 5
    assert model.pretrained_cfg["label_names"] == ["four", "one", "three", "two", "zero"]
    assert ft["top1"] > scratch["top1"] + 0.1, (ft["top1"], scratch["top1"])


@pytest.mark.slow
def test_linear_probe_trains_only_the_head(tmp_path, cache_dir):
    pre = tmp_path / "pre"
    run_cli("train", *TINY, "--epochs", "2", "--cache-dir", cache_dir, "--out", pre)
    run_cli("train", *TINY, "--epochs", "2", "--cache-dir", cache_dir, "--init", pre, "--freeze-backbone",
            "--lr", "0.01", "--out", tmp_path / "probe")
    a, b = vitlab.load(pre), vitlab.load(tmp_path / "probe")
    assert torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
    assert torch.equal(a.pos_embed, b.pos_embed)
    assert not torch.equal(a.head.weight, b.head.weight)


def test_time_budget_ends_in_time(tmp_path, cache_dir):
    lines = []
    summary = train(load_recipe(None, model="vit_micro_patch2_8", batch_size=64, precision="fp32", threads=1,
                                time_budget=0.25, out=str(tmp_path / "tb")), log=lines.append, now=Ticks(0.05))
    assert summary["train_seconds"] <= 15, summary["train_seconds"]  # on the run's clock, from the first step
    assert summary["wall_seconds"] > summary["train_seconds"]  # data, set-up and the final save come on top
    assert summary["epochs"] >= 2 and any("test top-1" in line for line in lines)
    rows = metrics(tmp_path / "tb")
    assert summary["epochs"] == len(rows) and all(r["images_per_second"] > 0 for r in rows)  # no empty epoch
    assert all(a["step"] < b["step"] for a, b in zip(rows, rows[1:]))


def test_time_budget_keeps_back_the_final_evaluation_before_any_evaluation(tmp_path, cache_dir):
    """Evaluated only at the end, a budget run still keeps back the time of that evaluation (timed on one batch)."""
    lines, dt = [], 0.05
    summary = train(load_recipe(None, model="vit_micro_patch2_8", batch_size=64, precision="fp32", threads=1,
                                time_budget=0.2, eval_every=1000, out=str(tmp_path / "run")), log=lines.append,
                    now=Ticks(dt))
    kept = [line for line in lines if line.startswith("kept back")]
    assert len(kept) == 1, lines
    reserve = 1.25 * dt * 360 / 128 + 3  # one clock tick for two CPU batches of 64, scaled to the 360 test images
    assert kept[0] == (f"kept back {reserve:.0f} s of the budget for the final evaluation of 360 test images "
                       "(timed on 128)")
    # training stops at the first step after budget - reserve is reached: every reading of the clock moves it on by
    # dt, a step reads it up to three times (the threshold falls anywhere within a step's reads), closing the epoch
    # and evaluating four times more
    assert 12 - reserve <= summary["train_seconds"] <= 12 - reserve + 7 * dt, (summary["train_seconds"], reserve)
    rows = metrics(tmp_path / "run")
    assert [("test_top1" in r) for r in rows] == [False] * (len(rows) - 1) + [True]


def test_budget_counting_training_only_stops_the_clock_for_evaluations(tmp_path, cache_dir, monkeypatch):
    """budget_counts: training: each evaluation (here 100 s on the fake clock, far past the 12 s budget) leaves the
    training time as it was; the same evaluations on the clock end a run that counts everything after one epoch."""
    from vitlab.train import setup
    evaluate = setup.Run.evaluate
    results = {}
    for counts in ("training", "all"):
        clock = Ticks(0.05)

        def slow_evaluate(self, model, limit=None, sample=None, clock=clock):
            clock.t += 100
            return evaluate(self, model, limit=limit, sample=sample)

        monkeypatch.setattr(setup.Run, "evaluate", slow_evaluate)
        lines = []
        summary = train(load_recipe(None, model="vit_micro_patch2_8", batch_size=64, precision="fp32", threads=1,
                                    time_budget=0.2, budget_counts=counts, out=str(tmp_path / counts)),
                        log=lines.append, now=clock)
        results[counts] = summary, metrics(tmp_path / counts), lines
    summary, rows, lines = results["training"]
    assert not any(line.startswith("kept back") for line in lines)  # nothing kept back for the final evaluation
    assert summary["epochs"] >= 3 and all("test_top1" in r for r in rows), rows  # evaluated after every epoch
    assert 12 <= summary["train_seconds"] <= 12 + 6 * 0.05, summary["train_seconds"]  # the whole budget trained
    steps = [r["elapsed_seconds"] for r in rows]
    assert all(0 < b - a < 12 for a, b in zip(steps, steps[1:]))  # no 100 s evaluation inside the training time
    summary_all, rows_all, _ = results["all"]
    assert summary_all["epochs"] == 1 and summary_all["train_seconds"] > 100


def test_predict_top_k_with_class_names(tmp_path, cache_dir, capsys):
    out = tmp_path / "run"
    train(load_recipe(None, model="vit_micro_patch2_8", epochs=2, precision="fp32", out=str(out), threads=1))
    img = tmp_path / "seven.png"
    Image.fromarray((_uci_digits()[0][7] * 255 / 16).astype(np.uint8), mode="L").save(img)
    assert main(["predict", str(out), str(img), "--top-k", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result) == 1 and len(result[0]["top"]) == 3
    assert {p["class"] for p in result[0]["top"]} <= {str(i) for i in range(10)}
    probs = [p["probability"] for p in result[0]["top"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--model", "vit_nano"], "unknown model 'vit_nano'"),
    (["--model", "vit_tiny_patch4_32", "--img-size", "30"], "not divisible by the patch size 4"),
    (["--precision", "fp8"], "precision='fp8' is not valid; accepted: auto, bf16, fp16, fp32"),
    (["--precision", "fp16", "--device", "cpu"], "precision='fp16' needs a GPU"),
    (["--lr", "fast"], "lr='fast' is not valid; accepted: a number > 0"),
    (["--device", "cuda"], "device='cuda' was asked for, but PyTorch sees no CUDA device"),
    (["--crop", "zoom"], "crop"),
    (["--epochs", "0"], "epochs=0 is not valid"),
    (["--data", "/nonexistent/images"], "/nonexistent/images"),
    (["--distill", "soft"], "needs a teacher"),
    (["--progressive-scale", "1.5"], "progressive_scale=1.5 is not valid; accepted: a number > 0 and <= 1"),
    (["--ema-start", "0.5"], "ema_start=0.5 needs an EMA to begin: --ema-decay"),
])
def test_bad_options_fail_clearly(tmp_path, cache_dir, args, message):
    proc = run_cli("train", "--out", tmp_path / "bad", "--epochs", "1", *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_unknown_recipe_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("epochs: 2\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown recipe option.*learning_rate"):
        load_recipe(recipe)


@pytest.mark.slow
def test_empty_class_folder_is_a_clear_error(tmp_path, cache_dir):
    _digit_folder(tmp_path / "d", {0: "zero", 1: "one"}, size=8, per_class=5)
    (tmp_path / "d" / "train" / "empty").mkdir()
    proc = run_cli("train", *TINY, "--data", tmp_path / "d", "--out", tmp_path / "o", "--cache-dir", cache_dir,
                   check=False)
    assert proc.returncode != 0 and "empty" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("recipe", sorted(p.name for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml")))
def test_shipped_recipes_are_valid(recipe):
    path = Path(__file__).parents[1] / "recipes" / recipe
    teacher = "runs/teacher" if "distill:" in path.read_text() else None  # distillation recipes ask for one
    r = load_recipe(path, strict=True, out="unused", teacher=teacher)  # as vitlab train reads it
    if r.model:
        vitlab.create_model(r.model)  # the model it names exists


def test_time_bar_prints_at_most_once_per_interval():
    import io

    from vitlab.progress import Progress
    clock = Ticks(0.0)  # moved on by hand: 1 ms a call to goto
    sink = io.StringIO()
    bar = Progress(total=100, file=sink, mininterval=0.05, unit="s", clock=clock)
    for _ in range(500):  # 0.5 s
        clock.t += 0.001
        bar.goto(clock.t * 100)
    prints = sink.getvalue().count("\n")
    assert 3 <= prints <= 0.5 / 0.05 + 3, prints
    bar.goto(1e9)
    assert bar.n == bar.total


@pytest.mark.parametrize("name", ["vit_micro_patch2_8", "deit_nano_distilled_patch4_32"])
def test_flip_tta_averages_image_and_mirror(name):
    from vitlab.metrics import head_logits
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    c, h, w = model.pretrained_cfg["input_size"]
    x = torch.randn(3, c, h, w)
    with torch.no_grad():
        plain, mirror, tta = head_logits(model, x), head_logits(model, x.flip(-1)), head_logits(model, x, tta=True)
    assert plain.keys() == tta.keys()
    for k in plain:
        torch.testing.assert_close(tta[k], (plain[k] + mirror[k]) / 2, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(tta[k], plain[k])


def test_eval_and_train_with_tta(tmp_path, cache_dir):
    out = tmp_path / "run"
    summary = train(load_recipe(None, model="vit_micro_patch2_8", epochs=2, precision="fp32", out=str(out),
                                threads=1, tta=True))
    assert summary["tta"] is True
    assert main(["eval", str(out), "--data", "digits", "--tta", "--out", str(tmp_path / "ev")]) == 0
    ev = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert ev["tta"] is True and abs(ev["top1"] - summary["top1"]) < 1e-9
    assert main(["eval", str(out), "--data", "digits", "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert plain["tta"] is False and plain["heads"]["logits"]["loss"] != ev["heads"]["logits"]["loss"]


def test_progressive_resizing_trains_small_then_saves_full_size(tmp_path, cache_dir):
    out = tmp_path / "run"
    lines = []
    summary = train(load_recipe(None, model="vit_micro_patch2_8", epochs=4, precision="fp32", out=str(out),
                                threads=1, progressive_scale=0.5, progressive_until=0.5), log=lines.append)
    sizes = [line for line in lines if line.startswith("training input size")]
    assert sizes == ["training input size 4x4", "training input size 6x6", "training input size 8x8"], sizes
    assert summary["top1"] > 0.2  # it learned (chance 0.1), at the full size it is evaluated at: 0.27-0.42 over seeds
    assert [r["input_size"] for r in metrics(out)] == [[4, 4], [6, 6], [8, 8], [8, 8]]
    model = vitlab.load(out)
    model(torch.randn(2, 1, 8, 8))
    with pytest.raises(ValueError, match="does not match"):  # the saved model is not left size-agnostic
        model(torch.randn(2, 1, 4, 4))


@pytest.mark.parametrize("name", ["vit_nano_patch4_32", "vit_nano_r18_32", "convit_tiny_patch4_32",
                                  "cait_xxs_patch4_32"])
def test_train_step_resizes_the_augmented_batch(name):
    from vitlab.data.augment import AugmentConfig, BatchAugment
    from vitlab.train.progressive import any_size
    from vitlab.train.step import Batch, Stepper, train_step
    from vitlab.train.tasks.supervised import HeadsLoss
    model = vitlab.create_model(name, num_classes=10)
    seen = []
    model.patch_embed.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape[-2:])))
    flags = any_size(model)
    assert flags and all(v is False for v in flags.values())
    aug = BatchAugment(AugmentConfig(), (32, 32), (0.5,) * 3, (0.5,) * 3, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), torch.arange(4)
    for size in [(16, 16), (24, 24), None]:
        train_step(Stepper(model, aug, HeadsLoss(), opt, clip_grad=1.0), Batch(images, labels, size))
    assert seen == [(16, 16), (24, 24), (32, 32)]
    with torch.no_grad():  # back at the full size, e.g. ConViT's relative positions follow the grid
        assert model.eval()(images.float() / 255).shape == (4, 10)


def test_under_progressive_resizing_the_teacher_sees_the_full_size_batch():
    """The student trains on the resized batch; the loss, and so a teacher trained at 32x32, gets the same augmented
    crop at 32x32, not resized (a CNN teacher at 16x16 would be a weaker teacher)."""
    from vitlab.data.augment import AugmentConfig, BatchAugment
    from vitlab.train.progressive import any_size
    from vitlab.train.step import Batch, Stepper, train_step
    from vitlab.train.tasks.distillation import TrainLoss
    student = vitlab.create_model("vit_nano_patch4_32", num_classes=10, distilled=True)
    teacher = vitlab.create_model("airbench_32", num_classes=10)
    student_saw, teacher_saw = [], []
    student.patch_embed.register_forward_hook(lambda m, i, o: student_saw.append(tuple(i[0].shape[-2:])))
    teacher.register_forward_hook(lambda m, i, o: teacher_saw.append(i[0].detach().clone()))
    any_size(student)
    plain = AugmentConfig(crop="none", hflip=False, auto_augment="none", random_erasing=0, mixup=0, cutmix=0)
    aug = BatchAugment(plain, (32, 32), (0.5,) * 3, (0.5,) * 3, 10)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    images, labels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), torch.arange(4)
    for size in [(16, 16), None]:
        train_step(Stepper(student, aug, TrainLoss(teacher, "hard"), opt, channels_last=True),
                   Batch(images, labels, size))
    assert student_saw == [(16, 16), (32, 32)]
    assert [tuple(t.shape[-2:]) for t in teacher_saw] == [(32, 32), (32, 32)]
    torch.testing.assert_close(teacher_saw[0], teacher_saw[1])  # the same images, unresized, both times
    torch.testing.assert_close(teacher_saw[0], (images.float() / 255 - 0.5) / 0.5)


def test_the_loss_gets_each_micro_batch_s_places_in_the_training_set():
    """With gradient accumulation, each micro-batch's loss is given the training-set indices of its own images (what
    a teacher whose predictions were made once looks them up by)."""
    from vitlab.data.augment import AugmentConfig, BatchAugment
    from vitlab.train.step import Batch, Stepper, train_step
    from vitlab.train.tasks.supervised import HeadsLoss

    class Recording(HeadsLoss):
        def forward(self, images, outputs, targets, index=None):
            given.append(index.tolist())
            return super().forward(images, outputs, targets)

    given = []
    model = vitlab.create_model("vit_micro_patch2_8", num_classes=10, in_chans=1)
    aug = BatchAugment(AugmentConfig(mixup=0, cutmix=0), (8, 8), (0.5,), (0.5,), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = torch.randint(0, 256, (6, 1, 8, 8), dtype=torch.uint8), torch.arange(6)
    train_step(Stepper(model, aug, Recording(), opt, accum_steps=2), Batch(images, labels, index=torch.tensor(
        [40, 7, 3, 12, 0, 5])))
    assert given == [[40, 7, 3], [12, 0, 5]]


def test_a_micro_batch_draws_its_augmentation_from_its_own_seed():
    """With part seeds, the second micro-batch's crops and cutmix are what a rank holding only that half draws."""
    from vitlab.data.augment import AugmentConfig, BatchAugment
    from vitlab.train.step import Batch, Stepper, part_seed, train_step
    from vitlab.train.tasks.supervised import HeadsLoss

    class Recording(HeadsLoss):
        def forward(self, images, outputs, targets, index=None):
            seen.append((images.clone(), targets.clone()))
            return super().forward(images, outputs, targets)

    aug = BatchAugment(AugmentConfig(crop="pad", padding=2, cutmix=1.0, mix_prob=1.0, mixup=0), (8, 8), (0.5,),
                       (0.5,), 10)
    images, labels = torch.randint(0, 256, (8, 1, 8, 8), dtype=torch.uint8), torch.arange(8)
    seeds = [part_seed(0, 0, 3, k) for k in range(2)]
    seen = []
    model = vitlab.create_model("vit_micro_patch2_8", num_classes=10, in_chans=1)
    torch.manual_seed(1)
    train_step(Stepper(model, aug, Recording(), torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2),
               Batch(images, labels, seeds=seeds))
    both = seen[1]
    seen.clear()
    torch.manual_seed(2)  # another generator state before: the seed decides alone
    train_step(Stepper(model, aug, Recording(), torch.optim.SGD(model.parameters(), lr=0.1)),
               Batch(images[4:], labels[4:], seeds=seeds[1:]))
    assert torch.equal(seen[0][0], both[0]) and torch.equal(seen[0][1], both[1])
    assert not torch.equal(both[0], aug(images[4:], labels[4:])[0])  # the draws are random at all


def test_ranks_take_the_contiguous_parts_one_process_cuts_its_micro_batches_into():
    from vitlab.train.feed import EpochPlan
    whole = EpochPlan(101, 4, 7).order()
    parts = [EpochPlan(101, 4, 7, rank, 2).order() for rank in range(2)]
    for k, batch in enumerate(whole):
        assert [p[k].tolist() for p in parts] == [b.tolist() for b in batch.tensor_split(2)]


def test_gradient_clipping_scales_as_torch_does_and_leaves_small_gradients_alone():
    from vitlab.train.step import clip_grad_norm
    torch.manual_seed(0)
    grads = [torch.randn(n) * 3 for n in (5, 300, 17)]
    ours, theirs = ([torch.nn.Parameter(torch.zeros_like(g)) for g in grads] for _ in range(2))
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    clip_grad_norm(ours, 1.0)
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-6)
    assert abs(float(torch.cat([p.grad for p in ours]).norm()) - 1.0) < 1e-5
    small = [p.grad.clone() for p in ours]
    clip_grad_norm(ours, 5.0)  # norm 1 < 5: unchanged to the bit
    assert all(torch.equal(g, p.grad) for g, p in zip(small, ours))


def test_photos_stored_larger_than_the_training_size(tmp_path, cache_dir):
    """store_size keeps photos at 12 px (shorter side, centre square); training crops 8x8, evaluation resizes and
    centre-crops; the saved model takes 8x8."""
    root = _noise_folder(tmp_path / "photos", per_class=20, shape=(16, 20, 3))
    lines = []
    summary = train(load_recipe(None, data=str(root), model="vit_micro_patch2_8", model_args={"in_chans": 3},
                                store_size=12, crop="rrc", img_size=8, epochs=2, batch_size=16, precision="fp32",
                                threads=1, out=str(tmp_path / "run")), log=lines.append)
    assert any("trained at 8x8" in line for line in lines), lines
    assert summary["num_test"] == 12 and 0 <= summary["top1"] <= 1
    model = vitlab.load(tmp_path / "run")
    assert model.pretrained_cfg["input_size"] == [3, 8, 8] or tuple(model.pretrained_cfg["input_size"]) == (3, 8, 8)


def test_ema_update_copies_at_decay_0_and_lerps_otherwise():
    from vitlab.train.step import ema_update

    model, ema = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in ema.parameters()]
    ema_update(ema, model, 0.75)
    for e, b, m in zip(ema.parameters(), before, model.parameters()):
        assert torch.allclose(e, 0.75 * b + 0.25 * m)
    ema_update(ema, model, 0.0)
    assert all(torch.equal(e, m) for e, m in zip(ema.parameters(), model.parameters()))


def test_ema_start_lets_the_copy_follow_the_model_until_then(tmp_path, cache_dir, monkeypatch):
    import vitlab.train.step as step

    decays, update = [], step.ema_update
    monkeypatch.setattr(step, "ema_update", lambda e, m, d: (decays.append(d), update(e, m, d)))
    train(load_recipe(None, model="vit_micro_patch2_8", epochs=2, batch_size=64, ema_decay=0.9, ema_start=0.5,
                      precision="fp32", threads=1, seed=0, out=str(tmp_path / "run")), log=lambda s: None)
    half = len(decays) // 2  # an epoch-counted run: progress is step / steps, the second epoch starts at 0.5
    assert len(decays) % 2 == 0 and decays == [0.0] * half + [0.9] * half
    first, second = metrics(tmp_path / "run")
    assert first["ema_test_top1"] == first["test_top1"]  # the copy is the model itself until the average begins
    assert second["ema_test_top1"] is not None
