"""TensorBoard event files read back with tensorboard's own reader; vitlab compare on finished and unfinished runs."""
import json

import pytest
import yaml
from PIL import Image

from vitlab.cli import main
from vitlab.runs.compare import compare, format_table, read_run
from vitlab.runs.format import Summary, write_summary

ROW_KEYS = ("train_loss", "train_acc", "test_top1", "test_top5", "lr", "images_per_second")


def history(epochs, top1_start=0.3):
    return [{"epoch": e, "step": 10 * e, "train_loss": 2.0 / e, "train_acc": 0.2 + 0.1 * e, "lr": 1e-3 / e,
             "images_per_second": 1000.0 + e, "test_loss": 1.5 / e, "test_top1": top1_start + 0.1 * e,
             "test_top5": 0.9, "elapsed_seconds": 10.0 * e} for e in range(1, epochs + 1)]


def make_run(folder, epochs, finished=True, model="vit_micro_patch2_8", planned=None, top1_start=0.3):
    folder.mkdir(parents=True)
    rows = history(epochs, top1_start)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": model, "data": "digits",
                                                        "epochs": planned or epochs}))
    if finished:
        write_summary(folder, Summary(
            top1=rows[-1]["test_top1"], top5=0.95, test_loss=0.5, per_class={}, images_per_second=1000.0,
            train_seconds=10.0 * epochs, epochs=epochs, steps=10 * epochs, stopped_early=False, model=model,
            parameters=123_456, precision="fp32", device="cpu", data="digits", num_train=100, num_test=10,
            classes=[], ema=False, tta=False, processes=1, replicas_in_sync=True, nonfinite_steps=0, distill="none",
            teacher=None, time_budget_minutes=None, wall_seconds=10.0 * epochs + 1))
    return folder


def test_tensorboard_scalars_and_images_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vitlab.train.tensorboard import TensorBoardLog

    png = tmp_path / "curves.png"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(png)
    log = TensorBoardLog(tmp_path)
    for row in history(3):
        log.scalars(row["epoch"], {**row, "input_size": [32, 32], "note": "x", "ema": None})
    log.scalars(3, {"loss": 0.5}, prefix="val/")
    log.image("curves", png, step=3)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0}).Reload()
    tags = acc.Tags()
    assert set(ROW_KEYS) <= set(tags["scalars"]) and "val/loss" in tags["scalars"]
    assert "input_size" not in tags["scalars"] and "note" not in tags["scalars"]
    assert [e.step for e in acc.Scalars("test_top1")] == [1, 2, 3]
    assert acc.Scalars("lr")[1].value == pytest.approx(5e-4)
    assert tags["images"] == ["curves"]
    picture = acc.Images("curves")[0]
    assert (picture.width, picture.height, picture.step) == (40, 30, 3)
    assert picture.encoded_image_string == png.read_bytes()


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith(("torch.utils.tensorboard", "tensorboard")):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    from vitlab.train.tensorboard import TensorBoardLog
    with pytest.raises(ValueError, match=r"pip install 'vitlab\[tensorboard\]'"):
        TensorBoardLog(tmp_path)


