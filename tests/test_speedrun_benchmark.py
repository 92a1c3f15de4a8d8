"""benchmarks/cifar10_speedrun.py: the box's calibration, times in CNN-epochs and the distilled arm's equal total
time, read from run folders written through runs/format.py (no timing: an injected clock)."""
from __future__ import annotations

import itertools
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from conftest import ROOT, benchmark

from vitlab.cli import build_parser
from vitlab.cli.train import recipe_of
from vitlab.runs.format import EpochRow, Summary, write_metrics, write_summary

bench = benchmark("cifar10_speedrun")


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


def test_the_table_gives_each_finished_arm_its_six_view_figure_in_a_column_of_its_own(tmp_path):
    fake_run(tmp_path / "cnn", 1800.0, [0.70, 0.86, 0.905])
    fake_run(tmp_path / "hybrid", 1800.0, [0.80, 0.89], model="vit_nano_airbench_32")
    head, _, cnn, hybrid, student = bench.table(tmp_path, ["cnn", "hybrid", "distilled"], 100.0,
                                                {"cnn": 0.9123, "hybrid": 0.9031}).splitlines()
    assert head.rstrip(" |").endswith("final, mirror + translate TTA")
    assert cnn.rstrip(" |").endswith("| 90.50% | 30.0 min (3.6) | 91.23%")
    assert hybrid.rstrip(" |").endswith("| 89.00% | 30.0 min (3.6) | 90.31%")
    assert "(not finished)" in student and student.count("|") == head.count("|")
    assert "mirror + translate" not in bench.table(tmp_path, ["cnn"], 100.0)  # without the figures, no column


def test_both_students_learn_from_the_teacher_arm_and_count_its_time(tmp_path):
    """The student on every batch and those whose teacher predicts once: all learn from OUT/cnn under the budget
    the teacher left, only the last two with --teacher-once, the pooled one softly, and each row starts after the
    teacher's training."""
    commands = bench.student_commands(tmp_path, ["distilled", "distilled-once", "soft-once-pooled"], "data.tar.gz",
                                      12.5, ["--threads", "2"])
    for arm, cmd in commands.items():
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / arm)
        assert cmd[cmd.index("--teacher") + 1] == str(tmp_path / "cnn")
        assert cmd[cmd.index("--time-budget") + 1] == "12.5"
        assert ("--teacher-once" in cmd) == (arm != "distilled") and cmd[-2:] == ["--threads", "2"]
        assert cmd[cmd.index("--distill") + 1] == ("soft" if arm == "soft-once-pooled" else "hard")
    fake_run(tmp_path / "cnn", 1800.0, [0.9])
    fake_run(tmp_path / "distilled-once", 1200.0, [0.82, 0.91], model="vit_nano_airbench_32")
    row = bench.table(tmp_path, ["cnn", "distilled-once"]).splitlines()[-1]
    assert row.startswith("| distilled-once (+ its teacher's 30.0 min) |") and "| 50.0 min |" in row


def test_the_quarter_arm_is_the_hybrid_s_recipe_resized_over_the_first_quarter(tmp_path):
    commands = bench.main_commands(tmp_path, ["cnn", "hybrid", "hybrid-quarter"], "data.tar.gz", 60.0,
                                   ["--threads", "2"])
    recipes = {arm: recipe_of(build_parser().parse_args(cmd[cmd.index("train"):])) for arm, cmd in commands.items()}
    assert recipes["hybrid-quarter"].progressive_until == 0.25 and recipes["hybrid"].progressive_until == 0.5
    assert recipes["hybrid-quarter"].model == recipes["hybrid"].model and recipes["cnn"].model == "airbench_32"
    for arm, cmd in commands.items():
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / arm) and cmd[-2:] == ["--threads", "2"]
        assert cmd[cmd.index("--time-budget") + 1] == "60" and cmd[cmd.index("--eval-every") + 1] == "1"


def test_the_student_gets_what_the_teacher_left_of_the_total(tmp_path):
    fake_run(tmp_path / "cnn", 1800.0, [0.9])
    assert bench.student_budget(tmp_path, 30.0, None) == 30.0
    assert bench.student_budget(tmp_path, 30.0, 60.0) == pytest.approx(30.0)
    assert bench.student_budget(tmp_path, 30.0, 45.0) == pytest.approx(15.0)
    with pytest.raises(SystemExit, match="leaves the distilled student no time"):
        bench.student_budget(tmp_path, 30.0, 25.0)


