"""The learning-rate schedule, reduce-on-plateau and early stopping."""
import json
import math

import pytest
import torch

from vitlab.train import load_recipe, train
from vitlab.train.schedule import LrSchedule, Plateau, step_share, warmup_cosine


def test_warmup_then_cosine():
    assert warmup_cosine(0.0, 1.0, 0.0, 0.1) == 0.0
    assert warmup_cosine(0.05, 1.0, 0.0, 0.1) == pytest.approx(0.5)
    assert warmup_cosine(0.1, 1.0, 0.0, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(0.55, 1.0, 0.1, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(1.0, 1.0, 0.1, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(1.7, 1.0, 0.1, 0.1) == pytest.approx(0.1)  # past the end: stays at min_lr


def test_plateau_reduces_after_patience():
    p = Plateau(patience=2, factor=0.5)
    assert [p.step(m) for m in (0.5, 0.6, 0.6, 0.55)] == [False, False, False, True]
    assert p.scale == 0.5
    assert p.step(0.7) is False and p.scale == 0.5  # an improvement resets the count
    restored = Plateau(2, 0.5)
    restored.load_state_dict(p.state_dict())
    assert restored.state_dict() == p.state_dict()


def test_schedule_writes_each_steps_rate_into_every_group_times_the_plateau_factor():
    weights = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    optimizer = torch.optim.SGD([{"params": [weights[0]]}, {"params": [weights[1]], "lr_scale": 0.25}], lr=1.0)
    plateau = Plateau(patience=1, factor=0.5)
    schedule = LrSchedule(lr=2.0, min_lr=0.1, warmup=0.2, total_steps=10, plateau=plateau)
    for step in range(10):
        expected = warmup_cosine(step / 10, 2.0, 0.1, 0.2, step_share(step / 10, step, 10))
        assert schedule.apply(optimizer, step / 10, step) == expected
        assert [g["lr"] for g in optimizer.param_groups] == [expected, expected * 0.25]
    assert schedule.lr_at(0.0, 0) == pytest.approx(2.0 * 0.1 / 0.3)  # the first step learns
    plateau.step(1.0), plateau.step(0.5)  # the run's plateau, stepped by its evaluations, halves the rate
    assert schedule.apply(optimizer, 0.5, 5) == pytest.approx(0.5 * warmup_cosine(0.5, 2.0, 0.1, 0.2, 0.1))
    assert schedule.describe() == "warmup over the first 2 of 10 steps, lr 0.667 to 2"
    assert LrSchedule(2.0, 0.1, 0.2, 10, plateau, by_time=True).describe().startswith("warmup over the first 20% of")


def test_early_stop_ends_a_run_that_does_not_improve(tmp_path, cache_dir):
    out = tmp_path / "run"
    summary = train(load_recipe(None, model="vit_micro_patch2_8", epochs=40, lr=1e-9, min_lr=0.0, warmup=0.0,
                                early_stop=2, plateau_patience=1, train_fraction=0.1, precision="fp32", threads=1,
                                out=str(out)))
    assert summary["stopped_early"] and summary["epochs"] < 40
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == summary["epochs"]


def test_progressive_size_grows_in_patch_steps_to_full():
    from vitlab.train.progressive import progressive_size
    full = (32, 32)
    sizes = [progressive_size(p / 100, full, 0.5, 0.6, 8) for p in range(101)]
    assert sizes[0] == (16, 16) and sizes[-1] == full
    assert all(h % 8 == 0 and w % 8 == 0 for h, w in sizes)
    assert all(a[0] <= b[0] for a, b in zip(sizes, sizes[1:]))  # never shrinks
    assert {s for s in sizes} == {(16, 16), (24, 24), (32, 32)}
    assert progressive_size(0.59, full, 0.5, 0.6, 8) == (24, 24)
    assert progressive_size(0.6, full, 0.5, 0.6, 8) == full
    # off, non-square, and a start smaller than one patch
    assert progressive_size(0.0, full, 1.0, 0.6, 8) == full
    assert progressive_size(0.0, (32, 48), 0.5, 0.5, 4) == (16, 24)
    assert progressive_size(0.0, (8, 8), 0.1, 0.5, 2) == (2, 2)
