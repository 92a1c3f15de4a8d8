"""benchmarks/explain_faithfulness.py: the summary over seeds (best per measure, separation, the floors' verdicts)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import benchmark

import vitlab
from vitlab.analysis.explain import METHODS
from vitlab.analysis.faithfulness import BASELINE_KEYS, METRICS


@pytest.fixture
def bench():
    return benchmark("explain_faithfulness")


def runs(scores_of, seeds=(0, 1, 2)):
    """Per seed a benchmark record whose every measure scores ``scores_of(key, seed)`` (higher better: negated
    where lower is better, so one number orders the keys on all seven measures)."""
    keys = list(METHODS) + list(BASELINE_KEYS)
    return [{"seed": s, "images": 10, "accuracy": 50.0,
             "scores": {k: {m: (v if up else -v) for m, up in METRICS.items() for v in [scores_of(k, s)]}
                        for k in keys},
             "map_cpu_seconds": {k: 0.01 for k in METHODS}} for s in seeds]


def floor_lines(out: str) -> dict[str, str]:
    tail = out.split("floors (random map, edge detector)")[1].splitlines()[1:]
    return {line[2:].split(":")[0]: line for line in tail if line.startswith("- ")}


def test_floors_far_below_every_method_are_called_clearly_below(bench, capsys):
    methods = list(METHODS)
    score = {k: 0.5 + 0.01 * i for i, k in enumerate(methods)} | {"random": 0.0, "edge": 0.1}
    bench.summarise("m", runs(lambda k, s: score[k] + 0.001 * s))
    lines = floor_lines(capsys.readouterr().out)
    assert len(lines) == len(METRICS)
    for line in lines.values():
        assert line.count("below every method, clearly") == 2, line
    # a floor above the weakest method on one seed of three, below it by the mean: below, but not clearly
    bench.summarise("m", runs(lambda k, s: score[k] + (0.5 if k == "edge" and s == 0 else 0.0)))
    for line in floor_lines(capsys.readouterr().out).values():
        assert "edge detector (Sobel) below every method, not clearly" in line, line


def test_a_floor_level_with_a_method_is_named_with_it_and_a_close_one_is_not_clearly_below(bench, capsys):
    methods = list(METHODS)
    weakest = methods[0]
    score = {k: 0.5 + 0.1 * i for i, k in enumerate(methods)} | {"random": 0.0, "edge": 0.5}
    # the weakest method's seeds spread by 0.05: the edge map, level with its mean, is not below it; a random map
    # 0.02 under it would be below it but not clearly
    bench.summarise("m", runs(lambda k, s: score[k] + (0.05 * (s - 1) if k == weakest else 0.0)))
    out = capsys.readouterr().out
    for line in floor_lines(out).values():  # level on seed 1, above on seed 0 (0.45): not below on 2 of 3
        assert f"edge detector (Sobel) NOT below {bench.method_label(weakest)} (not below it on 2 of 3 seeds)" in line
        assert "random map below every method, clearly" in line
    score["random"] = score[weakest] - 0.02
    bench.summarise("m", runs(lambda k, s: score[k] + (0.05 * (s - 1) if k == weakest else 0.0)))
    for line in floor_lines(capsys.readouterr().out).values():
        assert "random map below every method, not clearly" in line, line


def test_the_best_method_and_its_separation_from_the_runner_up(bench, capsys):
    methods = list(METHODS)
    score = {k: 0.1 * i for i, k in enumerate(methods)} | {"random": -1.0, "edge": -1.0}
    bench.summarise("m", runs(lambda k, s: score[k] + 0.001 * s))
    out = capsys.readouterr().out
    best = bench.method_label(methods[-1])
    assert f"overall (mean rank over the {len(METRICS)} measures): {best} (1.00)" in out
    assert f"separated on {len(METRICS)} of {len(METRICS)} measures" in out
    assert out.count("ahead on 3 of 3 seeds") == len(METRICS)
    # seeds spread wider than the lead: nothing separated
    bench.summarise("m", runs(lambda k, s: score[k] + 0.2 * s * (k == methods[-1])))
    assert "separated on 0 of" in capsys.readouterr().out
    # seed 0 lost to the runner-up: the lead holds on two seeds of three
    bench.summarise("m", runs(lambda k, s: score[k] - (0.15 if k == methods[-1] and s == 0 else 0.0)))
    assert capsys.readouterr().out.count("ahead on 2 of 3 seeds") == len(METRICS)


def test_agreement_with_attnlrp_is_measured_once_and_kept(bench, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=16, depth=2, num_heads=2).eval()
    images = torch.randn(4, 3, 32, 32)
    rho = bench.agreement(model, images, batch=2)
    assert set(rho) == set(METHODS) and rho["attnlrp"] == pytest.approx(1.0)
    assert all(-1 <= v <= 1 for v in rho.values()) and rho["raw_attention"] < 1
    path, args = tmp_path / "m-seed0.json", argparse.Namespace(agreement_images=4, batch_size=2)
    done = bench.with_agreement({"images": 4}, model, images, args, path)
    assert json.loads(path.read_text())["rank_correlation_with_attnlrp"] == done["rank_correlation_with_attnlrp"]
    monkeypatch.setattr(bench, "agreement", lambda *a: pytest.fail("measured again"))
    assert bench.with_agreement(done, model, images, args, path) is done
