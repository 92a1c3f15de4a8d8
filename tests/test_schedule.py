"""The learning-rate schedule, reduce-on-plateau and early stopping."""
import json
import math

import pytest

from vitlab.train import load_recipe, train
from vitlab.train.schedule import Plateau, warmup_cosine


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


def test_early_stop_ends_a_run_that_does_not_improve(tmp_path, cache_dir):
    out = tmp_path / "run"
    summary = train(load_recipe(None, model="vit_micro_patch2_8", epochs=40, lr=1e-9, min_lr=0.0, warmup=0.0,
                                early_stop=2, plateau_patience=1, precision="fp32", threads=1, out=str(out)))
    assert summary["stopped_early"] and summary["epochs"] < 40
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == summary["epochs"]
