"""predict and eval prepare images as the model's pretrained config says: crop_pct, interpolation, mean, std, labels."""

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.infer.eval import center_crop, scale_size
from vitlab.infer.predict import predict_files, prepare_image


@pytest.fixture
def model_folder(tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_32", depth=1, num_classes=3)
    model.pretrained_cfg.update(mean=(0.2, 0.3, 0.4), std=(0.5, 0.6, 0.7), crop_pct=0.5, interpolation="bilinear",
                                label_names=["ant", "bee", "cat"])
    return vitlab.save(model, tmp_path / "m"), model.eval()


def test_scale_size_and_center_crop():
    assert scale_size((224, 224), 0.875) == (256, 256) and scale_size((32, 48), None) == (32, 48)
    x = torch.arange(36).reshape(1, 6, 6)
    assert center_crop(x, (2, 2)).tolist() == [[[14, 15], [20, 21]]]


def test_predict_transform_keeps_aspect_and_crops_the_centre():
    img = torch.zeros(3, 40, 80, dtype=torch.uint8)
    img[:, 10:30, 30:50] = 255  # a white square in the middle
    out = prepare_image(img, {"input_size": (3, 20, 20), "crop_pct": 1.0})  # shorter side 40 -> 20, width 40, crop
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
