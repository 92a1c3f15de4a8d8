"""predict and eval prepare images as the model's pretrained config says: crop_pct, interpolation, mean, std, labels."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vitlab
from vitlab.data.augment import normalize
from vitlab.data.decode import read_image
from vitlab.data.views import Preprocess, crop_offsets, resized_size, scale_size
from vitlab.errors import VitlabError
from vitlab.infer.predict import predict_files, prepare_image


@pytest.fixture
def model_folder(tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_32", depth=1, num_classes=3)
    model.pretrained_cfg.update(mean=(0.2, 0.3, 0.4), std=(0.5, 0.6, 0.7), crop_pct=0.5, interpolation="bilinear",
                                label_names=["ant", "bee", "cat"])
    return vitlab.save(model, tmp_path / "m"), model.eval()


def test_scale_size():
    assert scale_size((224, 224), 0.875) == (256, 256) and scale_size((32, 48), None) == (32, 48)


def test_predict_transform_keeps_aspect_and_crops_the_centre():
    img = torch.zeros(3, 40, 80, dtype=torch.uint8)
    img[:, 10:30, 30:50] = 255  # a white square in the middle
    out = prepare_image(img, {"input_size": (3, 20, 20), "crop_mode": "center", "crop_pct": 1.0})  # 40 -> 20, crop
    assert out.shape == (3, 20, 20)
    assert out[:, 6:14, 6:14].float().mean() == 255 and out[:, :4].float().mean() == 0


def test_predict_uses_crop_pct_mean_std_and_label_names(tmp_path, model_folder):
    folder, model = model_folder
    rng = np.random.default_rng(0)
    centre = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    full = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    full[16:48, 16:48] = centre  # crop_pct 0.5 at 32: the shorter side stays 64, the centre 32x32 is kept
    Image.fromarray(full).save(tmp_path / "x.png")
    result = predict_files(folder, [tmp_path / "x.png"], top_k=3)[0]
    x = torch.from_numpy(centre).permute(2, 0, 1).float()[None] / 255
    x = (x - torch.tensor([0.2, 0.3, 0.4])[:, None, None]) / torch.tensor([0.5, 0.6, 0.7])[:, None, None]
    with torch.no_grad():
        probs = model(x).softmax(-1)[0]
    expected = {["ant", "bee", "cat"][i]: float(p) for i, p in enumerate(probs)}
    got = {p["class"]: p["probability"] for p in result["top"]}
    assert got.keys() == expected.keys()
    assert all(abs(got[k] - expected[k]) < 1e-5 for k in got)


def test_eval_crops_as_the_config_says(tmp_path, model_folder, cache_dir):
    """crop_pct 0.5 at 32: 64x64 test images are cut to their centre, as a data set of those centres would be."""
    from vitlab.infer.eval import evaluate_folder

    folder, model = model_folder
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        for name in ("ant", "bee", "cat"):
            for i in range(3):
                pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
                for root, img in (("full", pixels), ("centre", pixels[16:48, 16:48])):
                    (tmp_path / root / split / name).mkdir(parents=True, exist_ok=True)
                    Image.fromarray(img).save(tmp_path / root / split / name / f"{i}.png")
    cropped = evaluate_folder(folder, str(tmp_path / "full"), cache_dir=str(cache_dir))
    plain = vitlab.load(folder)
    plain.pretrained_cfg.pop("crop_pct")
    vitlab.save(plain, tmp_path / "no-crop")
    centres = evaluate_folder(tmp_path / "no-crop", str(tmp_path / "centre"), cache_dir=str(cache_dir))
    squashed = evaluate_folder(tmp_path / "no-crop", str(tmp_path / "full"), cache_dir=str(cache_dir))
    loss = lambda r: r["heads"]["logits"]["loss"]  # noqa: E731
    assert cropped["heads"]["logits"]["count"] == 9
    assert loss(cropped) == pytest.approx(loss(centres), abs=1e-6)
    assert loss(cropped) != pytest.approx(loss(squashed), abs=1e-4)


# --- one preprocessing per run, following the checkpoint --------------------------------------------------------

PEERS = Path(__file__).parent / "fixtures" / "preprocess"  # benchmarks/make_preprocess_fixtures.py


@pytest.mark.parametrize("fixture, rule", [
    ("hf_vit_exact_bilinear", ("squash", 1.0, "bilinear")),  # transformers' ViTImageProcessor: the exact size
    ("hf_clip_shortest_edge_crop", ("center", 16 / 18, "bicubic")),  # CLIPImageProcessor: shortest edge, crop
    ("timm_center_crop09_bicubic", ("center", 0.9, "bicubic")),
    ("timm_squash_crop09_bilinear", ("squash", 0.9, "bilinear")),
])
def test_predict_on_a_non_square_image_gives_the_peers_probabilities(fixture, rule):
    """A 61x37 image through the checkpoint's own preprocessing: the probabilities timm's eval transform or
    transformers' AutoImageProcessor gave in the reference environment, not those of vitlab's own rule."""
    folder = PEERS / fixture
    io = load_file(folder / "io.safetensors")
    prep = Preprocess.from_cfg(vitlab.load(folder).pretrained_cfg)
    assert (prep.crop_mode, prep.interpolation) == rule[::2] and prep.crop_pct == pytest.approx(rule[1])
    result = predict_files(folder, [folder / "image.png"], top_k=100)[0]
    got = {int(p["class"]): p["probability"] for p in result["top"]}
    expected = io["probabilities"][0]
    assert max(abs(got[i] - float(expected[i])) for i in range(len(expected))) < 1e-4
    square = Preprocess(prep.size, "center", 1.0, mean=prep.mean, std=prep.std)  # another rule is told apart
    x = normalize(read_image(folder / "image.png", prep.size, 3, square.fit)[None], prep.mean, prep.std)
    with torch.no_grad():
        assert (vitlab.load(folder)(x).softmax(-1)[0] - expected).abs().max() > 1e-3


def test_rules_on_files_and_on_tensors_agree_with_torchvision_arithmetic():
    img = torch.zeros(3, 50, 100, dtype=torch.uint8)
    img[:, 10:40, 35:65] = 255
    for mode, pct, shape in (("squash", 1.0, (16, 16)), ("center", 1.0, (16, 32)), ("center", 0.8, (20, 40)),
                             ("squash", 0.8, (20, 20))):
        assert resized_size((50, 100), (16, 16), mode, pct) == shape
        out = Preprocess((16, 16), mode, pct, "bilinear").apply(img[None])[0]
        assert out.shape == (3, 16, 16)
    assert resized_size((50, 100), (16, 24), "center", 1.0) == (16, 32)  # timm's ResizeKeepRatio: covers 16x24
    assert crop_offsets((35, 70), (32, 32)) == (2, 19) and crop_offsets((35, 70), (32, 32), "floor") == (1, 19)
    floor = Preprocess((2, 2), "center", 1.0, "nearest", crop_offset="floor")
    x = torch.arange(5, dtype=torch.uint8).view(1, 1, 1, 5).expand(1, 1, 2, 5)  # 2x5 -> the centre 2x2
    assert floor.apply(x)[0, 0, 0].tolist() == [1, 2]
    assert replace(floor, crop_offset="round").apply(x)[0, 0, 0].tolist() == [2, 3]
    border = Preprocess((16, 16), "border")  # timm's letterbox (DeepSeek's towers): recorded, never applied
    assert border.to_cfg()["crop_mode"] == "border" and "padded with the mean colour" in border.describe()
    with pytest.raises(ValueError, match="crop_mode 'border' .*accepted: center, squash"):
        border.apply(img[None])
    with pytest.raises(ValueError, match="crop_mode 'letterbox' is not one vitlab applies; accepted: center, squash"):
        Preprocess((16, 16), "letterbox")


def _folder(root: Path, size: tuple[int, int], per_class: int = 4, classes: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
                pixels[..., c] = 255 - pixels[..., c] // 4  # a class is told by a channel
                Image.fromarray(pixels).save(root / split / f"c{c}" / f"{i}.png")
    return root


def _onnx_user(folder: Path, image: Path) -> np.ndarray:
    """What a user of the ONNX export does with preprocess.json and Pillow alone (torchvision's arithmetic)."""
    import math

    import onnxruntime

    info = json.loads((folder / "preprocess.json").read_text())
    _, h, w = info["input_size"]
    sh, sw = math.floor(h / info["crop_pct"]), math.floor(w / info["crop_pct"])
    img = Image.open(image).convert("RGB")
    if info["crop_mode"] == "center":  # the shorter side to the scale
        short, long = sorted(img.size)
        sw, sh = (sh, int(sh * long / short)) if img.size[0] <= img.size[1] else (int(sh * long / short), sh)
        sh, sw = sw, sh
    img = img.resize((sw, sh), getattr(Image.Resampling, info["interpolation"].upper()))
    top, left = int(round((sh - h) / 2.0)), int(round((sw - w) / 2.0))
    x = np.asarray(img.crop((left, top, left + w, top + h)), dtype=np.float32) / 255
    x = ((x - np.array(info["mean"])) / np.array(info["std"])).transpose(2, 0, 1)[None].astype(np.float32)
    session = onnxruntime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"images": x})[0]
    return (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))[0]


