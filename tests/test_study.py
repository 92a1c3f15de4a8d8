"""Studies: stratified nested subsets, every study end to end in quick mode, resume, and the guards."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from vitlab.cli import main
from vitlab.data.views import stratified_subset
from vitlab.studies import STUDIES, run_study
from vitlab.train.recipe import load_recipe


def test_stratified_subset_keeps_each_class_share_and_nests():
    labels = torch.tensor([0] * 100 + [1] * 40 + [2] * 60)
    small, large = stratified_subset(labels, 0.1), stratified_subset(labels, 0.25)
    assert torch.bincount(labels[small]).tolist() == [10, 4, 6]
    assert torch.bincount(labels[large]).tolist() == [25, 10, 15]
    assert set(small.tolist()) <= set(large.tolist())  # 10% lies inside 25%
    assert torch.equal(small, stratified_subset(labels, 0.1))  # the same images every time
    assert not torch.equal(small, stratified_subset(labels, 0.1, seed=1))
    assert torch.equal(stratified_subset(labels, 1.0), torch.arange(200))
    assert len(stratified_subset(torch.tensor([0, 1, 1]), 0.01)) == 2  # never an empty class
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        stratified_subset(labels, 0)


def test_train_fraction_is_checked():
    with pytest.raises(ValueError, match=r"train_fraction=1.5 is not valid; accepted: a number > 0 and <= 1"):
        load_recipe(None, train_fraction=1.5)


SLOW_STUDIES = ("pretrain",)  # over a minute in quick mode: tested on their own, marked slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Every study but the slow ones once in quick mode (digits, one epoch at 16x16 per run), all in one folder."""
    out = tmp_path_factory.mktemp("studies")
    results = {name: run_study(name, out=out, quick=True, seeds=(0,), log=lambda s: None) for name in STUDIES
               if name not in SLOW_STUDIES}
    return out, results


def check_written(out: Path, name: str, result: dict) -> None:
    """A study's table, figure and JSON: every arm's row (probes after the arms), its answer."""
    study = STUDIES[name]
    assert (out / f"{name}.png").stat().st_size > 10_000
    table = (out / f"{name}.md").read_text()
    saved = json.loads((out / f"{name}.json").read_text())
    assert saved["answer"] == result["answer"] and saved["answer"] in table
    assert f"**Verdict: {result['verdict']}.**" in table and result["verdict"] == "not separated"  # one seed
    assert study.paper and f"The paper: {study.paper}." in table
    probes = [r["label"] for r in saved["rows"] if r["group"] == "linear probe"]
    assert [r["label"] for r in saved["rows"]] == [a.label for a in study.arms if not a.pretraining] + probes
    scales = {a.label: a.scale for a in study.arms}  # quick: one epoch per budget (the teacher: two)
    for row in saved["rows"]:
        assert row["label"] in table
        assert 0 <= row["top1_mean"] <= 1
        assert row["epochs"] == (None if row["label"] in probes else scales[row["label"]])


def test_every_study_writes_its_table_figure_and_answer(quick):
    out, results = quick
    assert set(results) | set(SLOW_STUDIES) == set(STUDIES)
    for name, result in results.items():
        check_written(out, name, result)


def test_data_scale_trains_on_nested_stratified_shares(quick):
    out, results = quick
    rows = {r["label"]: r for r in results["data-scale"]["rows"]}
    sizes = [rows[f"ViT {p}%"]["train_images"] for p in (10, 25, 50, 100)]
    # quick mode trains on a fifth of each arm's share of the 1,437 training digits
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    assert all(abs(n - 0.2 * f * 1437) <= 10 for n, f in zip(sizes, (0.1, 0.25, 0.5, 1.0)))
    assert rows["ResNet 10%"]["train_images"] == rows["ConViT 10%"]["train_images"] == sizes[0]


def test_studies_share_runs_and_a_rerun_trains_nothing(quick):
    out, results = quick
    # locality's arms are data-scale's ViT and ConViT arms: the same run folders
    scale_runs = {f for r in results["data-scale"]["rows"] for f in r["runs"]}
    assert {f for r in results["locality"]["rows"] for f in r["runs"]} <= scale_runs
    # the hybrid's patch-token arm is pos-embed's learned 1D arm and data-scale's ViT on the whole set
    assert results["hybrid"]["rows"][0]["runs"] == results["pos-embed"]["rows"][0]["runs"] == \
        next(r["runs"] for r in results["data-scale"]["rows"] if r["label"] == "ViT 100%")
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    said = []
    run_study("distill", out=out, quick=True, seeds=(0,), log=said.append)
    assert "5 runs, 5 done, 0 to train" in said[0]
    # every run trained once: pos-embed 3, data-scale 3 more ViT + 4 ResNet + 4 ConViT, the two hybrids, and the
    # distillation's teacher (airbench) and 4 students
    assert len(list((out / "runs").glob("*/summary.json"))) == 3 + 3 + 4 + 4 + 2 + 5
    assert before == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}


def test_distill_reports_both_heads_and_trains_the_teacher_first(quick):
    out, results = quick
    rows = {r["label"]: r for r in results["distill"]["rows"]}
    from vitlab.runs.format import read_config
    teacher = rows["teacher (airbench CNN)"]
    assert teacher["teacher"] and teacher["cls_mean"] is None
    config = read_config(Path(teacher["runs"][0]))  # airbench's own recipe, twice a student's budget
    assert config["model"] == "airbench_32" and config["optimizer"] == "sgd" and config["epochs"] == 2
    for arm in ("no teacher", "soft", "hard"):
        assert 0 <= rows[arm]["cls_mean"] <= 1 and 0 <= rows[arm]["dist_mean"] <= 1
    assert rows["hard, class token only"]["cls_mean"] is None  # a student without the distillation token
    for arm in ("soft", "hard", "hard, class token only"):
        summary = json.loads((Path(rows[arm]["runs"][0]) / "summary.json").read_text())
        assert summary["teacher"] == teacher["runs"][0] and summary["distill"] == arm.split(",")[0]


