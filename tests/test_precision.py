"""Precision 'auto' follows the measurement: bf16 on a CPU with AMX only for models large enough to gain from it
(devices.auto_precision); inference takes the same rule, and `vitlab eval` of a run folder the run's own precision."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab import devices
from vitlab.infer.eval import evaluate_folder
from vitlab.infer.precision import inference_precision
from vitlab.infer.predict import class_probabilities, predict_files
from vitlab.models import create_model
from vitlab.models.summary import matmul_macs
from vitlab.train import setup
from vitlab.train.distributed import Dist
from vitlab.train.recipe import Recipe, load_recipe
from vitlab.train.trainer import train

CPU = torch.device("cpu")
TINY = dict(img_size=8, in_chans=1, num_classes=10, patch_size=4, embed_dim=16, depth=1, num_heads=2)


@pytest.fixture
def amx(monkeypatch):
    """A CPU with AMX, whatever this one has."""
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"amx_bf16", "amx_tile", "avx512_bf16"})


def test_auto_takes_bf16_on_amx_only_from_the_measured_size(amx):
    line = devices.BF16_CPU_MIN_MACS
    precision, why = devices.auto_precision(CPU, line / 4)
    assert precision == "fp32"
    assert why == (f"AMX present, but bf16 training pays only from ~{line / 1e9:g} GMACs per image; this model has "
                   f"{line / 4e9:.2g}")
    assert devices.auto_precision(CPU, line)[0] == devices.auto_precision(CPU, 50 * line)[0] == "bf16"
    between = (devices.BF16_CPU_MIN_MACS_INFERENCE + line) / 2  # inference gains from smaller models than training
    assert devices.auto_precision(CPU, between)[0] == "fp32"
    assert devices.auto_precision(CPU, between, "inference")[0] == "bf16"


def test_auto_stays_float32_without_amx_whatever_the_size(monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert devices.auto_precision(CPU, 1e12)[0] == "fp32"


def test_matmul_macs_are_half_the_flops_of_the_linear_layers():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5), torch.nn.Linear(5, 3))
    model.pretrained_cfg = {"input_size": (3, 2, 2)}
    assert matmul_macs(model) == 12 * 5 + 5 * 3
    assert matmul_macs(model, (12,)) == 12 * 5 + 5 * 3


def choose(model, size, logs):
    augment = SimpleNamespace(img_size=size)
    return setup.choose_precision(Recipe(precision="auto"), model, augment, torch.zeros(2, model.pretrained_cfg[
        "input_size"][0], *size), None, Dist(), logs.append)


def test_training_on_amx_keeps_the_digits_model_in_float32_and_a_vit_s_in_bf16(amx):
    logs = []
    digits = create_model("vit_micro_patch2_8")  # the main job's model (make run)
    assert choose(digits, (8, 8), logs) == "fp32"
    assert logs[-1] == (f"precision auto: float32 (AMX present, but bf16 training pays only from "
                        f"~{devices.BF16_CPU_MIN_MACS / 1e9:g} GMACs per image; this model has "
                        f"{matmul_macs(digits) / 1e9:.2g})")
    small = create_model("vit_small_patch16_224", depth=4)  # a ViT-S/16's width and grid; 4 blocks keep it quick
    assert choose(small, (224, 224), logs) == "bf16" and logs[-1].startswith("precision auto: bf16 (AMX present")


def test_bf16_probabilities_are_within_0_01_of_float32():
    model = create_model("vit_micro_patch2_8").eval()
    images = torch.randint(0, 256, (64, 1, 8, 8), dtype=torch.uint8)
    fp32, bf16 = class_probabilities(model, images), class_probabilities(model, images, precision="bf16")
    assert fp32.dtype == bf16.dtype == torch.float32
    assert not torch.equal(fp32, bf16)  # bf16 did run
    assert (fp32 - bf16).abs().max() < 0.01  # bf16 keeps 8 bits of mantissa: a few 1e-3 on a probability
    assert torch.allclose(bf16.sum(1), torch.ones(64))


def test_inference_follows_the_rule_for_a_model_that_is_not_a_run(amx, monkeypatch, tmp_path):
    model = create_model("vit_micro_patch2_8", **{k: v for k, v in TINY.items() if k != "num_classes"})
    logs = []
    assert inference_precision(model, "auto", CPU, tmp_path, logs.append) == "fp32"
    assert logs == []  # float32, as inference always ran, goes without a word
    monkeypatch.setattr(devices, "BF16_CPU_MIN_MACS_INFERENCE", 1)
    assert inference_precision(model, "auto", CPU, None, logs.append) == "bf16"
    assert logs == [f"precision auto: bf16 (AMX present, and bf16 inference pays from ~1e-09 GMACs per image; "
                    f"this model has {matmul_macs(model) / 1e9:.2g})"]
    assert inference_precision(model, "fp32", CPU, None, logs.append) == "fp32"
    with pytest.raises(ValueError, match="precision 'fp8' is not valid; accepted: auto, fp32, bf16, fp16"):
        inference_precision(model, "fp8", CPU)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A digits run trained and evaluated in bf16 (asked for: 'auto' keeps the digits model in float32)."""
    out = tmp_path_factory.mktemp("bf16") / "run"
    summary = train(load_recipe(None, data="digits", model="vit_micro_patch2_8", model_args=TINY, epochs=1,
                                batch_size=64, precision="bf16", threads=1, train_fraction=0.3, out=str(out)),
                    log=lambda s: None)
    return out, summary