def test_a_vitlab_run_predicts_as_its_onnx_export_with_the_written_preprocessing(tmp_path, cache_dir):
    """A run trained on a folder squashes its images; predict, and ONNX with preprocess.json, do the same to a
    100x50 photo (the export once said crop_pct 1.0, centre crop: another 3% on this image)."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'vitlab[onnx]')")
    from vitlab.export import export
    from vitlab.train import load_recipe, train

    data = _folder(tmp_path / "data", (24, 40))
    train(load_recipe(None, model="vit_nano_patch4_32", model_args={"depth": 1}, img_size=16, data=str(data),
                      epochs=1, batch_size=6, precision="fp32", out=str(tmp_path / "run"), threads=1,
                      cache_dir=str(cache_dir)), log=lambda s: None)
    cfg = vitlab.load(tmp_path / "run").pretrained_cfg
    assert (cfg["crop_mode"], cfg["crop_pct"], cfg["interpolation"]) == ("squash", 1.0, "bicubic")
    photo = tmp_path / "photo.png"
    pixels = np.random.default_rng(1).integers(0, 256, (50, 100, 3), dtype=np.uint8)
    pixels[:, :30, 0] = 255
    Image.fromarray(pixels).save(photo)
    export(tmp_path / "run", "onnx", tmp_path / "onnx")
    theirs = _onnx_user(tmp_path / "onnx", photo)
    ours = {p["class"]: p["probability"] for p in predict_files(tmp_path / "run", [photo], top_k=3)[0]["top"]}
    assert max(abs(ours[f"c{i}"] - float(theirs[i])) for i in range(3)) < 1e-5
    model = vitlab.load(tmp_path / "run")  # and both are what the run's training and evaluation saw: squashed
    x = normalize(read_image(photo, (16, 16), 3)[None], cfg["mean"], cfg["std"])
    with torch.no_grad():
        assert max(abs(ours[f"c{i}"] - float(p)) for i, p in enumerate(model(x).softmax(-1)[0])) < 1e-5
    info = json.loads((tmp_path / "onnx" / "preprocess.json").read_text())
    assert "whole image resized to 16x16" in info["resize"]


def test_exports_write_the_rule_vitlab_applies(tmp_path):
    from vitlab.export import export

    model = vitlab.create_model("vit_nano_patch4_32", depth=1, num_classes=3)
    model.pretrained_cfg.update(crop_mode="center", crop_pct=0.8, interpolation="bilinear")
    timm_cfg = json.loads((export(model, "timm", tmp_path / "t") / "config.json").read_text())["pretrained_cfg"]
    assert (timm_cfg["crop_mode"], timm_cfg["crop_pct"], timm_cfg["interpolation"]) == ("center", 0.8, "bilinear")
    hf_cfg = json.loads((export(model, "hf", tmp_path / "h") / "preprocessor_config.json").read_text())
    assert hf_cfg["size"] == {"shortest_edge": 40} and hf_cfg["crop_size"] == {"height": 32, "width": 32}
    assert hf_cfg["resample"] == 2 and hf_cfg["do_center_crop"]
    rule = Preprocess.from_cfg(model.pretrained_cfg)
    assert Preprocess.from_cfg(vitlab.load(tmp_path / "t").pretrained_cfg) == rule  # each reads back as written
    # but for the crop's offset: transformers places it at floor((H - h) / 2), as the rule read back says
    assert Preprocess.from_cfg(vitlab.load(tmp_path / "h").pretrained_cfg) == replace(rule, crop_offset="floor")
    model.pretrained_cfg.update(crop_mode="squash", crop_pct=1.0)
    hf_cfg = json.loads((export(model, "hf", tmp_path / "h2") / "preprocessor_config.json").read_text())
    assert hf_cfg["size"] == {"height": 32, "width": 32} and "do_center_crop" not in hf_cfg


# --- --init: the checkpoint's size and rule ---------------------------------------------------------------------

@pytest.fixture
def checkpoint_16(tmp_path):
    model = vitlab.create_model("vit_nano_patch4_32", depth=1, num_classes=3, img_size=16)
    model.pretrained_cfg.update(crop_mode="center", crop_pct=0.9, interpolation="bilinear")
    return vitlab.save(model, tmp_path / "ckpt")


def test_init_trains_at_the_checkpoints_size_and_rule(tmp_path, cache_dir, checkpoint_16):
    from vitlab.data import load_data
    from vitlab.train import load_recipe, train

    data = _folder(tmp_path / "data", (30, 20))  # most common size 30x20: not the checkpoint's 16x16
    lines = []
    train(load_recipe(None, init=str(checkpoint_16), data=str(data), epochs=1, batch_size=6, precision="fp32",
                      out=str(tmp_path / "run"), threads=1, cache_dir=str(cache_dir)), log=lines.append)
    run = vitlab.load(tmp_path / "run")
    assert run.patch_embed.img_size == (16, 16) and not any("resampling" in s for s in lines)
    assert any("training at 16x16 (the input size of" in s and "bilinear" in s for s in lines), lines
    assert (run.pretrained_cfg["crop_mode"], run.pretrained_cfg["crop_pct"]) == ("center", 0.9)
    # the run's images were decoded by that rule: the store it used is the one that rule names
    rule = Preprocess.from_cfg(run.pretrained_cfg)
    quiet = []
    load_data(str(data), img_size=(16, 16), in_chans=3, cache_dir=str(cache_dir), fit=rule.fit, log=quiet.append)
    assert any("from cache" in s for s in quiet), quiet

    lines.clear()
    train(load_recipe(None, init=str(checkpoint_16), data=str(data), img_size=24, epochs=1, batch_size=6,
                      precision="fp32", out=str(tmp_path / "run24"), threads=1, cache_dir=str(cache_dir)),
          log=lines.append)
    assert vitlab.load(tmp_path / "run24").patch_embed.img_size == (24, 24)
    assert any("training at 24x24 (--img-size)" in s for s in lines)
    assert any("resampling the position embedding from (16, 16) to (24, 24)" in s for s in lines)


def test_init_at_a_size_the_patches_do_not_tile_names_img_size(tmp_path, cache_dir, checkpoint_16):
    from vitlab.train import load_recipe, train

    data = _folder(tmp_path / "data", (30, 20), per_class=2)
    with pytest.raises(ValueError, match=r"img_size 18x18 is not divisible by the patch size 4x4 .*--img-size 16"):
        train(load_recipe(None, init=str(checkpoint_16), data=str(data), img_size=18, epochs=1,
                          out=str(tmp_path / "run"), threads=1, cache_dir=str(cache_dir)), log=lambda s: None)


def test_eval_decodes_a_folder_by_the_checkpoints_rule(tmp_path, cache_dir):
    """transformers' exact resize on a folder of 61x37 photos: eval's loss is the one transformers' probabilities
    give (vitlab's centre crop would give another)."""
    from vitlab.infer.eval import evaluate_folder

    folder = PEERS / "hf_vit_exact_bilinear"
    probs = load_file(folder / "io.safetensors")["probabilities"][0]
    for split in ("train", "test"):
        for c in range(5):
            (tmp_path / "data" / split / f"c{c}").mkdir(parents=True)
            (tmp_path / "data" / split / f"c{c}" / "0.png").write_bytes((folder / "image.png").read_bytes())
    result = evaluate_folder(folder, str(tmp_path / "data"), cache_dir=str(cache_dir))
    assert result["heads"]["logits"]["loss"] == pytest.approx(float(-probs.log().mean()), abs=1e-4)


@pytest.mark.parametrize("fixture", ["hf_vit_grey_rgb_mean_classifier", "hf_vit_grey_rgb_mean_model"])
def test_a_one_channel_hf_vit_saved_with_a_three_value_mean_loads_and_matches_transformers(fixture, tmp_path):
    """transformers saves image_mean/std [0.5, 0.5, 0.5] with a one-channel ViT (greyscale fine-tunes on the Hub):
    the value the three agree on is the one statistic such a model can apply, so the folder loads and gives what
    transformers' model gives on its processor's pixels; three values that differ cannot be applied, and are
    refused naming the file."""
    folder = PEERS / fixture
    io = load_file(folder / "io.safetensors")
    model = vitlab.load(folder)
    assert model.pretrained_cfg["input_size"][0] == 1
    assert tuple(model.pretrained_cfg["mean"]) == tuple(model.pretrained_cfg["std"]) == (0.5,)
    prep = Preprocess.from_cfg(model.pretrained_cfg)
    x = read_image(folder / "image.png", prep.size, 1, prep.fit)[None]
    pixels = normalize(x, model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    off = (pixels - io["pixels"]).abs()  # the processor's pixels, made by vitlab's preprocessing (to a grey level)
    assert off.max() <= 2 / 255 + 1e-6 and off.mean() < 1e-3
    with torch.no_grad():
        assert (model.forward_features(io["pixels"]) - io["features"]).abs().max() < 1e-4
    if "probabilities" in io:
        result = predict_files(folder, [folder / "image.png"], top_k=100)[0]
        got = {int(p["class"]): p["probability"] for p in result["top"]}
        assert max(abs(got[i] - float(p)) for i, p in enumerate(io["probabilities"][0])) < 1e-4
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    processor = json.loads((bad / "preprocessor_config.json").read_text())
    processor["image_mean"] = [0.485, 0.456, 0.406]
    (bad / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(VitlabError, match=r"preprocessor_config.json: pretrained_cfg mean is .*accepted: 1 finite "
                                          r"number .*or 3 equal ones"):
        vitlab.load(bad)
