"""benchmarks/pretrain_curve.py: the pre-training curve's tables and figure, read from run folders and probes."""
from __future__ import annotations

import json

import pytest
from conftest import benchmark


@pytest.fixture
def bench():
    return benchmark("pretrain_curve")


def run(work, name, top1=None):
    folder = work / "runs" / name
    folder.mkdir(parents=True)
    if top1 is not None:
        (folder / "summary.json").write_text(json.dumps({"top1": top1}))


def probed(work, name, knn, linear):
    (work / "probes" / name).mkdir(parents=True)
    (work / "probes" / name / "probe.json").write_text(json.dumps({"knn": {"top1": knn}, "linear": {"top1": linear}}))


def test_fine_tunes_meet_scratch_of_the_same_total_time_and_the_figure_is_drawn(bench, tmp_path):
    run(tmp_path, "dino-3min")
    probed(tmp_path, "dino-3min", 0.30, 0.40)
    probed(tmp_path, "untrained", 0.27, 0.33)
    for seed, (tuned, scratch) in enumerate([(0.50, 0.40), (0.52, 0.41), (0.51, 0.42)]):
        run(tmp_path, f"dino-3min-ft10-s{seed}", tuned)
        run(tmp_path, f"scratch-4.5min-10-s{seed}", scratch)
    run(tmp_path, "five_distill-1.5min-ft100-s0", 0.70)
    run(tmp_path, "five_scratch-3min-100-s0", 0.72)
    run(tmp_path, "five_scratch-6min-100-s0", 0.75)
    run(tmp_path, "five_scratch-6min-100-s1", 0.77)
    run(tmp_path, "dino-3min-ft100-s0")  # still training: left out
    data = bench.collect(tmp_path)
    assert data["untrained"] == pytest.approx((27.0, 33.0))
    assert data["pretrained"][("", "dino", 3.0)] == pytest.approx((30.0, 40.0))
    lines = bench.report(data, 1.5)
    assert "| dino 3 min | 30.00 | 40.00 |" in lines
    row = next(line for line in lines if line.startswith("| cifar10, 10% | dino 3 min"))
    assert "51.00 +/- 1.00 (n=3)" in row and "41.00 +/- 1.00 (n=3) (4.5 min)" in row
    assert "+10.00 +/- 1.41" in row and row.endswith("| yes |")
    five = next(line for line in lines if line.startswith("| five, 100% | distill 1.5 min"))
    assert "-2.00" in five and five.endswith("| n/a |")  # one seed of its own: no spread, nothing said
    assert not any("100% | dino" in line for line in lines)
    assert bench.spread(data["scratch"], ("five", 100, 3.0)) == pytest.approx(1.4142, abs=1e-3)  # the 6-min seeds'
    bench.draw(data, 1.5, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000


def test_the_guidance_table_is_written_from_the_runs_and_read_back_by_pretrain(bench, tmp_path, monkeypatch):
    from vitlab.objectives import guidance as guidance_module
    run(tmp_path, "mae-3min")
    (tmp_path / "runs" / "mae-3min" / "summary.json").write_text(json.dumps(
        {"data": "CIFAR-10", "num_train": 1000, "model": "vit_nano_patch4_32", "images": 36_000}))
    probed(tmp_path, "mae-3min", 0.3125, 0.40)
    probed(tmp_path, "untrained", 0.27, 0.33)
    table = tmp_path / "knn_measured.json"
    old = {"method": "mae", "data": "CIFAR-10", "images": 1000, "model": "vit_nano_patch4_32", "minutes": 3.0,
           "rate": 1.0, "knn": 1.0, "untrained": 2.0, "cpu": "box"}
    other = dict(old, method="mpp")
    table.write_text(json.dumps({"about": "figures", "points": [old, other]}))
    bench.write_guidance(bench.guidance_points(tmp_path, bench.collect(tmp_path), "box"), table)
    doc = json.loads(table.read_text())
    assert doc["about"] == "figures" and doc["points"][1] == other  # the others kept, in place
    assert doc["points"][0] == dict(old, rate=200.0, knn=31.25, untrained=27.0)  # 36,000 images in 3 min
    monkeypatch.setattr(guidance_module.resources, "files", lambda package: tmp_path)
    points = guidance_module.measured()
    assert points[0].epochs == pytest.approx(36.0) and points[0].knn > points[0].untrained
