"""benchmarks/cifar10_speedrun.py: the box's calibration, times in CNN-epochs and the distilled arm's equal total
time, read from run folders written through runs/format.py (no timing: an injected clock)."""
from __future__ import annotations

import importlib.util
import itertools

import pytest
from conftest import ROOT

from vitlab.runs.format import EpochRow, Summary, write_metrics, write_summary

spec = importlib.util.spec_from_file_location("cifar10_speedrun", ROOT / "benchmarks" / "cifar10_speedrun.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def fake_run(folder, train_seconds, top1s, model="airbench_32"):
    """A finished run folder: one evaluated row per epoch, evenly spaced over ``train_seconds``."""
    folder.mkdir(parents=True)
    n = len(top1s)
    rows = [EpochRow(epoch=i + 1, step=10 * (i + 1), train_loss=1.0, train_acc=0.5, lr=0.1, images_per_second=100.0,
                     test_loss=1.0, test_top1=t, elapsed_seconds=train_seconds * (i + 1) / n)
            for i, t in enumerate(top1s)]
    write_metrics(folder, rows)
    write_summary(folder, Summary(
        top1=top1s[-1], top5=0.99, test_loss=1.0, per_class=None, images_per_second=100.0, train_seconds=train_seconds,
        epochs=n, steps=10 * n, stopped_early=False, model=model, parameters=1, precision="fp32", device="cpu",
        data="cifar10", num_train=50_000, num_test=10_000, classes=[str(i) for i in range(10)], ema=False, tta=True,
        processes=1, replicas_in_sync=True, nonfinite_steps=0, distill="none", teacher=None,
        time_budget_minutes=train_seconds / 60))


def test_calibration_is_the_batch_over_the_median_step_without_the_first():
    ticks = itertools.accumulate([0.0, 9.0, 0.0, 2.0, 0.0, 4.0, 0.0, 3.0])  # step times 9 (not counted), 2, 4, 3
    assert bench.calibrate(steps=3, batch=8, clock=lambda: next(ticks)) == pytest.approx(8 / 3)


def test_cnn_epochs_are_the_images_the_box_s_cnn_trains_in_that_time():
    assert bench.cnn_epochs(600.0, 250.0) == pytest.approx(600 * 250 / 50_000)  # 3 CNN-epochs in 10 minutes
    assert bench.cnn_epochs(600.0, None) is None
    assert bench.fmt_time(600.0, 250.0) == "10.0 min (3.0)"
    assert bench.fmt_time(600.0) == "10.0 min" and bench.fmt_time(None, 250.0) == "-"


def test_the_table_reads_thresholds_in_cnn_epochs_and_counts_the_teacher_into_the_student(tmp_path):
    fake_run(tmp_path / "cnn", 1800.0, [0.70, 0.86, 0.905])
    fake_run(tmp_path / "distilled", 1200.0, [0.82, 0.91], model="vit_nano_airbench_32")
    text = bench.table(tmp_path, ["cnn", "distilled"], calibration=100.0)
    cnn, student = text.splitlines()[2:]
    assert "to 85% (CNN-epochs)" in text.splitlines()[0]
    # the CNN: 85% after its second epoch (20 minutes = 2.4 CNN-epochs at 100 img/s), 90% after its third
    assert "| 20.0 min (2.4) | 30.0 min (3.6) |" in cnn
    # the student's times start after its teacher's 30 minutes: 90% at 30 + 20 minutes
    assert student.startswith("| distilled (+ its teacher's 30.0 min) |")
    assert "| 50.0 min (6.0) |" in student and student.rstrip(" |").endswith("50.0 min (6.0)")


def test_the_student_gets_what_the_teacher_left_of_the_total(tmp_path):
    fake_run(tmp_path / "cnn", 1800.0, [0.9])
    assert bench.student_budget(tmp_path, 30.0, None) == 30.0
    assert bench.student_budget(tmp_path, 30.0, 60.0) == pytest.approx(30.0)
    assert bench.student_budget(tmp_path, 30.0, 45.0) == pytest.approx(15.0)
    with pytest.raises(SystemExit, match="leaves the distilled student no time"):
        bench.student_budget(tmp_path, 30.0, 25.0)
