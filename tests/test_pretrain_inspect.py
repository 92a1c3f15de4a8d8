"""What `vitlab inspect` shows of a pre-training run: MAE reconstructions, MPP mean colours, no class-score sections."""
import json

import numpy as np
import pytest
import torch

import vitlab
from vitlab.analysis.pretraining import colour_of_classes, mae_reconstructions, mpp_predictions
from vitlab.analysis.report import Inspection, inspect_model
from vitlab.analysis.sections import pretraining
from vitlab.objectives import create_objective, mean_color_classes


def tiny_encoder(num_classes: int = 10):
    torch.manual_seed(0)
    return vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2, num_classes=num_classes)


def images(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_mae_reconstructions_paste_the_visible_patches_and_grey_the_hidden():
    objective = create_objective("mae", tiny_encoder(), mask_ratio=0.75)
    mean, std = (0.5,) * 3, (0.25,) * 3
    x = images()
    rec = mae_reconstructions(objective, x, mean, std, seed=0)
    again = mae_reconstructions(objective, x, mean, std, seed=0)
    assert np.array_equal(rec.masked, again.masked)  # the seed fixes the mask
    assert not np.array_equal(rec.masked, mae_reconstructions(objective, x, mean, std, seed=1).masked)
    hidden = (rec.masked != rec.images).any(-1)  # (B, H, W)
    per_patch = hidden.reshape(3, 8, 4, 8, 4).any((2, 4))  # (B, 8, 8) hidden patches
    assert (per_patch.sum((1, 2)) == 48).all()  # 75% of the 64 patches of every image
    assert np.allclose(rec.masked[hidden], 0.5)
    assert np.array_equal(rec.pasted[~hidden], rec.images[~hidden])
    assert np.array_equal(rec.pasted[hidden], rec.reconstructed[hidden])
    assert rec.images.shape == rec.reconstructed.shape == (3, 32, 32, 3) and len(rec.loss) == 3
    out = objective(x, masking=None, generator=torch.Generator().manual_seed(0))
    assert np.isclose(np.mean(rec.loss), float(out.loss.detach()), rtol=1e-4)  # same draw: the training loss
    assert objective.training  # its mode comes back


def test_colour_of_classes_inverts_mean_color_classes():
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    classes = mean_color_classes(x, 4)  # (2, 64)
    colours = colour_of_classes(classes, 3)  # (2, 64, 3), bin centres
    means = torch.nn.functional.avg_pool2d(x, 4).flatten(2).transpose(1, 2)
    assert (colours - means).abs().max() <= 1 / 16 + 1e-6
    expected = torch.tensor([[[7.5, 0.5, 3.5]]]) / 8
    assert torch.equal(colour_of_classes(torch.tensor([[64 * 7 + 8 * 0 + 3]]), 3), expected)


def test_mpp_predictions_show_the_corruption_and_the_colours():
    objective = create_objective("mpp", tiny_encoder(), mean=(0.5,) * 3, std=(0.25,) * 3)
    x = images()
    pred = mpp_predictions(objective, x, (0.5,) * 3, (0.25,) * 3, seed=0)
    assert pred.corrupted_mask.shape == (3, 8, 8) and (pred.corrupted_mask.sum((1, 2)) == 32).all()  # 50% of 64
    untouched = ~np.repeat(np.repeat(pred.corrupted_mask, 4, 1), 4, 2)  # (B, H, W) pixels of clean patches
    assert np.array_equal(pred.corrupted[untouched], pred.images[untouched])
    assert np.array_equal(pred.predicted[untouched], pred.true[untouched])  # only corrupted patches show predictions
    levels = np.unique(pred.true * 8 - 0.5)
    assert np.allclose(levels, np.round(levels))  # bin centres of 3-bit colours
    assert all(0 <= a <= 1 for a in pred.accuracy)


@pytest.mark.parametrize("method, figure", [("mae", "mae_reconstructions.png"), ("mpp", "mpp_predictions.png")])
def test_inspect_report_of_a_pretraining_objective(tmp_path, method, figure):
    objective = create_objective(method, tiny_encoder())
    report = inspect_model(objective.encoder, images(2), tmp_path / method, objective=objective,
                           distance_images=images(4))
    html = report.read_text()
    assert figure in html and "patch_grid.png" in html and "attention_distance.png" in html
    for skipped in ("faithfulness.png", "randomisation.png", "head_importance.png"):
        assert skipped not in html and not (tmp_path / method / skipped).exists()
    assert "rollout.png" in html  # the class-agnostic maps read no head: they are drawn
    assert "classifier head is untrained" in html and "&mdash;" not in html  # no top-5 predictions shown
    summary = json.loads((tmp_path / method / "analysis.json").read_text())
    assert summary["pretraining"]["method"] == method


def test_pretraining_section_skips_an_ordinary_model(tmp_path):
    r = Inspection(tiny_encoder(), images(2), tmp_path / "plain")
    pretraining(r)
    assert r.sections == [] and "not a pre-training run" in r.notes[0] and not r.no_classifier
    headless = Inspection(tiny_encoder(num_classes=0), images(2), tmp_path / "headless")
    assert headless.no_classifier and headless.predictions[0]["top"] == []


@pytest.mark.parametrize("method", ["mae", "mpp", "dino"])
def test_inspect_command_on_a_saved_pretraining_objective(tmp_path, method, cache_dir):
    from vitlab.cli import main
    from vitlab.objectives import save_objective

    options = {"mae": {"decoder_depth": 1}, "mpp": {"mean": [0.5], "std": [0.5]}, "dino": {"out_dim": 16}}[method]
    objective = create_objective(method, vitlab.create_model("vit_micro_patch2_8", depth=1, num_classes=0), **options)
    save_objective(objective, tmp_path / "run", method, options)
    out = tmp_path / "report"
    assert main(["inspect", str(tmp_path / "run"), "--num-images", "2", "--distance-images", "20",
                 "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    figure = {"mae": "mae_reconstructions.png", "mpp": "mpp_predictions.png"}.get(method)
    assert figure is None or figure in html
    assert (figure is None) == ("predicts no pixels" in html)
    assert "attention_heads_0.png" in html and "rollout.png" in html and "classifier head is untrained" in html