def test_ablations_run_every_arm_once_a_seed_and_distil_only_from_a_given_teacher(tmp_path):
    without = bench.ablation_commands(tmp_path, "data.tar.gz", 4.0, 2, None, ["--threads", "1"])
    assert not {f"{arm}{seed}" for arm in bench.STUDENTS for seed in ("", "-seed1")} & set(without)
    assert "tokens" in without and "--distill" not in without["tokens"]  # the students' model, without a teacher
    per_seed = len(bench.ABLATIONS) - len(bench.STUDENTS)
    assert len(without) == 2 * per_seed
    first, second = list(without)[:per_seed], list(without)[per_seed:]
    assert first[0] == "full" and second[0] == "full-seed1"  # seed by seed: --jobs pairs arms of one seed
    cmd = without["ema-seed1"]
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "ema-seed1") and cmd[cmd.index("--seed") + 1] == "1"
    assert cmd[cmd.index("--ema-decay") + 1] == "0.999" and "--no-tta" in cmd and cmd[-2:] == ["--threads", "1"]
    teacher = tmp_path / "cnn"
    students = bench.ablation_commands(tmp_path, "data.tar.gz", 4.0, 1, teacher, [])
    for arm in ("distilled", "distilled-once", "distilled-once-pooled"):
        cmd = students[arm]
        assert cmd[cmd.index("--teacher") + 1] == str(teacher) and cmd[cmd.index("--distill") + 1] == "hard"
        assert ("--teacher-once" in cmd) == (arm != "distilled")
        assert ("distilled=true" in cmd) == (arm != "distilled-once-pooled")
    for arm, (tau, alpha, smoothing) in {"soft-once-pooled": (1.0, 0.5, 0.2), "soft-once-pooled-t3": (3.0, 0.5, 0.2),
                                         "soft-once-pooled-a0.8": (1.0, 0.8, 0.2),
                                         "soft-once-pooled-no-smoothing": (1.0, 0.5, 0.0)}.items():
        r = recipe_of(build_parser().parse_args(students[arm][students[arm].index("train"):]))
        assert (r.distill, r.teacher, r.teacher_once, r.tau, r.alpha, r.augment.label_smoothing) == \
            ("soft", str(teacher), True, tau, alpha, smoothing)
        assert r.model_args.get("distilled") is None  # the hybrid's own head, average pooling
    some = bench.ablation_commands(tmp_path, "data.tar.gz", 30.0, 2, None, [], arms=["full", "progressive-quarter"])
    assert list(some) == ["full", "progressive-quarter", "full-seed1", "progressive-quarter-seed1"]
    cmd = some["progressive-quarter"]
    assert cmd[cmd.index("--progressive-until") + 1] == "0.25" and cmd[cmd.index("--time-budget") + 1] == "30"


def test_the_benchmark_run_again_keeps_finished_arms_and_resumes_stopped_ones(tmp_path, capsys):
    """Run again with more seeds into the same folder: a finished arm is kept (not refused, not trained again), one
    a stopped benchmark left unfinished resumes from its checkpoint with the same threads, a new one trains."""
    commands = bench.ablation_commands(tmp_path, "data.tar.gz", 60.0, 2, None, ["--threads", "1"], arms=["full"])
    fake_run(tmp_path / "full", 3600.0, [0.88])
    (tmp_path / "full-seed1").mkdir()
    (tmp_path / "full-seed1" / "checkpoint.pt").write_bytes(b"")
    started = []

    def start(cmd, **kw):
        started.append(cmd)
        return SimpleNamespace(poll=lambda: 0, returncode=0)
    bench.run_arms(bench.arm_jobs(commands), 1, start=start, wait=lambda s: None)
    assert len(started) == 1
    assert started[0][-5:] == ["train", "--resume", str(tmp_path / "full-seed1"), "--threads", "1"]
    assert capsys.readouterr().out.startswith(f"full: finished already in {tmp_path / 'full'}, kept\n")
    (tmp_path / "full-seed1" / "checkpoint.pt").unlink()  # stopped before its first checkpoint: trained anew
    bench.run_arms(bench.arm_jobs(commands), 1, start=start, wait=lambda s: None)
    assert started[1:] == [commands["full-seed1"]]


def test_an_unknown_ablation_arm_is_refused_naming_the_accepted_ones():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cifar10_speedrun.py"), "--ablations",
                           "--arms", "full,bogus", "--calibrate-steps", "0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--arms: unknown bogus; accepted: full, no-whiten" in done.stderr and "progressive-quarter" in done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cifar10_speedrun.py"), "--ablations",
                           "--tta-arms", "light-mix,bogus", "--calibrate-steps", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "--tta-arms: unknown bogus; accepted: full, no-whiten" in done.stderr


