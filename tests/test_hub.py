"""hf-hub: ids resolve from a Hub cache laid out on disk (HF_HUB_OFFLINE=1), in load, predict, eval, inspect, train."""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PARITY
from PIL import Image
from safetensors.torch import load_file

import vitlab
from vitlab.cli import main

pytest.importorskip("huggingface_hub")

BACKBONES = Path(__file__).parent / "fixtures" / "parity"
TIMM_ID, HF_ID = "hf-hub:timm/vit_test.fixture", "hf-hub:google/vit-test"


def add_repo(cache, repo_id, folder, ref="main", files=("config.json", "model.safetensors")):
    """Lay out one revision of a model repository as huggingface_hub's cache stores it; returns its commit hash.

    models--ORG--NAME/blobs/<sha256>, refs/<ref> (the commit hash), snapshots/<commit>/<file> -> ../../blobs/<sha256>
    """
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{ref}:{folder}".encode()).hexdigest()
    for name in files:
        data = (folder / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hub cache in tmp_path holding a timm repository and a transformers repository."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read once at import: follow the variables
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    add_repo(cache, TIMM_ID[7:], PARITY / "timm_vit_token")
    add_repo(cache, HF_ID[7:], PARITY / "hf_vit")
    return cache


def fixture_logits(name):
    io = load_file(PARITY / name / "io.safetensors")
    return io["input"], io["logits"]


@pytest.mark.parametrize("hub_id, fixture", [(TIMM_ID, "timm_vit_token"), (HF_ID, "hf_vit")])
def test_hub_id_gives_the_fixture_logits(hub_cache, hub_id, fixture):
    model = vitlab.load(hub_id)
    x, logits = fixture_logits(fixture)
    with torch.no_grad():
        assert torch.allclose(model(x), logits, atol=1e-4)


def test_revision_by_tag_and_by_commit(hub_cache):
    commit = add_repo(hub_cache, TIMM_ID[7:], PARITY / "timm_vit_avg_noclass", ref="v2")
    x, logits = fixture_logits("timm_vit_avg_noclass")
    for hub_id in (f"{TIMM_ID}@v2", f"{TIMM_ID}@{commit}"):
        with torch.no_grad():
            assert torch.allclose(vitlab.load(hub_id)(x), logits, atol=1e-4), hub_id
    assert vitlab.load(TIMM_ID).global_pool == "token"  # main is untouched


def test_missing_repository_file_and_revision_are_named(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"acme/nothing: config\.json is not in the Hub cache .*HF_HUB_OFFLINE"):
        vitlab.load("hf-hub:acme/nothing")
    add_repo(hub_cache, "acme/no-weights", PARITY / "timm_vit_token", files=("config.json",))
    with pytest.raises(FileNotFoundError) as err:
        vitlab.load("hf-hub:acme/no-weights")
    message = str(err.value)
    assert "\n" not in message
    assert "acme/no-weights has no weights" in message and "found: config.json" in message
    assert "model.safetensors" in message
    with pytest.raises(FileNotFoundError, match="@v9"):
        vitlab.load(f"{TIMM_ID}@v9")


def test_missing_huggingface_hub_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_hub(name, *args, **kwargs):
        if name.startswith("huggingface_hub"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hub)
    with pytest.raises(ValueError, match=r"pip install 'vitlab\[hub\]'"):
        vitlab.load(TIMM_ID)


@pytest.mark.parametrize("bad", ["hf-hub:", "hf-hub:a/b/c", "hf-hub:org/name@"])
def test_malformed_hub_id(bad):
    with pytest.raises(ValueError, match="not a Hub id"):
        vitlab.load(bad)


def test_transformers_preprocessor_config_is_honoured(hub_cache, tmp_path):
    folder = tmp_path / "with-processor"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((PARITY / "hf_vit" / name).read_bytes())
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "resample": 2,
        "size": 40, "crop_size": 32, "do_center_crop": True}))
    add_repo(hub_cache, "google/vit-pre", folder,
             files=("config.json", "model.safetensors", "preprocessor_config.json"))
    cfg = vitlab.load("hf-hub:google/vit-pre").pretrained_cfg
    assert cfg["mean"] == (0.485, 0.456, 0.406) and cfg["interpolation"] == "bilinear"
    assert cfg["crop_pct"] == pytest.approx(0.8)


def images(folder, n, size=(32, 32), seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_predict_eval_inspect_by_hub_id(hub_cache, tmp_path, capsys, cache_dir):
    files = images(tmp_path / "img", 2)
    assert main(["predict", TIMM_ID, *map(str, files), "--top-k", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result) == 2 and len(result[0]["top"]) == 2
    data = tmp_path / "data"
    for split in ("train", "test"):
        for c in range(5):
            images(data / split / f"c{c}", 2, seed=c)
    assert main(["eval", HF_ID, "--data", str(data), "--cache-dir", str(cache_dir)]) == 0
    assert "top-1" in capsys.readouterr().out
    out = tmp_path / "inspect"
    assert main(["inspect", TIMM_ID, "--images", str(files[0]), "--out", str(out), "--num-images", "1"]) == 0
    assert (out / "report.html").is_file()


def test_fine_tune_from_hub_id(hub_cache, tmp_path, cache_dir):
    from vitlab.train import load_recipe, train

    data = tmp_path / "data"
    for split in ("train", "test"):
        for c in range(3):
            images(data / split / f"c{c}", 6, seed=c)
    out = tmp_path / "run"
    recipe = load_recipe(None, init=HF_ID, data=str(data), epochs=1, batch_size=8, precision="fp32",
                         out=str(out), threads=1, cache_dir=str(cache_dir))
    summary = train(recipe)
    assert summary["epochs"] == 1
    tuned = vitlab.load(out)
    assert tuned.num_classes == 3 and tuned.pretrained_cfg["label_names"] == ["c0", "c1", "c2"]
    # the backbone started from the Hub weights: its patch embedding moved only by one epoch of training
    start = vitlab.load(HF_ID).patch_embed.proj.weight
    assert (tuned.patch_embed.proj.weight - start).abs().max() < 0.05


@pytest.mark.parametrize("hub_id, fixture", [("hf-hub:timm/vit_small_patch14_dinov2.lvd142m", "timm_dinov2"),
                                             ("hf-hub:timm/vit_base_patch16_clip_224.openai", "timm_clip"),
                                             ("hf-hub:timm/vit_base_patch16_siglip_224.webli", "timm_siglip"),
                                             ("hf-hub:facebook/dinov2-with-registers-small", "hf_dinov2_registers"),
                                             ("hf-hub:openai/clip-vit-base-patch32", "hf_clip_vision_projection"),
                                             ("hf-hub:google/siglip-base-patch16-224", "hf_siglip_vision")])
def test_backbone_hub_ids_load_from_the_cache(hub_cache, hub_id, fixture):
    folder = BACKBONES / fixture
    add_repo(hub_cache, hub_id[7:], folder)
    io = load_file(folder / "io.safetensors")
    with torch.no_grad():
        assert torch.allclose(vitlab.load(hub_id)(io["input"]), io["logits"], atol=1e-4)
