"""vitlab.load refuses what it cannot load completely, and says why."""
import json
import os
import shutil
import stat

import pytest
import torch
from conftest import PARITY
from safetensors.torch import load_file, save_file

import vitlab


@pytest.fixture
def fixture_copy(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(PARITY / "timm_vit_token", dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


@pytest.fixture
def saved(tmp_path):
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=48, depth=2, num_heads=3)
    return vitlab.save(model, tmp_path / "saved")


def test_truncated_weights(fixture_copy):
    w = fixture_copy / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        vitlab.load(fixture_copy)


def test_corrupted_vitlab_weights_fail_checksum(saved):
    w = saved / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 does not match"):
        vitlab.load(saved)


def test_missing_tensor_is_named(fixture_copy):
    w = fixture_copy / "model.safetensors"
    state = load_file(w)
    del state["blocks.1.mlp.fc2.bias"]
    save_file(state, w)
    with pytest.raises(ValueError, match=r"missing tensors: blocks\.1\.mlp\.fc2\.bias"):
        vitlab.load(fixture_copy)


def test_unexpected_tensor_is_named(fixture_copy):
    w = fixture_copy / "model.safetensors"
    state = load_file(w)
    state["blocks.9.extra"] = torch.zeros(3)
    save_file(state, w)
    with pytest.raises(ValueError, match=r"unexpected tensors: blocks\.9\.extra"):
        vitlab.load(fixture_copy)


def test_shape_mismatch_is_named(fixture_copy):
    cfg = json.loads((fixture_copy / "config.json").read_text())
    cfg["model_args"]["embed_dim"] = 96
    (fixture_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"shape mismatches: .*\(file \(1, 1, 48\), model \(1, 1, 96\)\)"):
        vitlab.load(fixture_copy)


def test_unknown_architecture(fixture_copy):
    cfg = json.loads((fixture_copy / "config.json").read_text())
    cfg["architecture"] = "swin_tiny_patch4_window7_224"
    (fixture_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="swin_tiny_patch4_window7_224.*not one vitlab implements.*vit names"):
        vitlab.load(fixture_copy)


def test_bad_json_and_missing_files(fixture_copy, tmp_path):
    (fixture_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        vitlab.load(fixture_copy)
    with pytest.raises(FileNotFoundError, match="no model at"):
        vitlab.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        vitlab.load(tmp_path / "empty")


def test_unknown_override_lists_accepted_args():
    with pytest.raises(ValueError, match="does not take 'depthh'.*accepted: .*depth"):
        vitlab.create_model("vit_tiny_patch4_32", depthh=3)


def test_unknown_model_name_suggests():
    with pytest.raises(ValueError, match="unknown model 'vit_tiny_patch4_31'.*did you mean vit_tiny_patch4_32"):
        vitlab.create_model("vit_tiny_patch4_31")


def test_img_size_not_divisible_by_patch():
    with pytest.raises(ValueError, match="not divisible by the patch size 4"):
        vitlab.create_model("vit_tiny_patch4_32", img_size=30)


def test_new_num_classes_gives_fresh_heads(fixture_copy):
    model = vitlab.load(fixture_copy, num_classes=3)
    assert model.head.out_features == 3
    base = vitlab.load(fixture_copy)
    assert torch.equal(model.blocks[0].attn.qkv.weight, base.blocks[0].attn.qkv.weight)


def test_pickle_weights_are_never_executed(tmp_path):
    """An old-style pytorch_model.bin is read with weights_only=True: a pickled payload is refused."""
    folder = tmp_path / "evil"
    folder.mkdir()
    shutil.copy(PARITY / "timm_vit_token" / "config.json", folder / "config.json")

    class Payload:
        def __reduce__(self):
            return (print, ("executed",))

    torch.save({"x": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot be read as plain tensors"):
        vitlab.load(folder)


IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5,) * 3, (0.5,) * 3)


@pytest.mark.parametrize("fixture, norm, crop_pct, resample", [
    ("timm_vit_token", HALF, 0.9, "bicubic"), ("timm_vit_avg_noclass", HALF, 0.9, "bicubic"),
    ("timm_deit_distilled", IMAGENET, 0.9, "bicubic"), ("timm_cait", IMAGENET, 1.0, "bicubic"),
    ("timm_convit", IMAGENET, 0.875, "bicubic"),
    # no preprocessor_config.json: what the model_type's authors publish (ViT: 0.5, bilinear; DeiT: 37 -> 32 here)
    ("hf_vit", HALF, 1.0, "bilinear"), ("hf_deit_distilled", IMAGENET, pytest.approx(32 / 37), "bicubic"),
])
def test_each_kind_of_folder_loads_with_its_preprocessing(tmp_path, fixture, norm, crop_pct, resample):
    """timm's pretrained_cfg, else the registered name's, else the model_type's published preprocessing; a vitlab
    copy keeps them."""
    model = vitlab.load(PARITY / fixture)
    cfg = model.pretrained_cfg
    assert (tuple(cfg["input_size"]), cfg["interpolation"], cfg.get("crop_pct")) == ((3, 32, 32), resample, crop_pct)
    assert tuple(cfg["mean"]) == pytest.approx(norm[0]) and tuple(cfg["std"]) == pytest.approx(norm[1])
    copy = vitlab.load(vitlab.save(model, tmp_path / "copy")).pretrained_cfg
    assert {k: (tuple(v) if isinstance(v, list) else v) for k, v in copy.items()} == \
        {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()}


def test_patch_embed_resample_keeps_each_patchs_token_when_upsampling():
    """FlexiViT: <resize(x), w'> = <x, w> for every patch x when the patch size grows (the pseudo-inverse)."""
    import torch.nn.functional as F

    from vitlab.models.layers import resample_patch_embed

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, 4, 4, generator=g)
    x = torch.randn(5, 3, 4, 4, generator=g)
    for new in (8, (6, 10)):
        w_new = resample_patch_embed(w, new)
        big = F.interpolate(x, size=w_new.shape[-2:], mode="bicubic", antialias=True)
        assert w_new.shape[-2:] == ((8, 8) if new == 8 else (6, 10))
        assert torch.allclose(torch.einsum("bchw,dchw->bd", big, w_new), torch.einsum("bchw,dchw->bd", x, w),
                              atol=1e-4)
    plain = F.interpolate(w, size=(8, 8), mode="bicubic", antialias=True)  # resizing the kernel itself does not
    big = F.interpolate(x, size=(8, 8), mode="bicubic", antialias=True)
    assert not torch.allclose(torch.einsum("bchw,dchw->bd", big, plain), torch.einsum("bchw,dchw->bd", x, w),
                              atol=1e-1)


def test_load_at_another_patch_size_resamples_patch_and_position_embeddings(saved):
    """vit_tiny_patch4_32 loaded with patch_size=8, img_size=64: the grid stays 8x8; an image whose every patch
    is resized on its own to 8x8 gives the original model's logits on the original image."""
    import torch.nn.functional as F

    model = vitlab.load(saved)
    flexi = vitlab.load(saved, patch_size=8, img_size=64)
    assert flexi.patch_embed.proj.weight.shape[-2:] == (8, 8) and torch.equal(flexi.pos_embed, model.pos_embed)
    x = torch.randn(2, 3, 32, 32)
    patches = x.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(-1, 3, 4, 4)  # (B*8*8, 3, 4, 4)
    big = F.interpolate(patches, size=(8, 8), mode="bicubic", antialias=True)
    big = big.reshape(2, 8, 8, 3, 8, 8).permute(0, 3, 1, 4, 2, 5).reshape(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(flexi(big), model(x), atol=1e-4)
    coarse = vitlab.load(saved, patch_size=8)  # the same image size: a 4x4 grid, the position table resampled
    assert coarse.pos_embed.shape[1] == 1 + 16 and coarse(x).shape == (2, 10)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_and_exported_weights_take_the_umask_like_every_other_file(umask, tmp_path):
    from vitlab.export import export
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=48, depth=2, num_heads=3, num_classes=3)
    before = os.umask(umask)
    try:
        folders = [vitlab.save(model, tmp_path / "saved"), export(model, "timm", tmp_path / "timm"),
                   export(model, "hf", tmp_path / "hf")]
    finally:
        os.umask(before)
    for folder in folders:
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in folder.iterdir()}
        assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_load_draws_no_initial_weights_but_a_new_head_is_drawn(saved):
    """The weights are read, not drawn: loading leaves torch's random state as it was and gives the saved model's
    tensors; a new head (num_classes=) is still drawn, and torch.nn.init works again afterwards."""
    source = vitlab.create_model("vit_tiny_patch4_32", embed_dim=48, depth=2, num_heads=3)
    source.load_state_dict(vitlab.load(saved).state_dict())
    state = torch.get_rng_state()
    model = vitlab.load(saved)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
    fresh = vitlab.load(saved, num_classes=3)
    assert not torch.equal(torch.get_rng_state(), state)
    assert fresh.head.weight.shape == (3, 48) and fresh.head.weight.std() > 0
    w = torch.nn.init.trunc_normal_(torch.zeros(100), std=0.02)
    assert 0 < w.std() < 0.1
