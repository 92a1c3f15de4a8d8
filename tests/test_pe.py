"""Perception Encoder: timm's Eva as PE builds it (a position table and axial RoPE, Core's attention pool and
projection), read off timm's folders (tests/fixtures/parity/timm_pe_*, benchmarks/make_parity_fixtures.py)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.export import export
from vitlab.models.pe import PE_NAMES, PerceptionEncoder

PARITY = Path(__file__).parent / "fixtures" / "parity"


def test_timm_names_build_timms_layout():
    with torch.device("meta"):
        core = vitlab.create_model("vit_pe_core_base_patch16_224")
        giant = vitlab.create_model("vit_pe_core_gigantic_patch14_448")
        lang = vitlab.create_model("vit_pe_lang_large_patch14_448")
        spatial = vitlab.create_model("vit_pe_spatial_tiny_patch16_512")
    assert len(PE_NAMES) == 12 and all(isinstance(m, PerceptionEncoder) for m in (core, giant, lang, spatial))
    assert core.pos_embed.shape == (1, 197, 768) and core.patch_embed.proj.bias is None and core.norm.eps == 1e-5
    assert core.attn_pool.num_heads == 8 and core.attn_pool.norm.eps == 1e-5 and core.head.out_features == 1024
    assert (core.rope.offset, core.rope.indexing, core.rope.ref_grid) == (1.0, "xy", (14, 14))
    assert core.blocks[0].attn.qkv.bias is not None and core.blocks[0].attn.q_bias is None  # one plain qkv bias
    assert giant.cls_token is None and giant.rope.offset == 0.0 and giant.blocks[0].mlp.fc1.out_features == 8960
    assert len(lang.blocks) == 23 and lang.blocks[0].ls1.gamma.shape == (1024,) and lang.attn_pool is None
    assert isinstance(lang.norm, torch.nn.Identity) and isinstance(lang.fc_norm, torch.nn.Identity)
    assert spatial.global_pool == "avg" and spatial.rope.ref_grid == (32, 32)
    assert vitlab.load(PARITY / "timm_pe_spatial").num_classes == 0  # timm's weights have no head
    assert "attention-pool head" in core.family and "mean patch token" in lang.family


def test_options_are_read_off_the_folders():
    core = vitlab.load(PARITY / "timm_pe_core")
    assert core.arch == "vit_pe_core_tiny_patch16_384" and core.num_classes == 6 and core.attn_pool.num_heads == 8
    assert core.rope.ref_grid == (24, 24)  # the name's grid, kept at another image size as timm keeps it
    lang = vitlab.load(PARITY / "timm_pe_lang")
    state = load_file(PARITY / "timm_pe_lang" / "model.safetensors")
    assert torch.equal(lang.blocks[1].ls2.gamma, state["blocks.1.gamma_2"]) and lang.patch_embed.img_size == (16, 20)


def test_the_attention_pool_reads_the_class_token_too():
    model = vitlab.load(PARITY / "timm_pe_core")
    x = load_file(PARITY / "timm_pe_core" / "io.safetensors")["input"]
    with torch.no_grad():
        tokens = model.forward_features(x)
        pooled = model.forward_head(tokens, pre_logits=True)
        assert torch.equal(pooled, model.attn_pool(tokens))
        assert not torch.allclose(pooled, model.attn_pool(tokens[:, 1:]), atol=1e-4)


def test_another_pooling_drops_the_attention_pool_and_map_needs_it():
    model = vitlab.create_model("vit_pe_core_tiny_patch16_384", img_size=32, patch_size=4, embed_dim=32, depth=1,
                                num_heads=2)
    model.reset_classifier(3, global_pool="avg")
    assert model.attn_pool is None and "attn_pool.latent" not in model.state_dict()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    with pytest.raises(ValueError) as e:
        model.reset_classifier(3, global_pool="map")
    assert "attention-pool head" in str(e.value) and "'avg'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        vitlab.create_model("vit_pe_spatial_tiny_patch16_512", global_pool="max")
    assert "accepted: map, avg" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["timm_pe_core", "timm_pe_lang"])
def test_timm_export_loads_back_with_the_same_outputs(tmp_path, name):
    model = vitlab.load(PARITY / name, dynamic_img_size=True)
    folder = export(model, "timm", tmp_path / "t")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architecture"] == json.loads((PARITY / name / "config.json").read_text())["architecture"]
    io = load_file(PARITY / name / "io_dynamic.safetensors")
    with torch.no_grad():
        assert torch.equal(vitlab.load(folder, dynamic_img_size=True)(io["input"]), model(io["input"]))


def test_head_importance_leaves_blank_the_heads_a_block_lacks():
    from vitlab.analysis.sanity import head_importance

    model = vitlab.create_model("vit_pe_core_tiny_patch16_384", img_size=16, patch_size=4, embed_dim=16, depth=1,
                                num_heads=2, num_classes=3)
    scores, names = head_importance(model, torch.randn(2, 3, 16, 16))
    assert names == ["blocks.0", "attn_pool"] and scores.shape == (2, 8)  # the pool's 8 heads over the block's 2
    assert scores[0, 2:].isnan().all() and not scores[0, :2].isnan().any() and not scores[1].isnan().any()


def test_a_layernorm_eps_timms_pe_names_cannot_take_is_refused_in_one_line(tmp_path):
    model = vitlab.create_model("vit_pe_core_tiny_patch16_384", img_size=16, patch_size=4, embed_dim=16, depth=1,
                                num_heads=2, norm_eps=1e-6)
    with pytest.raises(ValueError) as e:
        export(model, "timm", tmp_path / "t")
    assert "norm_eps=1e-06" in str(e.value) and "1e-05" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_inspect_draws_the_position_table_and_the_rotation(tmp_path):
    from PIL import Image

    from vitlab.cli import main

    Image.new("RGB", (20, 24), (120, 30, 200)).save(tmp_path / "a.png")
    out = tmp_path / "report"
    assert main(["inspect", str(PARITY / "timm_pe_core"), "--images", str(tmp_path / "a.png"), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert (out / "position_similarity.png").is_file() and (out / "rotary_similarity.png").is_file()
    assert "This model has no position table" not in html and "Perception Encoder" in html
    assert "rollout.png" in html and (out / "faithfulness.json").is_file()