def test_the_ablation_table_reads_each_gain_against_the_seed_to_seed_noise(tmp_path):
    for seed, (full, no_la, ema) in enumerate([(0.50, 0.46, 0.505), (0.52, 0.47, 0.52), (0.54, 0.45, 0.54)]):
        fake_run(bench.seed_folder(tmp_path, "full", seed), 240.0, [full], model="vit_nano_airbench_32")
        fake_run(bench.seed_folder(tmp_path, "no-lookahead", seed), 240.0, [no_la], model="vit_nano_airbench_32")
        fake_run(bench.seed_folder(tmp_path, "ema", seed), 240.0, [ema], model="vit_nano_airbench_32")
    tta = {"full": {"+ mirror TTA": [0.51, 0.53, 0.56]}, "ema": {"+ mirror TTA": [0.50, 0.55, 0.57]}}
    rows = {line.split(" | ")[0].lstrip("| "): line for line in bench.ablation_table(tmp_path, tta, 3).splitlines()}
    assert "| 3 | 1.00 | 100 | 52.00% ± 2.00 |" in rows["the whole recipe"]  # its steps: one epoch's
    # lookahead taken away loses 6 points: its gain is +6, with se sqrt(0.01^2 / 3 + 0.02^2 / 3) = 1.29 points
    assert rows["- lookahead"].endswith("| 46.00% ± 1.00 | +6.00 ± 1.29 (beyond the noise) |")
    # EMA adds 0.17 points, within the noise: sqrt(0.0176^2 / 3 + 0.02^2 / 3) = 1.54 points
    assert rows["+ EMA of the weights (decay 0.999)"].endswith("| 52.17% ± 1.76 | +0.17 ± 1.54 |")
    # TTA on the same models: paired differences 1, 1, 2 points, mean 1.33, se 0.58/sqrt(3) = 0.33
    assert rows["the whole recipe + mirror TTA"].endswith("| 53.33% ± 2.52 | +1.33 ± 0.33 (beyond the noise) |")
    # another arm's TTA against the whole recipe's with the same TTA, over independent seeds:
    # 54.00 - 53.33 = +0.67, se sqrt(0.0361^2 / 3 + 0.0252^2 / 3) = 2.54 points
    assert rows["+ EMA of the weights (decay 0.999) + mirror TTA"].endswith("| 54.00% ± 3.61 | +0.67 ± 2.54 |")
    assert "(needs --teacher)" in rows["+ hard distillation from the CNN (--teacher)"]
    assert "(not finished)" in rows["- whitening init (the first conv trained from PyTorch's init)"]
    some = bench.ablation_table(tmp_path, {}, 3, arms=["full", "ema"]).splitlines()
    assert len(some) == 4 and some[3].startswith("| + EMA of the weights")


def test_epochs_are_counted_in_steps_not_in_images_a_second_times_the_training_time(tmp_path):
    """A student whose teacher predicted once spent part of its training time on no step: its epochs are its steps
    over an epoch's steps (here 2), not its img/s times its training seconds (100 x 240 / 50,000 = 0.48)."""
    fake_run(tmp_path / "run", 240.0, [0.5, 0.6])
    assert bench.epochs_trained(tmp_path / "run") == 2.0


def test_tta_is_evaluated_once_beside_the_run_and_again_when_the_run_is_newer(tmp_path, capsys):
    """The TTA figures come from `vitlab eval` folders beside the runs (RUN.tta-mirror, RUN.tta-mirror-translate),
    evaluated on the first call and read back on the next; a run finished again after them is evaluated anew."""
    import os

    from vitlab.runs.format import EvalSummary, write_summary
    calls = []

    def evaluate(run, data, out, tta, tta_translate):
        calls.append((run.name, tta_translate))
        top1 = 0.90 + 0.01 * tta_translate + 0.001 * len(calls)
        write_summary(out, EvalSummary(str(run), data, tta, {}, top1, 0.99, {}, tta_translate))
        return {"top1": top1}

    for seed in range(2):
        fake_run(bench.seed_folder(tmp_path, "full", seed), 60.0, [0.88])
        fake_run(bench.seed_folder(tmp_path, "light-mix", seed), 60.0, [0.89])
    first = bench.tta_figures(tmp_path, "data.tar.gz", 2, ["full", "light-mix"], evaluate)
    assert len(calls) == 8 and ("light-mix-seed1", 1) in calls
    assert first["full"]["+ mirror TTA"] == pytest.approx([0.901, 0.902])
    assert first["light-mix"]["+ mirror + translate TTA"] == pytest.approx([0.917, 0.918])
    assert "full: evaluating with mirror TTA into" in capsys.readouterr().out
    assert bench.tta_figures(tmp_path, "data.tar.gz", 2, ["full", "light-mix"], evaluate) == first
    assert len(calls) == 8  # read back, not evaluated again
    run = tmp_path / "full-seed1" / "summary.json"
    later = (tmp_path / "full-seed1.tta-mirror" / "summary.json").stat().st_mtime + 10
    os.utime(run, (later, later))  # the run finished again after its evaluation
    again = bench.tta_figures(tmp_path, "data.tar.gz", 2, ["full"], evaluate)
    assert calls[8:] == [("full-seed1", 0), ("full-seed1", 1)]
    assert again["full"]["+ mirror TTA"] == pytest.approx([0.901, 0.909])
    (tmp_path / "full.tta-mirror" / "summary.json").write_text('{"top1": 0.9')  # cut short: evaluated again
    assert bench.tta_top1(tmp_path / "full", "data.tar.gz", 0, evaluate) == pytest.approx(0.911)
    assert bench.tta_top1(tmp_path / "full", "data.tar.gz", 0, evaluate) == pytest.approx(0.911)
    assert len(calls) == 11


