"""The run-folder format: what a real run writes is what the readers read, field for field; train() leaves torch's
globals as it found them; the run clock follows the time source it is given."""
import dataclasses
import json

import pytest
import torch

import vitlab
from vitlab.runs.compare import read_run
from vitlab.runs.format import EpochRow, Summary, read_history, read_summary
from vitlab.studies.report import aggregate
from vitlab.train import load_recipe, train
from vitlab.train.auto import auto_values
from vitlab.train.recipe import make_recipe, recipe_values


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Three short runs on the digits that between them write every field: a ViT with an EMA copy and progressive
    resizing, chosen by the rule table (no model named: the digits' own), a distilled DeiT (two heads) and an MAE
    pre-training (its encoder's k-NN). The first also checks that train() restores torch's globals."""
    root = tmp_path_factory.mktemp("runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    torch.manual_seed(123)
    rng = torch.random.get_rng_state()
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        chosen = auto_values(recipe_values(None, epochs=2, ema_decay=0.9, progressive_scale=0.5, precision="fp32",
                                           threads=1, out=str(root / "vit")), log=lambda s: None)
        assert chosen["model"] == "vit_micro_patch2_8"
        train(make_recipe(chosen), log=lambda s: None)
        kept = (torch.get_num_threads(), torch.equal(torch.random.get_rng_state(), rng),
                (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.backends.cudnn.benchmark) == flags)
    finally:
        torch.set_num_threads(threads)
    train(load_recipe(None, model="deit_nano_distilled_patch4_32", img_size=16, train_fraction=0.2, epochs=1,
                      batch_size=32, precision="fp32", threads=1, out=str(root / "deit")), log=lambda s: None)
    vitlab.pretrain("vit_micro_patch2_8", "digits", method="mae", out=root / "pre", epochs=1, train_fraction=0.1,
                    precision="fp32", threads=1)  # and its encoder's k-NN
    return root / "vit", root / "deit", kept


def test_train_restores_the_torch_globals_it_sets(real_runs):
    *_, (threads, rng_same, flags_same) = real_runs
    assert threads == 3 and rng_same and flags_same


def test_every_field_is_written_by_a_real_run(real_runs):
    vit, deit, _ = real_runs
    summaries = [json.loads((run / "summary.json").read_text()) for run in (vit, deit, vit.parent / "pre")]
    rows = [json.loads(line) for run in (vit, deit) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert set().union(*summaries) == _fields(Summary)  # nothing declared that no run writes, nothing undeclared
    assert set().union(*rows) == _fields(EpochRow)
    for raw in summaries:  # the typed reader reads back exactly what was written
        assert Summary.from_dict(raw).to_dict() == raw
    for raw in rows:
        assert EpochRow.from_dict(raw).to_dict() == raw


def test_the_readers_get_every_value_they_show(real_runs):
    vit, deit, _ = real_runs
    row = read_run(vit)
    assert all(row[k] is not None for k in ("model", "parameters", "data", "epochs", "train_seconds", "wall_seconds",
                                            "images_per_second", "top1", "top5")), row
    assert 0 < row["train_seconds"] <= row["wall_seconds"]
    history = read_history(vit)
    assert history[-1].input_size == [8, 8] and all(h.ema_test_top1 is not None for h in history)
    summary = read_summary(deit)
    assert set(summary.heads) == {"cls", "dist", "mean"} and read_history(deit)[-1].test_top1_cls is not None


def test_a_study_aggregates_real_summaries(real_runs):
    from vitlab.studies.claims import Arm, Study

    vit, deit, _ = real_runs
    arms = [Arm("vit", {"model": "vit_micro_patch2_8"}), Arm("deit", {"model": "deit_nano_distilled_patch4_32"})]
    study = Study("t", "claim", "source", arms, answer=lambda rows: "")
    plan = [(arms[0], 0, load_recipe(None, out=str(vit))), (arms[1], 0, load_recipe(None, out=str(deit)))]
    rows = aggregate(study, plan)
    assert rows[0]["epochs"] == 2 and rows[0]["cls_mean"] is None and rows[1]["cls_mean"] is not None
    assert rows[1]["train_images"] == read_summary(deit).num_train


def test_a_summary_missing_a_field_is_refused(tmp_path):
    raw = {f: 0 for f in _fields(Summary)}
    del raw["train_seconds"]
    (tmp_path / "summary.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="lacks train_seconds"):
        read_summary(tmp_path)


def test_run_clock_follows_its_time_source():
    from vitlab.train.clock import RunClock
    from vitlab.train.distributed import Dist

    t = [100.0]
    d = Dist()  # one process
    clock = RunClock(d, total_steps=10, budget_seconds=20.0, seconds=4.0, now=lambda: t[0])
    assert clock.seconds() == 4.0  # not started: only the earlier sessions' time
    clock.start()
    t[0] += 6.0
    assert clock.seconds() == 10.0 and clock.progress(step=3) == 0.5  # the budget, not the steps
    clock.keep_back(1.0)  # 1.25 x 1 s + 3 s
    assert clock.reserve == 4.25 and clock.progress(step=3) == pytest.approx(10 / 15.75)
    t[0] += 5.75
    assert clock.progress(step=3) == 1.0
    assert clock.keep_back(30.0) and clock.reserve == 10.0  # 40.5 s wanted: half the 20 s budget at most
    assert not clock.keep_back(1.0) and clock.reserve == 10.0  # never less than already reserved
    steps = RunClock(d, total_steps=10, now=lambda: t[0])
    assert steps.progress(step=3) == 0.3


def test_a_runs_throughput_weighs_each_epoch_by_its_time():
    from vitlab.runs.format import EpochRow, run_images_per_second

    def row(epoch, step, rate):
        return EpochRow(epoch=epoch, step=step, train_loss=1.0, train_acc=0.5, lr=0.1, images_per_second=rate)

    # 100 steps at 1,000 img/s then 100 at 100 img/s (batch b): 200 b images in 0.1 b + 1.0 b seconds
    assert run_images_per_second([row(1, 100, 1000.0), row(2, 200, 100.0)]) == pytest.approx(200 / 1.1)
    assert run_images_per_second([row(1, 50, 300.0)]) == pytest.approx(300.0)
    assert run_images_per_second([]) is None


def test_the_summary_and_an_unfinished_runs_row_give_the_runs_throughput(real_runs, tmp_path):
    from vitlab.runs.format import run_images_per_second

    vit, _, _ = real_runs
    history = read_history(vit)
    rates = [h.images_per_second for h in history]
    assert min(rates) < max(rates)  # progressive resizing: epochs at different speeds
    assert read_summary(vit).images_per_second == pytest.approx(run_images_per_second(history))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        (unfinished / name).write_bytes((vit / name).read_bytes())
    assert read_run(unfinished)["images_per_second"] == pytest.approx(run_images_per_second(history))
