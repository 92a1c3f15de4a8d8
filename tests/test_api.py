"""The Python face: fit, evaluate, predict, explain and pretrain call the trainer and evaluation the command line
calls, and a notebook user's script following the seed tutorial (CIFAR-10-like arrays in Keras's layout) works."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

import vitlab
from vitlab import progress
from vitlab.cli import main
from vitlab.data.cache import cache_entries
from vitlab.runs.folder import new_run_folder
from vitlab.runs.format import read_config, read_history

TIMINGS = ("images_per_second", "elapsed_seconds")
OPTIONS = dict(epochs=3, img_size=16, model_args={"in_chans": 3}, threads=1, precision="fp32", batch_size=32)


def tutorial_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10-like arrays, small: uint8 (N, 16, 16, 3) images of 3 classes, each a faint stripe of its own
    colour and place in noise, and labels of shape (N, 1) as Keras's cifar10.load_data gives them."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.integers(0, 120, (n, 16, 16, 3)).astype(np.uint8)
    for i, k in enumerate(y):
        x[i, :, 5 * k:5 * k + 5, k] += 90
    return x, y.reshape(-1, 1).astype(np.uint8)


def rows(folder) -> list[dict]:
    return [{k: v for k, v in row.to_dict().items() if k not in TIMINGS} for row in read_history(folder)]


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """The seed tutorial's steps with vitlab.fit, in a fresh folder: ((train arrays, test arrays), result, cache)."""
    tmp = tmp_path_factory.mktemp("tutorial")
    threads = torch.get_num_threads()
    train, test = tutorial_arrays(96, 0), tutorial_arrays(48, 1)
    result = vitlab.fit("vit_micro_patch2_8", (train, test), out=tmp / "run", cache_dir=str(tmp / "cache"), **OPTIONS)
    torch.set_num_threads(threads)
    return (train, test), result, tmp


def test_the_seed_tutorial_trains_plots_evaluates_and_predicts(tutorial):
    (train, test), result, tmp = tutorial
    assert not result.model.training and result.model.num_classes == 3
    assert [h["epoch"] for h in result.history] == [1, 2, 3] and result.history == [
        row.to_dict() for row in read_history(result.out)]
    assert result.summary["classes"] == ["0", "1", "2"] and result.summary["num_test"] == 48
    assert result.summary["top1"] > 0.6  # three classes: chance is a third
    curves = result.plot()
    assert isinstance(curves, Figure) and [ax.get_title() for ax in curves.axes] == ["Loss", "Accuracy"]
    assert len(curves.axes[0].lines[0].get_xdata()) == 3
    assert curves._repr_png_().startswith(b"\x89PNG")  # what a notebook shows (no pyplot needed)
    metrics = vitlab.evaluate(result.model, test)
    assert metrics["top1"] == pytest.approx(result.summary["top1"]) and metrics["count"] == 48
    assert set(metrics) >= {"top1", "top5", "loss", "per_class", "confusion"}
    assert vitlab.evaluate(result.out)["confusion"] == metrics["confusion"]  # the folder on its own test split
    confusion = result.confusion()
    assert isinstance(confusion, Figure)
    shown = np.asarray(confusion.axes[0].images[0].get_array())
    counts = np.asarray(metrics["confusion"], dtype=float)
    assert np.allclose(shown, counts / counts.sum(1, keepdims=True))
    probs = vitlab.predict(result.model, test[0])
    assert probs.shape == (48, 3) and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert (probs.argmax(1) == test[1][:, 0]).mean() == pytest.approx(metrics["top1"])