def test_one_seed_gives_gains_without_a_noise():
    assert bench.gain_cell(0.012, None) == "+1.20"
    assert bench.difference_se([0.5], [0.5, 0.6]) is None and bench.paired_se([0.5], [0.4]) is None
    assert bench.gain_cell(-0.01, 0.006) == "-1.00 ± 0.60"


def test_stopped_it_stops_the_arms_still_training(tmp_path):
    started = []

    def start(cmd, **kw):
        started.append(subprocess.Popen(cmd, **kw))
        return started[-1]

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "train", "--out"]
    jobs = bench.arm_jobs({name: [*sleeper, str(tmp_path / name)] for name in "abc"})
    with pytest.raises(KeyboardInterrupt):
        bench.run_arms(jobs, 2, start=start, wait=ctrl_c)
    assert len(started) == 2  # the third arm never started
    assert all(p.poll() is not None for p in started)  # and neither of the two goes on training


def test_epochs_replace_the_time_budget_of_every_arm(tmp_path):
    """--epochs N: each arm trains N epochs, the recipe's own time budget taken away (``--time-budget null``), so
    that arms compare at equal epochs on a machine of any speed."""
    cmd = bench.ablation_commands(tmp_path, "data.tar.gz", 30.0, 1, None, [], arms=["wd-0.2"], epochs=13)["wd-0.2"]
    assert cmd[cmd.index("--epochs") + 1] == "13" and cmd[cmd.index("--time-budget") + 1] == "null"
    assert "--budget-counts" not in cmd and cmd[cmd.index("--weight-decay") + 1] == "0.2"
    cmd = bench.arm_command(bench.ARMS["cnn"], tmp_path / "cnn", "data.tar.gz", 30.0, [])
    assert cmd[cmd.index("--time-budget") + 1] == "30" and "--epochs" not in cmd


def test_epochs_and_a_total_in_minutes_are_refused_together():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cifar10_speedrun.py"), "--arms",
                           "cnn,distilled", "--epochs", "13", "--total", "60", "--calibrate-steps", "0"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "accepted: one of them" in done.stderr


def test_a_finished_run_of_another_recipe_is_refused_not_kept(tmp_path):
    """Run again after the recipe or an arm changed, the folder's finished run would stand in the table for what it
    is not: refused in one line that names what changed; the same recipe trained elsewhere (threads, data path,
    evaluations) is kept."""
    from vitlab.runs.format import config_values, write_config_values
    from vitlab.train import load_recipe
    commands = bench.ablation_commands(tmp_path, "data.tar.gz", 30.0, 1, None, ["--threads", "2"],
                                       arms=["full", "wd-0.2"])
    for arm, decay in (("full", None), ("wd-0.2", 0.2)):  # None: the recipe's own
        fake_run(tmp_path / arm, 1800.0, [0.88])
        r = load_recipe(bench.ARMS["hybrid"], data="elsewhere/data.tar.gz", time_budget=30, budget_counts="training",
                        weight_decay=decay, tta=False, tta_translate=0, eval_every=3, threads=1, seed=0,
                        out=str(tmp_path / arm))
        write_config_values(tmp_path / arm, config_values(r, None))
    assert bench.recipe_changes(tmp_path / "wd-0.2", commands["wd-0.2"]) == ""
    older = yaml.safe_load((tmp_path / "full" / "config.yaml").read_text())
    del older["max_nonfinite"], older["augment"]["pad_mode"]  # written by a vitlab before these options
    (tmp_path / "full" / "config.yaml").write_text(yaml.safe_dump(older))
    assert [bench.is_finished(job.folder) for job in bench.arm_jobs(commands)] == [True, True]  # both kept
    decay = load_recipe(bench.ARMS["hybrid"]).weight_decay
    changed = {**commands, "full": [*commands["full"], "--weight-decay", "0.3"]}  # as if the recipe's decay changed
    with pytest.raises(ValueError, match=rf"^full: .* another recipe than the arm's now "
                                         rf"\(weight_decay {decay} -> 0.3\); accepted: another --out"):
        bench.arm_jobs(changed)
    longer = bench.ablation_commands(tmp_path, "data.tar.gz", 60.0, 1, None, [], arms=["full"])
    assert bench.recipe_changes(tmp_path / "full", longer["full"]) == "time_budget 30.0 -> 60.0"