@pytest.mark.slow  # about two minutes on two cores
def test_pretrain_fine_tunes_from_its_pretraining_runs_and_probes_their_encoders(quick, tmp_path):
    from vitlab.runs.format import read_config, read_summary
    from vitlab.studies.claims import probe_label

    out = tmp_path / "studies"
    shutil.copytree(quick[0], out)  # beside the other studies' runs, which it shares
    said = []
    result = run_study("pretrain", out=out, quick=True, seeds=(0,), log=said.append)
    # 4 pre-training runs (MAE, DINO at 1x and 3x); per label share: scratch 1x (data-scale's ViT), the 4
    # fine-tuned arms and scratch at the same total time (2x, 4x)
    assert "18 runs, 2 done, 16 to train" in said[0]
    check_written(out, "pretrain", result)
    results = quick[1]
    rows = {r["label"]: r for r in result["rows"]}
    pre = {(r["method"], r["epochs"]): r for r in result["pretraining"]}
    assert set(pre) == {("mae", 1), ("mae", 3), ("dino", 1), ("dino", 3)} and all(r["test_loss"] > 0
                                                                               for r in pre.values())
    for method, name in (("mae", "MAE"), ("dino", "DINO")):
        for scale in (1, 3):
            run = Path(pre[method, scale]["run"])
            assert read_summary(run).pretrain == method and (run / "pretrain.safetensors").is_file()
            for share in ("10%", "100%"):
                (folder,) = rows[f"{name} {scale}x, {share} labels"]["runs"]
                assert read_config(Path(folder))["init"] == str(run)  # fine-tuned from that pre-training run
                assert read_config(Path(folder))["epochs"] == 1 and read_config(Path(folder))["layer_decay"] < 1
    for share in ("10%", "100%"):
        for total in (2, 4):  # scratch for the same total time as pre-training + fine-tuning
            (folder,) = rows[f"no pre-training, {total}x, {share} labels"]["runs"]
            assert read_config(Path(folder))["epochs"] == total
    scale_rows = {r["label"]: [Path(f).name for f in r["runs"]] for r in results["data-scale"]["rows"]}
    for share in ("10%", "100%"):  # shared, not trained again
        assert [Path(f).name for f in rows[f"no pre-training, 1x, {share} labels"]["runs"]] == \
            scale_rows[f"ViT {share}"]
    for encoder in ("MAE 1x", "MAE 3x", "DINO 1x", "DINO 3x", "random encoder"):
        few, every = rows[probe_label(encoder, 0.1)], rows[probe_label(encoder, 1.0)]
        assert few["train_images"] < every["train_images"] == rows["no pre-training, 1x, 100% labels"]["train_images"]
        assert 0 <= every["knn"] <= 1 and few["knn"] is None
    table = (out / "pretrain.md").read_text()
    assert "MAE pre-training, 3x: 3 epoch(s)" in table and "Weighted k-NN" in table
    assert len(list((out / "features").glob("features-*.safetensors"))) == 5 * 2  # train and test, per encoder
    said = []
    again = run_study("pretrain", out=out, quick=True, seeds=(0,), log=said.append)
    assert "18 runs, 18 done, 0 to train" in said[0] and again["rows"] == result["rows"]


def test_an_unfinished_arm_is_finished_from_its_checkpoint(quick, tmp_path):
    out, _ = quick
    copy = tmp_path / "studies"
    shutil.copytree(out, copy)
    arm = next((copy / "runs").glob("vit_nano_patch4_32-1ep-seed0"))
    old = json.loads((arm / "summary.json").read_text())
    (arm / "summary.json").unlink()  # as if killed after the last epoch's checkpoint
    said = []
    result = run_study("hybrid", out=copy, quick=True, seeds=(0,), log=said.append)
    assert "3 runs, 2 done, 1 to train" in said[0]
    new = json.loads((arm / "summary.json").read_text())
    assert new["top1"] == old["top1"] == result["rows"][0]["top1_mean"]


def test_a_folder_of_the_same_name_holding_another_run_is_refused(quick):
    out, _ = quick  # the quick runs' folders name one epoch, as a full-size one-epoch run's do
    with pytest.raises(ValueError, match=r"-1ep-seed0 holds another run \(img_size: 16 there, None now, "
                                         r"train_fraction: 0.2 there, 1.0 now.*another --out"):
        run_study("hybrid", out=out, epochs=1, data="digits", seeds=(0,), log=lambda s: None)


def test_parallel_arms_run_in_child_processes(tmp_path):
    result = run_study("hybrid", out=tmp_path, quick=True, jobs=2, seeds=(0,), log=lambda s: None)
    assert len(result["rows"]) == 3 and result["runs_at_a_time"] == 2 and result["threads_per_run"] >= 1
    for row in result["rows"]:
        folder = Path(row["runs"][0])
        assert (folder.parent / (folder.name + ".log")).is_file() and not list(folder.parent.glob("*.lock"))


def test_parallel_students_start_once_their_teacher_has_finished(tmp_path):
    started = []  # (run, whether the teacher had finished when it started)

    def log(line):
        if line.startswith("training "):
            done = any((tmp_path / "runs").glob("airbench_32*/summary.json"))
            started.append((line.split(" -> ")[0].removeprefix("training "), done))

    run_study("distill", out=tmp_path, quick=True, jobs=2, seeds=(0,), log=log)
    # the run without a teacher trains beside the teacher; the students start after it
    assert started[:2] == [("teacher (airbench CNN) seed 0", False), ("no teacher seed 0", False)]
    assert len(started) == 5 and all(done for _, done in started[2:])