def test_fit_and_the_command_line_write_the_same_rows(tutorial, capsys):
    """The same options through vitlab train (on the store the arrays became) give the same metrics rows."""
    _, result, tmp = tutorial
    data = read_config(result.out)["data"]
    argv = ["train", "--model", "vit_micro_patch2_8", "--data", data, "--out", str(tmp / "cli"), "--model-arg",
            "in_chans=3", "--cache-dir", str(tmp / "cache")]
    for key, value in OPTIONS.items():
        if key != "model_args":
            argv += [f"--{key.replace('_', '-')}", str(value)]
    assert main(argv) == 0
    assert rows(tmp / "cli") == rows(result.out) and len(rows(result.out)) == 3
    store = next(e for e in cache_entries(tmp / "cache") if str(e.path) == data)
    assert store.status == "current" and not store.removable  # `vitlab cache clean` keeps what the runs read
    assert read_config(tmp / "cli") == {**read_config(result.out), "out": str(tmp / "cli")}


def test_predict_reads_files_pil_images_and_arrays_alike(tutorial, tmp_path):
    (_, test), result, _ = tutorial
    Image.fromarray(test[0][0]).save(tmp_path / "a.png")
    from_file = vitlab.predict(result.out, [tmp_path / "a.png"])
    assert np.allclose(from_file, vitlab.predict(result.model, Image.fromarray(test[0][0])), atol=1e-6)
    assert np.allclose(from_file, vitlab.predict(result.model, test[0][0]), atol=1e-6)
    heat = vitlab.explain(result.model, test[0][0], method="rollout")
    assert heat.shape == (8, 8) and heat.max() == pytest.approx(1.0)
    assert vitlab.explain(result.out, test[0][:2], method="relevance").shape == (2, 8, 8)


