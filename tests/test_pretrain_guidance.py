"""Where a pre-training user looks: the guidance line at the start (from the one table of measured k-NN figures) and
the encoder's k-NN against an untrained encoder's at the end of the run, logged and kept in summary.json."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.cli import main
from vitlab.objectives import guidance as guidance_module
from vitlab.objectives.guidance import MEASURED, KnnPoint, first_ahead, guidance
from vitlab.probe import pretraining
from vitlab.probe.pretraining import bounded, untrained_like, verdict
from vitlab.probe.run import probe

pytestmark = pytest.mark.usefixtures("one_thread")


def point(minutes, knn, method="mae", rate=100.0, images=6000):
    return KnnPoint(method, "D", images, "m", minutes, rate, knn, 30.0)


def test_epochs_are_the_images_seen_over_the_data_and_the_first_run_ahead_is_found():
    assert point(2, 20).epochs == pytest.approx(2 * 60 * 100 / 6000)
    behind, ahead = first_ahead([point(4, 31), point(1, 25), point(2, 29), point(8, 29.5)])
    assert (behind.minutes, ahead.minutes) == (2, 4)  # sorted by epochs; the later dip below does not count
    assert first_ahead([point(1, 31)]) == (None, point(1, 31))
    assert first_ahead([point(1, 20), point(3, 29)]) == (point(3, 29), None)


def test_the_guidance_scales_the_measured_epochs_to_the_runs_data(monkeypatch):
    monkeypatch.setattr(guidance_module, "MEASURED", (point(1, 25), point(3, 31), point(2, 40, method="mpp")))
    line = guidance("mae", 1000, planned_images=2000)
    assert line.startswith("guidance: MAE's encoder first beat an untrained one's k-NN after 3.0 epochs of 6,000 D")
    assert "was below it after 1.0 (1 min: 25.00%)" in line
    assert "on these 1,000 images that is about 3,000 images seen (this run plans 2,000: likely too few)" in line
    assert "likely too few" not in guidance("mae", 1000, planned_images=5000)
    assert guidance("dino", 10).startswith("guidance: DINO is not measured yet; MAE's encoder first beat")
    assert "after 2.0 epochs" in guidance("mpp", 10) and "below" not in guidance("mpp", 10)
    monkeypatch.setattr(guidance_module, "MEASURED", (point(1, 25),))
    assert "has not beaten an untrained one's k-NN in any run measured" in guidance("mae", 10)


def test_the_table_holds_every_measured_method_each_against_the_untrained_encoder_of_its_machine():
    assert {p.method for p in MEASURED} == {"mae", "mpp", "dino", "ibot", "distill"}
    for cpu in {p.cpu for p in MEASURED}:
        untrained = [p.untrained for p in MEASURED if p.cpu == cpu]
        assert max(untrained) - min(untrained) < 0.5  # one architecture untrained, probed alike on each machine
    assert all(0 < p.knn < 100 and p.rate > 0 for p in MEASURED)
    line = guidance("distill", 50_000)  # measured on the Xeon, and said so; ahead of the untrained from its first run
    assert "first beat an untrained one's k-NN after 0.1 epochs" in line and "Intel Xeon with AMX" in line


def test_the_verdict_says_paid_level_or_below():
    assert verdict(0.612, 0.55).startswith("pre-training has paid")
    assert "level with" in verdict(0.612, 0.607) and verdict(0.612, 0.607).startswith("pre-training has not paid yet")
    assert "below an untrained encoder's" in verdict(0.5367, 0.6067)


def test_the_untrained_encoder_is_the_architecture_as_its_seed_initialises_it():
    torch.manual_seed(5)
    trained = vitlab.create_model("vit_micro_patch2_8", num_classes=0)
    with torch.no_grad():
        trained.pos_embed.add_(1.0)
    state = torch.random.get_rng_state()
    fresh = untrained_like(trained, 5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator left alone
    torch.manual_seed(5)
    again = vitlab.create_model("vit_micro_patch2_8", num_classes=0).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in fresh.state_dict().items())
    assert not torch.equal(fresh.pos_embed, trained.pos_embed)


def test_a_bounded_subset_keeps_every_class_in_its_share():
    labels = torch.arange(10).repeat_interleave(100)
    images = torch.arange(1000)
    x, y = bounded(images, labels, 200)
    assert len(y) == 200 and torch.equal(torch.bincount(y), torch.full((10,), 20)) and torch.equal(x, images[x])
    assert bounded(images, labels, 5000)[1] is labels


def test_a_pretraining_run_ends_with_its_encoders_knn_beside_an_untrained_ones(tmp_path, cache_dir, capsys):
    out = tmp_path / "mae"
    assert main(["pretrain", "--method", "mae", "--data", "digits", "--epochs", "1", "--train-fraction", "0.1",
                 "--threads", "1", "--precision", "fp32", "--pretrain-arg", "decoder_depth=1", "--out", str(out)]) == 0
    said = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["knn_train"], summary["knn_test"]) == (1437, 360)  # the whole labelled splits: under the bounds
    line = next(s for s in said.err.splitlines() + said.out.splitlines() if s.startswith("k-NN top-1"))
    assert f"{summary['knn_top1']:.1%} (untrained encoder: {summary['knn_untrained_top1']:.1%}" in line
    assert any(s.startswith("guidance: MAE's encoder") for s in said.err.splitlines() + said.out.splitlines())
    torch.manual_seed(0)  # the run's seed, its architecture and the preprocessing it recorded, untrained
    untrained = vitlab.create_model("vit_micro_patch2_8", num_classes=0)
    untrained.pretrained_cfg = dict(vitlab.load(out).pretrained_cfg)
    probed = probe(vitlab.save(untrained, tmp_path / "untrained"), "digits", seed=0, progress=False,
                   log=lambda s: None, precision="fp32")
    assert summary["knn_untrained_top1"] == pytest.approx(probed["knn"]["top1"])


def test_unlabelled_images_end_without_a_knn(tmp_path, cache_dir, capsys):
    folder = tmp_path / "flat"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    lines = []
    result = vitlab.pretrain("vit_micro_patch2_8", str(folder), method="mae", out=tmp_path / "run", epochs=1,
                             img_size=8, batch_size=4, threads=1, precision="fp32")
    pretraining.judge_pretraining(result.out, log=lines.append)
    assert "knn_top1" not in result.summary and "knn_top1" not in json.loads((result.out / "summary.json").read_text())
    assert lines == [f"no k-NN of the encoder, which needs a labelled test split: {folder} is a folder of unlabelled "
                     "images (no class folders): a probe needs <root>/<class>/<image>"]