def test_cli_lists_studies_and_names_a_wrong_one(capsys):
    assert main(["study", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in STUDIES)
    assert main(["study"]) == 2  # no name: the list, and the line that says what is missing
    said = capsys.readouterr()
    assert all(name in said.out for name in STUDIES)
    assert said.err.strip() == (f"vitlab study: error: which study? accepted: {', '.join(STUDIES)} (listed above), "
                                "or --list")
    assert main(["study", "pos-embeds", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "no study 'pos-embeds'; accepted: pos-embed, data-scale, hybrid, distill, locality, pretrain" in err
    assert main(["study", "hybrid", "--seeds", "a"]) == 2
    assert "--seeds 'a' is not valid" in capsys.readouterr().err


def test_balanced_order_takes_the_classes_in_turn():
    from vitlab.data.views import balanced_order
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)  # sorted by class, as image folders are
    order = balanced_order(labels)
    assert sorted(order.tolist()) == list(range(100))
    assert torch.bincount(labels[order[:30]]).tolist() == [10, 10, 10]  # any prefix is balanced
    assert torch.bincount(labels[order[:60]]).tolist() == [20, 20, 20]
    assert torch.equal(order, balanced_order(labels)) and not torch.equal(order, balanced_order(labels, seed=1))


def test_a_run_trained_by_another_live_process_is_waited_for(tmp_path, monkeypatch):
    import os
    import threading

    from vitlab.runs.folder import LOCK, lock_holder, release_lock, take_lock, write_lock
    from vitlab.studies import runner
    monkeypatch.setattr(runner, "WAIT_S", 0.05)
    runs = tmp_path / "runs"
    folder = runs / "resnet-train_fraction=0.05-seed0"
    folder.mkdir(parents=True)
    lock = runs / "resnet-train_fraction=0.05-seed0.lock"
    held = take_lock(lock)  # another study (a lock of its own on the file) trains it
    write_lock(held, "study 4242")
    said = []

    def finish():
        (folder / "summary.json").write_text("{}")
        release_lock(lock, held)
    threading.Timer(0.5, finish).start()
    assert runner._claim(folder, said.append) is False  # waited, then found it finished
    assert said == [f"{folder.name} is being trained by process 4242: waiting for it"]
    # what a process killed at any moment leaves is a file that no process holds, whatever it says: an empty one
    # (killed between its creation and its first write), one naming a live process (a recycled pid: this one)
    for text in ("", f"study {os.getpid()}", str(os.getpid()), "0"):
        other = runs / "resnet-train_fraction=0.1-seed0"
        other_lock = runs / "resnet-train_fraction=0.1-seed0.lock"
        other_lock.write_text(text)
        assert runner._claim(other, said.append) is True and len(said) == 1  # taken at once
        assert lock_holder(other_lock) == str(os.getpid())
        runner._release(other)
        assert not other_lock.exists() and lock_holder(other_lock) is None
    # a run folder still written by a run of a study that was killed (its own lock held): waited for, not started
    orphan = runs / "orphan"
    orphan.mkdir()
    trains = take_lock(orphan / LOCK)
    write_lock(trains, "train 4343")

    def orphan_ends():
        (orphan / "summary.json").write_text("{}")
        os.close(trains)
    threading.Timer(0.5, orphan_ends).start()
    assert runner._claim(orphan, said.append) is False
    assert said[-1] == "orphan is being trained by process 4343: waiting for it"
    assert not (runs / "orphan.lock").exists()


def test_probe_rows_judge_a_pretrained_and_a_random_encoder_on_nested_label_shares(tmp_path, cache_dir):
    import vitlab
    from vitlab.objectives import create_objective, save_objective
    from vitlab.studies.probe import probe_rows

    encoder = vitlab.create_model("vit_micro_patch2_8", depth=1, num_classes=0)
    save_objective(create_objective("mae", encoder, decoder_depth=1), tmp_path / "mae", "mae", {"decoder_depth": 1})
    rows = probe_rows({"MAE pre-training": tmp_path / "mae"}, (0.1, 1.0), "digits", None, 1.0, None,
                      tmp_path / "features", threads=1, log=lambda s: None)
    assert [r["label"] for r in rows] == ["linear probe: MAE, 10% labels", "linear probe: MAE, 100% labels",
                                          "linear probe: random encoder, 10% labels",
                                          "linear probe: random encoder, 100% labels"]
    from vitlab.data import load_data
    few = len(stratified_subset(load_data("digits", log=lambda s: None).train.labels, 0.1))
    assert [r["train_images"] for r in rows] == [few, 1437, few, 1437]  # stratified shares of the 1,437 digits
    assert all(0.1 < r["top1_mean"] <= 1 for r in rows)  # above chance on 10 classes
    assert [r["knn"] is None for r in rows] == [True, False, True, False]
    assert rows[0]["runs"] == [str(tmp_path / "mae")] and rows[2]["runs"] == []
    assert len(list((tmp_path / "features").glob("*.safetensors"))) == 2 * 2  # train and test, per encoder
    assert probe_rows({"MAE pre-training": tmp_path / "mae"}, (0.1, 1.0), "digits", None, 1.0, None,
                      tmp_path / "features", threads=1, log=lambda s: None) == rows  # read back from the cache


def _rows(values: dict[str, list[float]]) -> list[dict]:
    """Aggregated rows (report.aggregate's keys that the verdicts read) from per-seed top-1 values."""
    import statistics
    return [{"label": k, "group": "", "top1": dict(enumerate(v)), "top1_mean": statistics.fmean(v),
             "top1_std": statistics.stdev(v) if len(v) > 1 else None} for k, v in values.items()]


def test_a_verdict_reads_each_difference_against_twice_its_spread():
    from vitlab.studies.claims import contrast, separated, verdict
    rows = _rows({"a": [0.60, 0.62, 0.64], "b": [0.50, 0.52, 0.54], "c": [0.59, 0.63, 0.67]})
    value, spread = contrast(rows, {"a": 1, "b": -1})
    assert value == pytest.approx(0.10) and spread == pytest.approx((2 * 0.02 ** 2) ** 0.5)
    assert separated(value, spread) == 1 and separated(-value, spread) == -1
    assert separated(*contrast(rows, {"a": 1, "c": -1})) == 0  # 1 point apart, spreads of 2 and 4
    assert separated(0.3, None) == 0  # one seed: no spread to read a difference against
    assert verdict([1, 1], [0]) == "agrees" and verdict([1, 0], [0]) == "not separated"
    assert verdict([1, -1], []) == "disagrees" and verdict([1], [1]) == "disagrees"


def test_pos_embed_verdicts_follow_the_paper_s_two_parts():
    pos = STUDIES["pos-embed"].answer
    alike = {"learned 1D": [0.60, 0.61, 0.62], "fixed 2D sin-cos": [0.605, 0.615, 0.625]}
    assert pos(_rows({**alike, "none": [0.50, 0.51, 0.52]}))[0] == "agrees"
    assert pos(_rows({**alike, "none": [0.59, 0.60, 0.63]}))[0] == "not separated"
    verdict, text = pos(_rows({**alike, "fixed 2D sin-cos": [0.70, 0.71, 0.72], "none": [0.50, 0.51, 0.52]}))
    assert verdict == "disagrees" and "learned 1D vs fixed 2D sin-cos: -10.0 +/- 1.4 points (separated)" in text


def test_data_scale_verdict_reads_the_cnn_s_lead_and_its_trend():
    def rows(lead_small, lead_large):
        out = []
        for group, lead in (("ViT", (0, 0)), ("ResNet", (lead_small, lead_large))):
            for n, extra in zip((100, 1000), lead):
                out += _rows({f"{group} {n}": [0.5 + extra, 0.51 + extra, 0.52 + extra]})
                out[-1].update(group=group, train_images=n)
        return out
    answer = STUDIES["data-scale"].answer
    assert answer(rows(0.10, 0.01))[0] == "agrees"  # ahead on little data, the lead closes
    assert answer(rows(0.10, 0.10))[0] == "not separated"  # ahead, but no trend
    assert answer(rows(-0.10, 0.0))[0] == "disagrees"  # the ViT ahead on little data


def test_hybrid_verdict_reads_both_hybrids_against_patch_tokens():
    hybrid = STUDIES["hybrid"].answer
    patch, cnn, bit = (a.label for a in STUDIES["hybrid"].arms)
    low, high = [0.50, 0.51, 0.52], [0.60, 0.61, 0.62]
    verdict, text = hybrid(_rows({patch: low, cnn: low, bit: high}))
    assert verdict == "agrees" and f"{bit} vs {patch}: +10.0" in text and f"{cnn} vs {patch}: +0.0" in text
    assert hybrid(_rows({patch: low, cnn: [0.49, 0.52, 0.53], bit: low}))[0] == "not separated"
    assert hybrid(_rows({patch: high, cnn: low, bit: low}))[0] == "disagrees"


def test_quick_arms_crop_with_the_quick_padding():
    from vitlab.studies.claims import QUICK
    from vitlab.studies.runner import arm_recipe
    for arm in STUDIES["distill"].arms:  # the base recipe's crop, and the teacher's own
        augment = arm_recipe(arm, 0, Path("unused"), dict(QUICK), Path("teacher")).augment
        assert (augment.crop, augment.padding) == ("pad", QUICK["padding"]), arm.label


def test_every_study_fits_ninety_minutes_with_two_jobs_and_three_seeds():
    from vitlab.studies.runner import RUN_OVERHEAD, planned_minutes
    for name, study in STUDIES.items():
        assert planned_minutes(study, study.minutes, (0, 1, 2), 2) <= 90, name
    # the plan lays runs on the slots: 3 seeds of 3 arms on 2 slots are 5 rounds
    assert planned_minutes(STUDIES["pos-embed"], 10, (0, 1, 2), 2) == pytest.approx(5 * (10 + RUN_OVERHEAD))


def test_two_seeds_give_each_arm_a_mean_and_std(tmp_path):
    result = run_study("hybrid", out=tmp_path, quick=True, seeds=(0, 1), log=lambda s: None)
    for row in result["rows"]:
        values = list(row["top1"].values())
        assert len(values) == 2 and row["top1_std"] == pytest.approx(abs(values[0] - values[1]) / 2 ** 0.5)
    assert result["verdict"] in ("agrees", "disagrees", "not separated")
    assert " +/- " in (tmp_path / "hybrid.md").read_text()


def test_studies_share_a_run_only_at_the_same_budget(tmp_path):
    from vitlab.studies.runner import _common, _plan

    def folders(name):
        common = {**_common(STUDIES[name], "cifar10", None, None, False), "threads": 1, "cache_dir": None}
        return {a.label: Path(r.out).name for a, _, r in _plan(STUDIES[name], tmp_path, common, (0,), False)}
    pos, hybrid, scale, locality = (folders(n) for n in ("pos-embed", "hybrid", "data-scale", "locality"))
    assert pos["learned 1D"] == hybrid["patch tokens"] == "vit_nano_patch4_32-16min-seed0"
    assert scale["ViT 100%"] == locality["DeiT 100%"] == "vit_nano_patch4_32-8.5min-seed0"
    assert scale["ViT 10%"] == "vit_nano_patch4_32-train_fraction=0.1-0.85min-seed0"  # as many epochs as 100%
    pretrain = folders("pretrain")
    assert pretrain["no pre-training, 1x, 10% labels"] not in scale.values()
    assert pretrain["MAE pre-training, 3x"] == "vit_nano_patch4_32-pretrain=mae-4.5min-seed0"


def test_pretrain_budgets_add_curve_points_each_with_its_fine_tunes_and_scratch_run(tmp_path, capsys):
    from vitlab.studies.claims import FINETUNE_LAYER_DECAY, pretrain_study
    from vitlab.studies.runner import _common, _plan
    study = pretrain_study((10, 1, 3))
    common = {**_common(study, "cifar10", None, None, False), "threads": 1, "cache_dir": None}
    plan = {a.label: r for a, _, r in _plan(study, tmp_path, common, (0,), False)}
    mae = Path(plan["MAE pre-training, 10x"].out)
    assert mae.name == "vit_nano_patch4_32-pretrain=mae-15min-seed0"  # 10 fine-tuning budgets of 1.5 minutes
    for share in ("10%", "100%"):
        tuned = plan[f"MAE 10x, {share} labels"]
        assert tuned.init == str(mae) and tuned.time_budget == 1.5  # a fixed fine-tuning budget
        assert tuned.layer_decay == FINETUNE_LAYER_DECAY < 1  # MAE's fine-tuning recipe
        scratch = plan[f"no pre-training, 11x, {share} labels"]  # the same total time
        assert scratch.time_budget == 16.5 and scratch.init is None and scratch.layer_decay == 1
    # the default points are kept, so the runs of the 90-minute study are shared
    assert {"DINO 1x, 10% labels", "DINO 3x, 10% labels", "no pre-training, 4x, 100% labels"} <= set(plan)
    rows = []
    for label, top1 in (("MAE 10x, 10% labels", 0.60), ("no pre-training, 11x, 10% labels", 0.50),
                        ("MAE 3x, 10% labels", 0.40), ("no pre-training, 4x, 10% labels", 0.55)):
        rows += _rows({label: [top1 - 0.01, top1, top1 + 0.01]})
    for label in ("MAE 10x, 100% labels", "no pre-training, 11x, 100% labels", "DINO 10x, 10% labels",
                  "DINO 10x, 100% labels"):
        rows += _rows({label: [0.60, 0.61, 0.62]})
    verdict, text = study.answer(rows)  # read at the longest pre-training, 10x, not 3x
    assert "MAE 10x, 10% labels vs no pre-training, 11x, 10% labels: +10.0" in text and "3x" not in text
    assert verdict == "not separated"  # MAE ahead on 10% of the labels, level with scratch on every label; DINO level
    with pytest.raises(ValueError, match=r"pretrain budgets \[0\] are not valid; accepted: numbers > 0"):
        pretrain_study((0,))
    with pytest.raises(ValueError, match="not valid for the hybrid study; accepted: with the pretrain study"):
        run_study("hybrid", out=tmp_path / "s", quick=True, pretrain_budgets=(10,))
    assert main(["study", "pretrain", "--pretrain-budgets", "10,x", "--out", str(tmp_path / "s")]) == 2
    assert "--pretrain-budgets '10,x' is not valid; accepted: numbers > 0" in capsys.readouterr().err


def test_each_pre_training_method_trains_its_own_minutes_and_dino_its_schedules_over_its_steps(tmp_path, capsys):
    from vitlab.studies.claims import pretrain_study
    from vitlab.studies.runner import _common, _plan
    study = pretrain_study((1, 10), ("dino",))  # the methods chosen: DINO alone
    assert {a.values.get("pretrain") for a in study.arms if a.pretraining} == {"dino"}
    assert not any("MAE" in a.label for a in study.arms)
    rates = {"rate": 6400.0, "pretrain_rates": {"dino": 1280.0}}  # a DINO step costs 5 supervised ones here
    common = {**_common(study, "cifar10", None, None, False), "threads": 1, "cache_dir": None, **rates}
    plan = {a.label: r for a, _, r in _plan(study, tmp_path, common, (0,), False)}
    dino = plan["DINO pre-training, 10x"]  # 15 minutes at DINO's own 1,280 images a minute, in batches of 64
    assert dino.pretrain == "dino" and dino.steps == 300 and dino.lr == pytest.approx(5e-4)
    assert dino.pretrain_args["momentum_steps"] == 300 and dino.pretrain_args["teacher_temp_steps"] == 90
    assert plan["DINO pre-training, 1x"].pretrain_args["momentum_steps"] == plan["DINO pre-training, 1x"].steps == 30
    tuned, scratch = plan["DINO 10x, 10% labels"], plan["no pre-training, 11x, 10% labels"]
    assert tuned.steps == 150 and tuned.pretrain_args == {}  # fine-tunes and scratch at the supervised rate
    assert scratch.steps == 1650 and scratch.lr == pytest.approx(1.5e-3)
    ibot = next(a for a in pretrain_study((2,), ("ibot",)).arms if a.pretraining)  # iBOT: DINO's lr and schedules
    assert ibot.label == "iBOT pre-training, 2x" and ibot.values["lr"] == pytest.approx(5e-4)
    assert ibot.step_args == {"momentum_steps": 1.0, "teacher_temp_steps": 0.3}
    assert [a.values["pretrain"] for a in pretrain_study(methods=("mpp", "mae", "dino")).arms if a.pretraining] == [
        "mpp", "mpp", "mae", "mae", "dino", "dino"]
    with pytest.raises(ValueError, match=r"pretrain methods \['byol'\] are not valid; accepted: one or more of mpp, "
                                         r"mae, dino"):
        pretrain_study(methods=("byol",))
    assert main(["study", "pretrain", "--methods", "dino,byol", "--out", str(tmp_path / "s")]) == 2
    assert "pretrain methods ['dino', 'byol'] are not valid; accepted: one or more of mpp, mae, dino" in \
        capsys.readouterr().err
    assert main(["study", "hybrid", "--methods", "dino", "--out", str(tmp_path / "s")]) == 2
    assert "pretrain budgets and methods are not valid for the hybrid study" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_each_pre_training_method_is_calibrated_once_by_its_own_timed_run(tmp_path, monkeypatch):
    from vitlab.studies import runner
    from vitlab.studies.claims import pretrain_study
    speed = {None: 100, "mae": 300, "dino": 25}  # images a second each kind of run trains
    timed = []

    def fake_train(recipe, log=None, **kw):
        timed.append((recipe.pretrain if recipe.pretrain != "none" else None, recipe.time_budget, recipe.steps))
        return {"images": 60 * speed[timed[-1][0]], "train_seconds": 60.0, "steps": 10}

    monkeypatch.setattr(runner, "train", fake_train)
    study = pretrain_study(methods=("mae", "dino"))
    common = {"data": "cifar10", "time_budget": 1.5, "threads": 1, "cache_dir": None}
    arms = {a.values["pretrain"]: a for a in study.arms if a.pretraining}
    got = {m: runner.calibrate(tmp_path, common, lambda s: None, arms.get(m)) for m in (None, "mae", "dino")}
    assert {m: g["images_per_minute"] for m, g in got.items()} == {None: 6000, "mae": 18000, "dino": 1500}
    assert [t[:2] for t in timed] == [(None, 1.0), ("mae", 1.0), ("dino", 1.0)]  # a minute each, timed, not steps
    assert all(t[2] is None for t in timed)
    recorded = json.loads((tmp_path / "calibration.json").read_text())
    assert set(recorded) == {"cifar10, 1 thread(s) per run", "cifar10, 1 thread(s) per run, mae pre-training",
                             "cifar10, 1 thread(s) per run, dino pre-training"}
    assert runner.calibrate(tmp_path, common, lambda s: None, arms["dino"]) == got["dino"] and len(timed) == 3
    said = runner.budget_said(common, False, {**got[None], "pretraining": {"dino": got["dino"]}})
    assert "at 6,000 training images a minute; dino pre-training at its own 1,500" in said["budget"]


def test_the_pretrain_verdict_agrees_when_one_method_is_ahead_on_both_shares():
    from vitlab.studies.claims import pretrain_study
    study = pretrain_study((10,), ("mae", "dino"))
    scratch = {f"no pre-training, 11x, {s} labels": [0.50, 0.51, 0.52] for s in ("10%", "100%")}
    behind = {f"MAE 10x, {s} labels": [0.40, 0.41, 0.42] for s in ("10%", "100%")}
    ahead = {f"DINO 10x, {s} labels": [0.60, 0.61, 0.62] for s in ("10%", "100%")}
    level = {f"DINO 10x, {s} labels": [0.50, 0.52, 0.54] for s in ("10%", "100%")}
    verdict, text = study.answer(_rows({**scratch, **behind, **ahead}))
    assert verdict == "agrees" and "DINO 10x, 100% labels vs no pre-training, 11x, 100% labels: +10.0" in text
    assert study.answer(_rows({**scratch, **behind, **level}))[0] == "not separated"
    assert study.answer(_rows({**scratch, **behind, **{k.replace("MAE", "DINO"): v for k, v in behind.items()}}))[0] \
        == "disagrees"


def test_a_free_slot_takes_a_run_that_does_not_wait_for_the_teacher(tmp_path):
    from types import SimpleNamespace

    from vitlab.runs.jobs import ready
    from vitlab.studies.runner import _job
    runs = tmp_path / "runs"
    teacher, outside = runs / "teacher-seed0", tmp_path / "my-teacher"

    def job(name, teacher=None):
        recipe = SimpleNamespace(out=str(runs / name), teacher=teacher, init=None, to_dict=lambda: {"lr": 0.1})
        return _job(name, recipe)
    student, alone = job("student-seed0", str(teacher)), job("alone-seed0")
    assert student.needs == (teacher,) and not ready(student) and ready(alone)  # the run without one goes first
    assert (runs / "student-seed0.yaml").read_text() == "lr: 0.1\n"  # its recipe, beside its folder
    (teacher).mkdir(parents=True)
    (teacher / "summary.json").write_text("{}")
    assert ready(student)
    # a teacher that is no run of the study (a model folder of the user's) is not waited for
    assert job("s", str(outside)).needs == ()


def test_the_distillation_plan_trains_students_without_a_teacher_beside_it():
    from vitlab.studies.runner import RUN_OVERHEAD, planned_minutes
    run, teacher = 10 + RUN_OVERHEAD, 2 * 10 + RUN_OVERHEAD
    # the teacher on one slot; beside it the three runs without a teacher (two of them before it ends), then the
    # nine students: the slots end at 64.5 + 10.75, not at the teacher's 20.75 plus six runs of two slots
    assert planned_minutes(STUDIES["distill"], 10, (0, 1, 2), 2) == pytest.approx(7 * run)
    assert 7 * run < teacher + 6 * run


def test_a_study_folder_holding_its_probes_features_is_claimed_again(tmp_path):
    # a pretrain study leaves its probes' feature cache beside the runs; the next study in that folder goes on
    from vitlab.runs.folder import STUDY_FEATURES, STUDY_RUNS, claim_folder

    out = tmp_path / "studies"
    with claim_folder(out, "study"):
        (out / STUDY_RUNS).mkdir()
        (out / STUDY_FEATURES).mkdir()
        (out / "pretrain.md").write_text("table")
    with claim_folder(out, "study"):
        pass
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"did not write \(notes.txt\)"):
        with claim_folder(out, "study"):
            pass


def test_a_bar_s_value_is_written_above_its_error_bar_and_seed_dots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vitlab.studies.report import _bars

    rows = [{"label": "a", "top1_mean": 0.57, "top1_std": 0.008, "top1": {"0": 0.573, "1": 0.559, "2": 0.574}},
            {"label": "b", "top1_mean": 0.572, "top1_std": 0.0156, "top1": {"0": 0.59, "1": 0.5626, "2": 0.5633}},
            {"label": "c", "top1_mean": 0.51, "top1_std": None, "top1": {"0": 0.51}}]
    fig, ax = plt.subplots()
    _bars(ax, rows)
    fig.canvas.draw()
    for text, row in zip(ax.texts, rows):
        assert text.get_text() == f"{100 * row['top1_mean']:.1f}"
        bottom = ax.transData.inverted().transform(text.get_window_extent().get_points())[0][1]
        assert bottom > 100 * max(row["top1_mean"] + (row["top1_std"] or 0), *row["top1"].values())
    plt.close(fig)


def test_arm_patterns_pick_their_arms_and_the_runs_they_start_from(tmp_path, capsys):
    from vitlab.studies.claims import pretrain_study
    from vitlab.studies.runner import _common, _plan, select_runs
    study = pretrain_study((79,))
    common = {**_common(study, "cifar10", None, None, False), "threads": 1, "cache_dir": None}
    plan = _plan(study, tmp_path, common, (0, 1), False)
    assert select_runs(study, plan, None) is plan
    chosen = select_runs(study, plan, ["mae 79x*"])  # case-insensitive; the encoder they start from comes along
    assert [(a.label, s) for a, s, _ in chosen] == [
        ("MAE pre-training, 79x", 0), ("MAE 79x, 10% labels", 0), ("MAE 79x, 10% labels", 1),
        ("MAE 79x, 100% labels", 0), ("MAE 79x, 100% labels", 1)]
    assert Path(chosen[1][2].init) == Path(chosen[0][2].out)
    two = select_runs(study, plan, ["MAE 79x*", "no pre-training, 1x, *"])
    assert {a.label for a, _, _ in two} == {"MAE pre-training, 79x", "MAE 79x, 10% labels", "MAE 79x, 100% labels",
                                            "no pre-training, 1x, 10% labels", "no pre-training, 1x, 100% labels"}
    with pytest.raises(ValueError, match=r"--arm 'MAE 3x\*' matches no arm of the pretrain study; accepted: shell "
                                         r"patterns .*: MAE pre-training, 79x; DINO pre-training, 79x; no "):
        select_runs(study, plan, ["MAE 3x*"])
    out = tmp_path / "s"
    assert main(["study", "hybrid", "--quick", "--arm", "nothing*", "--out", str(out)]) == 2
    assert "--arm 'nothing*' matches no arm of the hybrid study" in capsys.readouterr().err
    assert not out.exists()  # nothing written for a refused study


def test_a_study_of_some_arms_reports_them_and_is_incomplete_until_the_rest_are_trained(tmp_path):
    out = tmp_path / "s"
    part = run_study("pos-embed", out=out, quick=True, seeds=(0,), arms=["learned*"], log=lambda s: None)
    assert [r["label"] for r in part["rows"]] == ["learned 1D"]
    assert part["verdict"] == "incomplete"
    assert part["answer"] == "not trained yet: none; fixed 2D sin-cos (the study without --arm trains them)"
    assert "**Verdict: incomplete.**" in (out / "pos-embed.md").read_text()
    assert len([p for p in (out / "runs").iterdir() if p.is_dir()]) == 1  # the other arms were not trained
    # an arm trained on fewer seeds than asked for is reported with the seeds it has
    more = run_study("pos-embed", out=out, quick=True, seeds=(0, 1), arms=["none"], log=lambda s: None)
    assert {r["label"]: sorted(r["top1"]) for r in more["rows"]} == {"learned 1D": [0], "none": [0, 1]}
    assert more["rows"][0]["top1"] == part["rows"][0]["top1"] and more["rows"][0]["top1_std"] is None
    assert more["verdict"] == "incomplete" and more["answer"].startswith(
        "not trained yet: learned 1D (seed 1); fixed 2D sin-cos (")
    learned = next(line for line in (out / "pos-embed.md").read_text().splitlines() if line.startswith("| learned"))
    assert f"| {100 * part['rows'][0]['top1'][0]:.2f} |  |" in learned  # seed 0's column holds it, seed 1's is empty
    whole = run_study("pos-embed", out=out, quick=True, seeds=(0,), log=lambda s: None)
    assert [r["label"] for r in whole["rows"]] == [a.label for a in STUDIES["pos-embed"].arms]
    assert whole["verdict"] == "not separated"  # one seed
    assert whole["rows"][0]["top1"] == part["rows"][0]["top1"] and whole["rows"][0]["runs"] == part["rows"][0]["runs"]


def test_a_stopped_study_stops_the_runs_it_started(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM to a study with --jobs 2 while its runs train: every run it started is stopped (none goes on
    writing unsupervised), their logs closed and their claims released, and the interrupt goes on up."""
    import subprocess
    import sys

    from vitlab.progress import Progress
    from vitlab.studies import runner
    started, real_popen = [], subprocess.Popen

    def child(folder, recipe):  # a run that would train for a minute, started as the study starts its runs
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def log(line):  # the study's log line after its second run started: stopped there, as by Ctrl-C
        if len(started) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_child_command", child)
    monkeypatch.setattr(subprocess, "Popen", popen)
    jobs = [(name, load_recipe(None, out=str(tmp_path / "runs" / name))) for name in ("a", "b", "c")]
    with pytest.raises(KeyboardInterrupt), Progress(total=3, desc="runs", disable=True) as bar:
        runner._train_arms(jobs, 2, log, bar)
    assert len(started) == 2  # the third never began
    assert [p.poll() for p in started] == [-15, -15]  # stopped (SIGTERM), not left running
    assert not list((tmp_path / "runs").glob("*.lock"))


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaps has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_runs_of_a_study_killed_with_9_die_with_it(tmp_path):
    """kill -9 leaves a study no handler to run: its runs still stop (their parent's death is their signal), and
    the study's locks on them are free for the next study at once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from vitlab.runs.folder import lock_holder
    study = f"""
import sys
from vitlab.progress import Progress
from vitlab.studies import runner
from vitlab.train.recipe import load_recipe
runner._child_command = lambda folder, recipe: [sys.executable, "-c",
    f"import os, time; open({{str(folder) + '.pid'!r}}, 'w').write(str(os.getpid())); time.sleep(60)"]
jobs = [(n, load_recipe(None, out={str(tmp_path / 'runs')!r} + '/' + n)) for n in 'ab']
with Progress(total=2, disable=True) as bar:
    runner._train_arms(jobs, 2, print, bar)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, "-c", study], env=env, stdout=subprocess.DEVNULL)
    pids = [tmp_path / "runs" / f"{n}.pid" for n in "ab"]
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p.read_text()) for p in pids]
    assert all(lock_holder(tmp_path / "runs" / f"{n}.lock") == str(parent.pid) for n in "ab")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in children)
    assert all(lock_holder(tmp_path / "runs" / f"{n}.lock") is None for n in "ab")


@pytest.mark.slow
def test_a_failed_run_is_reported_by_its_own_error_line(tmp_path, monkeypatch):
    """The run's reason, not the last line of its log: other lines can follow it (a run of a killed study that still
    trains there writes into the same log), and an earlier start's lines come before it."""
    import sys

    from vitlab.progress import Progress
    from vitlab.runs.jobs import failure_reason
    from vitlab.studies import runner
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "a.log").write_text("epoch 1: loss 0.5\nvitlab train: error: an earlier start's reason\n")
    lines = ["epoch 9: loss 0.3", "vitlab train: error: the reason", "epoch 10: loss 0.2922 lr 1e-3"]
    code = f"import sys; print({chr(10).join(lines)!r}); sys.exit(2)"
    monkeypatch.setattr(runner, "_child_command", lambda folder, recipe: [sys.executable, "-c", code])
    jobs = [("a", load_recipe(None, out=str(runs / "a")))]
    with pytest.raises(RuntimeError) as e, Progress(total=1, disable=True) as bar:
        runner._train_arms(jobs, 2, lambda s: None, bar)
    assert str(e.value) == f"study arm(s) failed: a (exit 2: vitlab train: error: the reason; log {runs / 'a.log'})"
    assert failure_reason(tmp_path / "none.log") == "no output"


def test_a_budgeted_study_trains_every_arm_the_same_steps_whatever_loads_the_machine(tmp_path, cache_dir,
                                                                                     monkeypatch):
    """Each arm trains while the machine is loaded differently (its clock runs 0.2x to 5x as fast as the one the
    budget was measured on): a study budget in minutes is calibrated once into steps, every arm trains those steps,
    the report says how many steps and images each trained, and a re-run reuses the calibration."""
    from vitlab.studies import runner
    real, speeds, runs = runner.train, {"pos_embed=none": 5.0, "pos_embed=sincos": 0.2}, []

    def loaded(recipe, resume=False, log=None, now=None):
        speed = next((v for k, v in speeds.items() if k in Path(recipe.out).name), 1.0)
        clock = [0.0]

        def now():  # every reading of the clock: busier machines see more time pass per step
            clock[0] += 0.05 * speed
            return clock[0]
        runs.append(Path(recipe.out).name)
        return real(recipe, resume=resume, log=log, now=now)

    monkeypatch.setattr(runner, "train", loaded)
    said = []
    arms = ["none", "fixed*"]  # the unloaded arm, learned 1D, is left out for time
    result = run_study("pos-embed", out=tmp_path, data="digits", budget=0.015, seeds=(0,), threads=1, arms=arms,
                       log=said.append)
    calibration = json.loads((tmp_path / "calibration.json").read_text())["digits, 1 thread(s) per run"]
    assert runs[0] == "run" and len(runs) == 3 and any(s.startswith("calibrating") for s in said)
    steps = {r["label"]: r["steps"] for r in result["rows"]}
    expected = round(calibration["images_per_minute"] * 0.015 / 64)
    assert expected > 3 and all(s == {0: expected} for s in steps.values()), steps
    assert result["unit"] == "steps" and result["per_run"] == expected
    table = (tmp_path / "pos-embed.md").read_text()
    assert f"trained as {expected:,} steps of 64 images" in table
    for row in result["rows"]:
        run = Path(row["runs"][0])
        assert json.loads((run / "summary.json").read_text())["steps"] == expected
        assert f"| {expected:,} | {row['images'][0]:,} |" in table and row["images"][0] > expected * 60
    said.clear()
    assert run_study("pos-embed", out=tmp_path, data="digits", budget=0.015, seeds=(0,), threads=1, arms=arms,
                     log=said.append)["per_run"] == expected
    assert len(runs) == 3 and not any(s.startswith("calibrating") for s in said)  # measured once, nothing to train


def test_the_pretrain_figure_draws_each_encoder_s_knn_and_probe_against_its_minutes(tmp_path, monkeypatch):
    from vitlab.studies import report
    from vitlab.studies.claims import pretrain_study, probe_label
    study = pretrain_study((1, 3), ("dino",))
    rows = _rows({"no pre-training, 1x, 10% labels": [0.30, 0.31, 0.32], "DINO 1x, 10% labels": [0.33, 0.34, 0.35],
                  "DINO 3x, 10% labels": [0.40, 0.41, 0.42]})
    for r, x in zip(rows, (0, 1, 3)):
        r.update(x=x, panel="10% labels", group=next(a.group for a in study.arms if a.label == r["label"]),
                 teacher=False)
    for encoder, knn, probe in (("DINO 1x", 0.25, 0.30), ("DINO 3x", 0.35, 0.40), ("random encoder", 0.29, 0.36)):
        rows.append({"label": probe_label(encoder, 1.0), "group": "linear probe", "encoder": encoder, "knn": knn,
                     "top1_mean": probe, "teacher": False})
    figures = []
    monkeypatch.setattr(report, "save", lambda fig, path: figures.append(fig) or path)
    result = {"study": "pretrain", "rows": rows, "recipe": {"time_budget": 1.5}, "per_run": 224, "unit": "steps",
              "budget": "1.5 min per run", "data": "cifar10"}
    report.plot_study(result, study, tmp_path / "pretrain.png")
    tuned, frozen = figures[0].axes
    assert tuned.get_xlabel() == frozen.get_xlabel() == "pre-training budget (minutes)"
    dino = next(bars for bars in tuned.containers if bars.get_label() == "DINO")
    assert list(dino.lines[0].get_xdata()) == [0, 1.5, 4.5]  # the scratch run's 0, then each encoder's own minutes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in frozen.get_lines()}
    assert lines["DINO k-NN"][0] == lines["DINO linear probe"][0] == [1.5, 4.5]
    assert lines["DINO k-NN"][1] == pytest.approx([25.0, 35.0])
    assert lines["DINO linear probe"][1] == pytest.approx([30.0, 40.0])
    assert lines["untrained k-NN"][1] == pytest.approx([29.0, 29.0])
    assert lines["untrained linear probe"][1] == pytest.approx([36.0, 36.0])
