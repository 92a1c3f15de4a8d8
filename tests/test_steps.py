"""--steps: a run of a number of optimiser steps, the amount of training a study's arms share whatever loads the
machine."""
import functools
import itertools

import pytest

from vitlab.train import load_recipe, train

TINY = dict(model="vit_micro_patch2_8", batch_size=64, train_fraction=0.5, precision="fp32", threads=1)


def test_a_run_of_steps_takes_that_many_steps_whatever_its_clock(tmp_path, cache_dir):
    """13 steps of 12 an epoch: two epochs, the second cut after its first batch; a clock that runs 100 times as
    fast trains exactly the same (weights and all)."""
    ends = []
    for speed in (0.001, 0.1):
        now = functools.partial(next, itertools.count(0.0, speed))  # each reading: `speed` seconds later
        out = tmp_path / f"run{speed}"
        summary = train(load_recipe(None, **TINY, steps=13, out=str(out)), log=lambda s: None, now=now)
        assert (summary["steps"], summary["steps_budget"], summary["epochs"]) == (13, 13, 2)
        assert summary["images"] == summary["num_train"] + 60  # a whole epoch, then one batch of 718 / 12 images
        ends.append((out / "model.safetensors").read_bytes())
    assert ends[0] == ends[1]


def test_steps_and_a_time_budget_are_refused_together():
    with pytest.raises(ValueError, match="steps=5 is not valid with time_budget=2: a run trains for a number of steps "
                                         "or for a time; accepted: one of them"):
        load_recipe(None, steps=5, time_budget=2)