def test_an_interrupted_fit_resumes_to_the_uninterrupted_run(tutorial, tmp_path, monkeypatch):
    (train, test), result, tmp = tutorial
    said = progress.log_line

    def stop_at_epoch_2(line: str) -> None:
        if line.startswith("epoch 2:"):
            raise KeyboardInterrupt  # as a notebook's stop button would, mid-run
        said(line)

    monkeypatch.setattr(progress, "log_line", stop_at_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        vitlab.fit("vit_micro_patch2_8", (train, test), out=tmp_path / "run", cache_dir=str(tmp / "cache"), **OPTIONS)
    monkeypatch.setattr(progress, "log_line", said)
    assert len(read_history(tmp_path / "run")) == 1
    with pytest.raises(ValueError, match="is unfinished .stopped at epoch 1"):
        vitlab.predict(tmp_path / "run", test[0][:1])
    with pytest.raises(ValueError, match="lr cannot change on resume; accepted with resume: epochs"):
        vitlab.fit(resume=tmp_path / "run", lr=0.1)
    resumed = vitlab.fit(resume=tmp_path / "run")
    assert rows(resumed.out) == rows(result.out)
    for a, b in zip(resumed.model.state_dict().values(), result.model.state_dict().values()):
        assert torch.equal(a, b)


def test_pretrain_writes_a_pretraining_run_that_fit_fine_tunes(tutorial, tmp_path):
    (train, test), _, tmp = tutorial
    options = {**OPTIONS, "epochs": 1, "cache_dir": str(tmp / "cache")}
    run = vitlab.pretrain("vit_micro_patch2_8", (train, test), out=tmp_path / "mae", **options)
    assert run.summary["pretrain"] == "mae" and run.summary["top1"] is None and run.history[0]["test_loss"] > 0
    assert read_config(run.out)["lr"] == pytest.approx(1.5e-4 * 32 / 256)  # pre-training's own default
    with pytest.raises(ValueError, match="pre-training run"):
        run.confusion()
    tuned = vitlab.fit(run.out, (train, test), out=tmp_path / "tuned", epochs=1, threads=1, precision="fp32",
                       batch_size=32)
    assert read_config(tuned.out)["init"] == str(run.out) and tuned.model.num_classes == 3


def test_a_module_trains_from_its_weights_and_the_default_folder_is_under_runs(tutorial, tmp_path, monkeypatch):
    (train, test), _, tmp = tutorial
    monkeypatch.chdir(tmp_path)
    module = vitlab.create_model("vit_micro_patch2_8", in_chans=3, img_size=16, num_classes=3)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    result = vitlab.fit(module, (train, test), epochs=1, threads=1, precision="fp32", batch_size=32,
                        cache_dir=str(tmp / "cache"))
    assert result.out.absolute().parent == tmp_path / "runs" and result.out.name.startswith("vit_micro_patch2_8-")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        vitlab.fit(module, (train, test), out=tmp_path / "taken", cache_dir=str(tmp / "cache"))
    assert not (tmp_path / "taken.init").exists() and (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    start = vitlab.load(read_config(result.out)["init"])
    for a, b in zip(start.state_dict().values(), before.values()):
        assert torch.equal(a, b)  # the run started from the module's own weights
    assert result.model is module  # and trained it in place


@pytest.mark.parametrize("data, message", [
    (((np.zeros((4, 8, 8, 3), np.float32), np.zeros(4, int)),), "not valid; accepted: (("),
    ((np.full((4, 8, 8, 3), 300, np.float32), np.zeros(4, int)), "outside [0, 1] and [0, 255] (they exceed 255"),
    ((np.zeros((4, 8, 8, 5), np.uint8), np.zeros(4, int)), "shape (4, 8, 8, 5) are not valid; accepted: (N, H, W, C)"),
    ((np.zeros((4, 8, 8, 3), np.uint8), np.zeros((4, 2), int)), "accepted: class indices (N,) or (N, 1), or one-hot"),
    ((np.zeros((4, 8, 8, 3), np.uint8), np.zeros(3, int)), "labels number 3, the images 4"),
    ((np.zeros((4, 8, 8, 3), np.uint8), np.full(4, -1)), "accepted: class indices 0, 1, ..."),
])
def test_bad_arrays_are_one_line_naming_what_is_accepted(tmp_path, data, message):
    with pytest.raises(ValueError) as e:
        vitlab.fit("vit_micro_patch2_8", data, out=tmp_path / "run", cache_dir=str(tmp_path / "cache"))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_bad_calls_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"unknown option\(s\) epoch; accepted: model, init, "):
        vitlab.fit("vit_micro_patch2_8", "digits", out=tmp_path / "run", epoch=3)
    with pytest.raises(ValueError, match="neither a registered name"):
        vitlab.fit("vit_nonesuch", "digits", out=tmp_path / "run")
    with pytest.raises(ValueError, match="fit needs data"):
        vitlab.fit("vit_micro_patch2_8")
    with pytest.raises(ValueError, match="goes on with the run's own model"):
        vitlab.fit("vit_micro_patch2_8", resume=tmp_path)
    with pytest.raises(ValueError, match=r"vitlab.load\('hf-hub:"):
        vitlab.create_model("vit_micro_patch2_8", pretrained=True)
    assert not (tmp_path / "run").exists()


def test_a_new_run_folder_is_named_after_the_model_and_the_time(tmp_path):
    import datetime
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    first = new_run_folder("vit_micro_patch2_8", when, tmp_path)
    assert first == tmp_path / "vit_micro_patch2_8-20260102-030405"
    first.mkdir()
    assert new_run_folder("vit_micro_patch2_8", when, tmp_path).name == "vit_micro_patch2_8-20260102-030405-2"


def test_progress_renders_in_a_notebook(monkeypatch):
    from tqdm.auto import tqdm as auto
    assert not progress.in_notebook()  # pytest is no Jupyter kernel
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    bar = progress.progress_bar(total=10, file=None, clock=None)
    assert isinstance(bar, auto) and not isinstance(bar, progress.Progress)
    bar.goto(4)
    assert bar.n == 4
    bar.close()


def test_the_command_line_without_out_writes_under_runs_as_fit_does():
    from vitlab.cli import build_parser
    from vitlab.cli.train import in_folder, recipe_of
    recipe = in_folder(recipe_of(build_parser().parse_args(["train", "--data", "digits"])))
    assert recipe.out.startswith("runs/vit_micro_patch2_8-")
