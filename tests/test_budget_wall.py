"""A run's length after it started: a finished run given more epochs goes on (its first summary kept); a resume
may shorten a run (fewer epochs, down to those done; a time budget, also for a run that had none)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import vitlab
from vitlab.runs.format import read_history


def arrays(n=200):
    d = np.load(vitlab.__path__[0] + "/data/digits.npz")
    return d["images"][:n, ..., None], d["labels"][:n]


def test_a_finished_run_goes_on_for_more_epochs(tmp_path):
    opts = dict(epochs=1, threads=1, precision="fp32", cache_dir=str(tmp_path / "cache"))
    first = vitlab.fit("vit_micro_patch2_8", arrays(), out=tmp_path / "run", **opts)
    assert first.summary["epochs"] == 1
    more = vitlab.fit(resume=first.out, epochs=2)
    assert more.summary["epochs"] == 2 and [r.epoch for r in read_history(first.out)] == [1, 2]
    assert json.loads((first.out / "summary-epoch1.json").read_text())["epochs"] == 1  # the first summary kept
    with pytest.raises(ValueError, match="nothing to resume"):
        vitlab.fit(resume=first.out)  # finished, and nothing more asked


def test_a_resume_may_shorten_the_run_but_not_below_the_epochs_done(tmp_path):
    from vitlab.api import resumed_recipe
    first = vitlab.fit("vit_micro_patch2_8", arrays(), out=tmp_path / "run", epochs=2, threads=1,
                       cache_dir=str(tmp_path / "cache"))
    (first.out / "summary.json").unlink()  # as if stopped after its second epoch
    assert resumed_recipe(first.out, {"epochs": 2}).epochs == 2
    assert resumed_recipe(first.out, {"time_budget": 0.5}).time_budget == 0.5  # a budget where it had none
    with pytest.raises(ValueError, match=r"accepted: a number >= 2 \(the epochs done\)"):
        resumed_recipe(first.out, {"epochs": 1})
    with pytest.raises(ValueError, match="accepted: minutes > 0"):
        resumed_recipe(first.out, {"time_budget": -1})


def test_a_budget_run_evaluates_a_sample_during_training_and_the_whole_split_at_the_end(tmp_path, monkeypatch):
    from vitlab.train import load_recipe, setup, train
    monkeypatch.setattr(setup, "EVAL_SHARE", 1e-9)  # the smallest sample, whatever the machine's speed
    monkeypatch.setattr(setup, "EVAL_SAMPLE_MIN", 50)
    seen, evaluate = [], setup.Run.evaluate

    def counted(self, model, limit=None, sample=None):
        metrics = evaluate(self, model, limit=limit, sample=sample)
        seen.append(metrics["logits"]["count"])
        return metrics

    monkeypatch.setattr(setup.Run, "evaluate", counted)
    lines = []
    summary = train(load_recipe(None, model="vit_micro_patch2_8", batch_size=256, precision="fp32", threads=1,
                                time_budget=0.3, out=str(tmp_path / "run")), log=lines.append)
    assert any(line.startswith("evaluating on about 50 of the 360 test images") for line in lines), lines
    during, last = seen[2:-1], seen[-1]  # after the two probes of the end's cost
    assert summary["epochs"] >= 2 and during and all(n == 45 for n in during), seen  # every 8th of 360
    assert last == 360 and summary["num_test"] == 360