def test_eval_of_a_bf16_run_gives_its_summary_top1(bf16_run, tmp_path):
    out, summary = bf16_run
    assert summary["precision"] == "bf16"
    own = evaluate_folder(out, out=tmp_path / "own")
    assert own["precision"] == "bf16" and own["top1"] == summary["top1"] and own["top5"] == summary["top5"]
    assert json.loads((tmp_path / "own" / "summary.json").read_text())["precision"] == "bf16"
    fp32 = evaluate_folder(out, precision="fp32")
    assert fp32["precision"] == "fp32"


def test_predict_of_a_bf16_run_runs_in_bf16(bf16_run, tmp_path, monkeypatch):
    out, _ = bf16_run
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) * 4).save(tmp_path / "x.png")
    seen = []
    real = class_probabilities
    monkeypatch.setattr("vitlab.infer.predict.class_probabilities", lambda m, x, source, precision: seen.append(
        (precision, m.head.weight.dtype)) or real(m, x, source, precision))
    auto = predict_files(out, [tmp_path / "x.png"], top_k=3)[0]["top"]
    fp32 = predict_files(out, [tmp_path / "x.png"], top_k=3, precision="fp32")[0]["top"]
    assert seen == [("bf16", torch.bfloat16), ("fp32", torch.float32)]  # bf16's weights cast once, before the pass
    assert auto[0]["class"] == fp32[0]["class"]
    assert abs(auto[0]["probability"] - fp32[0]["probability"]) < 0.01


def test_inspect_of_a_bf16_run_computes_its_report_in_bf16(bf16_run, tmp_path, monkeypatch):
    from vitlab.analysis import report
    from vitlab.cli import main as cli_main
    out, _ = bf16_run
    seen = []

    def record(model, images, out_dir, **kwargs):  # what the report's passes would run in
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        (Path(out_dir) / "report.html").write_text("")
        (Path(out_dir) / "analysis.json").write_text("{}")  # the two files every report writes
        return Path(out_dir) / "report.html"

    monkeypatch.setattr(report, "inspect_model", record)
    for extra, folder in (([], "own"), (["--precision", "fp32"], "fp32")):
        assert cli_main(["inspect", str(out), "--num-images", "2", *extra, "--out", str(tmp_path / folder)]) == 0
    assert [enabled for enabled, _ in seen] == [True, False] and seen[0][1] == torch.bfloat16


def test_probe_of_a_bf16_run_takes_its_features_in_bf16(bf16_run, tmp_path):
    from vitlab.probe.run import probe
    out, _ = bf16_run
    got = probe(out, "digits", cache_dir=str(tmp_path / "c"), progress=False, log=lambda s: None)
    assert got["precision"] == "bf16"
    with pytest.raises(ValueError, match="precision 'fp16' is not valid for features; accepted: auto, fp32, bf16"):
        probe(out, "digits", precision="fp16", cache_dir=str(tmp_path / "c"), progress=False, log=lambda s: None)


def test_bf16_inference_casts_the_weights_once_and_keeps_autocasts_probabilities(bf16_run, tmp_path):
    """bf16 inference casts the linear and convolution weights once instead of on every forward pass: the
    probabilities are autocast's own, within 0.01 of float32's, and the top-1 class is float32's on every image
    whose two best float32 classes are more than 0.02 apart (closer ones can swap, as under autocast)."""
    import copy

    import vitlab
    from vitlab.data import load_data
    from vitlab.infer.precision import cast_for_inference
    out, _ = bf16_run
    images = load_data("digits", cache_dir=tmp_path, log=lambda s: None).test.images
    trained = vitlab.load(out)  # one epoch of digits, in bf16
    cast = cast_for_inference(copy.deepcopy(trained), "bf16")
    assert cast.head.weight.dtype == cast.patch_embed.proj.weight.dtype == torch.bfloat16
    assert cast.blocks[0].norm1.weight.dtype == cast.pos_embed.dtype == torch.float32  # what autocast keeps float32
    torch.testing.assert_close(class_probabilities(cast, images, precision="bf16"),
                               class_probabilities(trained, images, precision="bf16"), atol=1e-6, rtol=0)
    assert cast_for_inference(trained, "fp32").head.weight.dtype == torch.float32
    torch.manual_seed(0)
    model = create_model("vit_micro_patch2_8").eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.2)  # classes further apart than at initialisation, as training puts them
    fp32 = class_probabilities(model, images)
    bf16 = class_probabilities(cast_for_inference(model, "bf16"), images, precision="bf16")
    assert not torch.equal(fp32, bf16) and (fp32 - bf16).abs().max() < 0.01
    top2 = fp32.topk(2, dim=1).values
    apart = top2[:, 0] - top2[:, 1] > 0.02
    assert apart.sum() >= 100 and torch.equal(bf16.argmax(1)[apart], fp32.argmax(1)[apart])