def test_compare_table_and_figure(tmp_path, capsys, monkeypatch):
    a = make_run(tmp_path / "a", 3)
    b = make_run(tmp_path / "b", 2, finished=False, model="vit_nano_patch4_32", planned=5, top1_start=0.1)
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["run", "status", "model", "params"]
    row_a, row_b = out[1], out[2]
    assert row_a.startswith("a ") and "finished" in row_a and "0.12M" in row_a and "60.00%" in row_a
    assert row_a.split()[6:8] == ["30", "s"]  # its training time
    assert row_b.startswith("b ") and "unfinished (2/5 epochs)" in row_b and "30.00%" in row_b
    assert "20 s" in row_b  # the training time of its last epoch
    assert "vit_nano_patch4_32" in row_b
    figure = tmp_path / "compare.png"
    with Image.open(figure) as im:
        assert im.size[0] > 500
    assert main(["compare", str(a), str(b), "--json", "--out", str(tmp_path / "f" / "c.png")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in rows] == ["finished", "unfinished (2/5 epochs)"]
    assert rows[1]["epochs"] == 2 and rows[1]["top1"] == pytest.approx(0.3) and rows[1]["parameters"] is None
    assert rows[0]["train_seconds"] == 30.0 and rows[1]["train_seconds"] == 20.0 and rows[1]["wall_seconds"] is None
    assert (tmp_path / "f" / "c.png").is_file()


def test_compare_unfinished_run_without_evaluation_and_bad_folders(tmp_path):
    run = make_run(tmp_path / "r", 1, finished=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in ("test_loss", "test_top1", "test_top5"):
            r.pop(k)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 2, "tr')
    row = read_run(run)
    assert row["epochs"] == 1 and row["top1"] is None
    assert "-" in format_table([row]).splitlines()[1].split()
    with pytest.raises(FileNotFoundError, match="no run folder"):
        compare([tmp_path / "missing"], out=tmp_path / "c.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither summary.json nor metrics.jsonl"):
        compare([tmp_path / "empty"], out=tmp_path / "c.png")


def test_compare_rewrites_its_own_figures_and_no_other_file(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "a", 2)
    Image.new("RGB", (8, 8)).save(run / "curves.png")  # a figure another command wrote
    monkeypatch.chdir(tmp_path)
    theirs = {"compare.png": b"\x89PNG\r\n\x1a\nsomeone else's", "notes.pdf": b"%PDF-1.4 mine",
              "c.jpg": b"\xff\xd8\xff", "notes.md": b"how to run vitlab compare", "a/curves.png": None}
    theirs["a/curves.png"] = (run / "curves.png").read_bytes()
    (tmp_path / "fig.png").mkdir()
    for name in [*theirs, "fig.png"]:
        if theirs.get(name) is not None:
            (tmp_path / name).write_bytes(theirs[name])
        assert main(["compare", str(run), "--out", name]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert ("is a folder" if name == "fig.png" else "is a file that vitlab compare did not write") in err, err
    assert {name: (tmp_path / name).read_bytes() for name in theirs} == theirs
    for name in ("own.png", "own.pdf", "own.svg", "own"):  # a figure compare wrote is rewritten, as often as asked
        for _ in range(2):
            assert main(["compare", str(run), "--out", name]) == 0
        assert capsys.readouterr().out.endswith(f"curves: {name if '.' in name else name + '.png'}\n")
    assert (tmp_path / "own.png").stat().st_size > 0 and not (tmp_path / "own").exists()


def test_training_run_logs_to_tensorboard(tmp_path, cache_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vitlab.train import load_recipe, train
    out = tmp_path / "run"
    train(load_recipe(None, model="vit_micro_patch2_8", epochs=2, precision="fp32", threads=1, log="tensorboard",
                      out=str(out)))
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "images": 0}).Reload()
    assert set(ROW_KEYS) <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train_loss")] == [1, 2]
    assert sorted(acc.Tags()["images"]) == ["confusion", "curves"]
    assert (out / "metrics.jsonl").read_text().count("\n") == 2  # the run's own log stays


def test_compare_draws_each_loss_on_its_own_axes_and_names_only_drawn_lines(tmp_path, monkeypatch):
    from vitlab.runs import figures
    supervised = make_run(tmp_path / "vit", 2)
    mae = make_run(tmp_path / "mae", 2)
    (mae / "config.yaml").write_text(yaml.safe_dump({"model": "vit_micro_patch2_8", "data": "digits", "epochs": 2,
                                                     "pretrain": "mae"}))
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("test_")}  # no labels: a loss only
            for line in (mae / "metrics.jsonl").read_text().splitlines()]
    (mae / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, path, **kw: drawn.append(fig) or path)
    compare([supervised, mae], out=tmp_path / "c.png")
    (fig,) = drawn
    axes = {ax.get_ylabel(): ax for ax in fig.axes}
    assert list(axes) == ["train cross-entropy loss", "train MAE loss (squared error, hidden patches)",
                          "test top-1 (%)"]
    for ylabel, names in (("train cross-entropy loss", ["vit"]), ("train MAE loss (squared error, hidden patches)",
                                                                 ["mae"]), ("test top-1 (%)", ["vit"])):
        ax = axes[ylabel]
        assert [line.get_label() for line in ax.get_lines()] == names
        assert [t.get_text() for t in ax.get_legend().get_texts()] == names  # no name without its line
        fig.canvas.draw()
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), ticks  # whole epochs, never 1.5
