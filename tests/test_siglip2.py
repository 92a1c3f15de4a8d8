"""SigLIP 2's image tower and timm's NaFlex ViTs: patch-flattened NaFlex batches of mixed aspect ratios, the position
table resized per image, padding masked, read off transformers' folders (tests/fixtures/parity/hf_siglip2*, written
by benchmarks/make_parity_fixtures.py)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import vitlab
from vitlab.models.naflex import NaFlexVit, naflex_batch, naflex_size

PARITY = Path(__file__).parent / "fixtures" / "parity"
SIGLIP2 = ["hf_siglip2_vision", "hf_siglip2"]
TIMM_NAFLEX = ["timm_naflexvit_siglip", "timm_naflexvit_gap", "timm_naflexvit_par_gap", "timm_naflexvit_parfac_gap",
               "timm_naflexvit_so150m2_map", "timm_naflexvit_radio_v3", "timm_naflexvit_radio_v4"]
HF_KEYS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
TOL = 1e-4


def naflex_io(name):
    io = load_file(PARITY / name / "naflex.safetensors")
    return io, {k: io[k] for k in HF_KEYS}


@pytest.mark.parametrize("name", SIGLIP2)
def test_a_naflex_batch_of_four_aspect_ratios_matches_transformers(name):
    """The processor's batch: grids 3x6, 7x2, 4x4 and 2x7 padded to 20 patches; every token (the padding's too, which
    transformers masks as keys only and gives the first position entry) and the attention-pooled output."""
    model = vitlab.load(PARITY / name)
    io, batch = naflex_io(name)
    assert len({tuple(s) for s in io["spatial_shapes"].tolist()}) == 4 and not io["pixel_attention_mask"].all()
    with torch.no_grad():
        out = model.forward_features(batch)
        pooled = model.forward_head(out)
    assert out["patches"].shape == io["features"].shape and torch.equal(out["patch_valid"],
                                                                        io["pixel_attention_mask"].bool())
    assert (out["patches"] - io["features"]).abs().max() <= TOL
    assert (pooled - io["logits"]).abs().max() <= TOL
    with torch.no_grad():
        assert torch.equal(model(batch), pooled)


@pytest.mark.parametrize("name", TIMM_NAFLEX)
def test_timms_naflex_batch_matches_timm(name):
    """timm's Patchify and NaFlexCollator: four aspect ratios, zero-padded edges, padded to the longest plus three;
    timm masks every pair with a padded end and gives the padding no position entry, as vitlab does by default.
    The tables: learned, bilinear (SigLIP) or bicubic, aspect-preserving (par), factorized (parfac)."""
    model = vitlab.load(PARITY / name)
    io = load_file(PARITY / name / "naflex.safetensors")
    batch = {k: io[k] for k in ("patches", "patch_coord", "patch_valid")}
    assert not io["patch_valid"].all() and not model.use_key_only_attn_mask and not model.pos_embed_pad_first
    with torch.no_grad():
        out = model.forward_features(batch)
        assert (out["patches"] - io["features"]).abs().max() <= TOL
        assert (model.forward_head(out) - io["logits"]).abs().max() <= TOL


def test_a_siglip2_tower_exported_to_timm_keeps_its_outputs(tmp_path):
    """timm's NaFlexVit holds SigLIP 2 but for the padding's own position entry and mask, which no real token and
    no pooled output reads."""
    from vitlab.export import export

    model = vitlab.load(PARITY / "hf_siglip2_vision")
    folder = export(model, "timm", tmp_path / "t")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architecture"] == "naflexvit_base_patch16_siglip" and "pos_embed_pad_first" not in cfg["model_args"]
    assert cfg["pretrained_cfg"]["fixed_input_size"] is False  # any size, as timm's own NaFlex configs say
    back = vitlab.load(folder)
    io, batch = naflex_io("hf_siglip2_vision")
    x = load_file(PARITY / "hf_siglip2_vision" / "io_dynamic.safetensors")["input"]
    real = batch["pixel_attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), rtol=0, atol=1e-6)
        out = back.forward_features(batch)
        torch.testing.assert_close(out["patches"][real], io["features"][real], rtol=0, atol=TOL)
        torch.testing.assert_close(back.forward_head(out), io["logits"], rtol=0, atol=TOL)


def test_the_siglip2_folders_are_read_as_naflex_towers():
    vision = vitlab.load(PARITY / "hf_siglip2_vision")
    assert isinstance(vision, NaFlexVit) and vision.global_pool == "map" and vision.num_classes == 0
    assert vision.embeds.pos_embed.shape == (1, 4, 4, 16) and vision.embeds.proj.in_features == 48
    assert vision.use_key_only_attn_mask and vision.pos_embed_pad_first  # transformers' padding, as it has it
    assert vision.pos_embed_interp_mode == "bilinear" and vision.patch_embed.img_size == (16, 16)
    assert vision.pretrained_cfg["crop_mode"] == "squash" and vision.pretrained_cfg["mean"] == (0.5, 0.5, 0.5)
    full = vitlab.load(PARITY / "hf_siglip2")  # Siglip2Model: the vision half, the text tower left out
    assert full.embeds.pos_embed.shape == (1, 5, 5, 16) and isinstance(full.blocks[0].mlp.act, torch.nn.GELU)
    state = load_file(PARITY / "hf_siglip2" / "model.safetensors")
    assert torch.equal(full.attn_pool.latent, state["vision_model.head.probe"])


def test_padding_never_reaches_a_real_token_or_the_pooled_output():
    model = vitlab.load(PARITY / "hf_siglip2_vision")
    io, batch = naflex_io("hf_siglip2_vision")
    noisy = dict(batch, pixel_values=torch.where(batch["pixel_attention_mask"].bool()[..., None],
                                                 batch["pixel_values"], torch.randn_like(batch["pixel_values"]) * 9))
    with torch.no_grad():
        a, b = model.forward_features(batch), model.forward_features(noisy)
    real = batch["pixel_attention_mask"].bool()
    torch.testing.assert_close(a["patches"][real], b["patches"][real], rtol=0, atol=1e-5)
    torch.testing.assert_close(model.forward_head(a), model.forward_head(b), rtol=0, atol=1e-5)
    assert not torch.allclose(a["patches"][~real], b["patches"][~real])


def test_one_image_as_a_naflex_batch_is_the_image():
    """An image at a whole number of patches: its NaFlex batch (padded) gives the image path's tokens and output, in
    transformers' keys and in timm's (patch_coord, patch_valid)."""
    model = vitlab.load(PARITY / "hf_siglip2_vision")
    x = torch.randn(1, 3, 12, 28)
    batch = naflex_batch([x[0]], patch_size=4, max_patches=30)
    assert batch["spatial_shapes"].tolist() == [[3, 7]] and batch["pixel_attention_mask"].sum() == 21
    coords = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(7), indexing="ij"), -1).reshape(21, 2)
    timm_batch = {"patches": batch["pixel_values"], "patch_valid": batch["pixel_attention_mask"].bool(),
                  "patch_coord": torch.cat([coords, coords.new_zeros(9, 2)])[None]}
    with torch.no_grad():
        tokens = model.forward_features(x)
        for b in (batch, timm_batch):
            out = model.forward_features(b)
            torch.testing.assert_close(out["patches"][:, :21], tokens, rtol=0, atol=1e-5)
            torch.testing.assert_close(model.forward_head(out), model.forward_head(tokens), rtol=0, atol=1e-5)


def test_naflex_batch_builds_what_the_processor_built():
    """Sizes and masks exactly; pixels within one uint8 step (the processor resizes the uint8 image)."""
    io, _ = naflex_io("hf_siglip2_vision")
    images = [io[f"image_{i}"].float() / 255 * 2 - 1 for i in range(4)]
    batch = naflex_batch(images, patch_size=4, max_patches=20)
    assert torch.equal(batch["spatial_shapes"], io["spatial_shapes"])
    assert torch.equal(batch["pixel_attention_mask"], io["pixel_attention_mask"])
    assert (batch["pixel_values"] - io["pixel_values"]).abs().max() <= 2 / 255 + 1e-6
    assert naflex_size(30, 70, 4, 20) == (12, 24) and naflex_size(1, 1000, 16, 256) == (16, 4096)


def test_the_table_is_resized_as_transformers_does():
    """Antialiased bilinear to each image's grid (F.interpolate, align_corners=False): a reduction and an
    enlargement, row-major."""
    model = vitlab.create_model("naflexvit_base_patch16_siglip", embed_dim=8, depth=1, num_heads=2,
                                pos_embed_grid_size=(4, 4))
    table = model.embeds.pos_embed.detach()
    for size in ((2, 7), (5, 3)):
        expected = F.interpolate(table.permute(0, 3, 1, 2), size=size, mode="bilinear", align_corners=False,
                                 antialias=True).permute(0, 2, 3, 1).reshape(-1, 8)
        torch.testing.assert_close(model.grid_pos_embed(size), expected)
    ar = vitlab.create_model("naflexvit_base_patch16_par_gap", embed_dim=8, depth=1, num_heads=2,
                             pos_embed_grid_size=(4, 4))
    square = F.interpolate(ar.embeds.pos_embed.detach().permute(0, 3, 1, 2), size=(6, 6), mode="bicubic",
                           align_corners=False, antialias=True)
    torch.testing.assert_close(ar.grid_pos_embed((2, 6)), square[:, :, :2].permute(0, 2, 3, 1).reshape(-1, 8))


@pytest.mark.parametrize("batch, named", [
    ({"pixel_values": torch.zeros(1, 4, 48)}, "pixel_attention_mask"),
    ({"pixel_values": torch.zeros(1, 4, 48), "pixel_attention_mask": torch.ones(1, 3),
      "spatial_shapes": torch.tensor([[1, 3]])}, "(B, N)"),
    ({"images": torch.zeros(1, 4, 48)}, "accepted"),
    ({"pixel_values": torch.zeros(1, 4, 27), "pixel_attention_mask": torch.ones(1, 4),
      "spatial_shapes": torch.tensor([[2, 2]])}, "48"),
])
def test_a_malformed_naflex_batch_is_one_line(batch, named):
    model = vitlab.load(PARITY / "hf_siglip2_vision")
    with pytest.raises(ValueError) as e:
        model.forward_features(batch)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_siglip2_config_vitlab_cannot_read_is_one_line(tmp_path):
    folder = tmp_path / "s"
    shutil.copytree(PARITY / "hf_siglip2_vision", folder)
    cfg = json.loads((folder / "config.json").read_text())
    for change, named in ((dict(num_patches=20), "num_patches"), (dict(hidden_act="tanh"), "hidden_act")):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError) as e:
            vitlab.load(folder)
        assert named in str(e.value) and "accepted" in str(e.value) and "\n" not in str(e.value)
    full = json.loads((PARITY / "hf_siglip2" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != "vision_config"}))
    with pytest.raises(ValueError, match="vision_config"):
        vitlab.load(folder)


def test_hf_export_writes_what_transformers_wrote(tmp_path):
    """Siglip2VisionModel's keys, config and processor back from a loaded folder, the same tensors; a timm NaFlex
    ViT with a head, or registers, is refused in one line naming what transformers' class lacks."""
    from vitlab.export import export

    model = vitlab.load(PARITY / "hf_siglip2_vision")
    folder = export(model, "hf", tmp_path / "h")
    ours = load_file(folder / "model.safetensors")
    theirs = load_file(PARITY / "hf_siglip2_vision" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    cfg, ref = (json.loads((f / "config.json").read_text()) for f in (folder, PARITY / "hf_siglip2_vision"))
    assert {k: cfg[k] for k in ref if k in cfg and k != "transformers_version"} == \
        {k: ref[k] for k in cfg if k in ref and k != "transformers_version"}
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "Siglip2ImageProcessor" and processor["max_num_patches"] == 16
    _, batch = naflex_io("hf_siglip2_vision")
    with torch.no_grad():
        assert torch.equal(vitlab.load(folder)(batch), model(batch))
    for name, named in (("naflexvit_base_patch16_siglip", "classifier head"), ("naflexvit_base_patch16_map",
                                                                               "prefix tokens")):
        other = vitlab.create_model(name, embed_dim=16, depth=1, num_heads=2)
        with pytest.raises(ValueError) as e:
            export(other, "hf", tmp_path / name)
        assert named in str(e.value) and "--to timm" in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / name).exists()
