"""benchmarks/teacher_fit.py: a teacher's fit on the training images, from its own predictions."""
from __future__ import annotations

import pytest
import torch
from conftest import benchmark

import vitlab
from vitlab.data.augment import normalize
from vitlab.data.sources import load_data


def test_the_table_s_figures_are_the_teacher_s_mirror_mean_predictions_against_the_labels(tmp_path, cache_dir):
    bench = benchmark("teacher_fit")
    data = load_data("digits", cache_dir=cache_dir, log=lambda *_: None)
    torch.manual_seed(0)
    model = vitlab.create_model("vit_micro_patch2_8", num_classes=10, in_chans=1)
    model.pretrained_cfg.update(mean=(0.3,), std=(0.4,))
    vitlab.save(model, tmp_path / "teacher")
    row = bench.fits(tmp_path / "teacher", data.train, data.test, taus=(1.0, 3.0), batch=100)
    vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=5, in_chans=1), tmp_path / "five")
    with pytest.raises(ValueError, match="a teacher of 5 classes, the data has 10"):
        bench.fits(tmp_path / "five", data.train, data.test)
    model.eval()
    for split, name in ((data.train, "train_top1"), (data.test, "test_top1")):
        logits = mirror_logits(model, split.images)
        assert row[name] == pytest.approx((logits.argmax(1) == split.labels).float().mean().item())
    logits, labels = mirror_logits(model, data.train.images), data.train.labels
    for tau in (1, 3):
        on_label = torch.softmax(logits / tau, 1)[torch.arange(len(labels)), labels].mean().item()
        assert row[f"off_label_t{tau}"] == pytest.approx(1 - on_label, rel=1e-4)


def mirror_logits(model, images):
    """The mean of the model's logits on the images and on their mirror images."""
    with torch.no_grad():
        x = normalize(images, (0.3,), (0.4,))
        return (model(x) + model(x.flip(-1))) / 2
