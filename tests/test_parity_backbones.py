"""Today's backbones (DeiT III, DINOv2, register and GAP ViTs, CLIP and SigLIP image towers) load exactly.

The folders under tests/fixtures/parity/ were written by timm's ``save_for_hf`` and transformers'
``save_pretrained`` (benchmarks/make_parity_fixtures.py, in the reference environment), with the peer's own
outputs; ``io_dynamic.safetensors`` holds the peer's outputs at a second input size.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.interop import timm as timm_interop
from vitlab.models.layers import QuickGELU

BACKBONES = Path(__file__).parent / "fixtures" / "parity"
EXPECTED = {"timm_deit3", "timm_dinov2", "timm_dinov2_reg4", "timm_vit_reg4_gap", "timm_vit_gap", "timm_vit_qk_norm",
            "timm_vit_no_final_norm", "timm_vit_fc_norm_token", "timm_clip", "timm_clip_quickgelu", "timm_siglip",
            "timm_siglip_no_head", "hf_dinov2", "hf_dinov2_registers", "hf_clip_vision", "hf_clip_vision_projection",
            "hf_siglip_vision", "hf_dinov2_classifier", "hf_dinov2_registers_classifier",
            "timm_beit", "timm_beitv2_token", "timm_beit_shared_abs", "hf_beit_classifier", "hf_beit_shared",
            "hf_data2vec_vision", "timm_vit_r_s16_p8", "timm_mixer", "timm_eva02", "timm_eva02_subln",
            "timm_vit_rope_axial", "timm_vit_rope_mixed_ape", "timm_vit_rope_reg_gap", "hf_vit_msn", "hf_vit_mae",
            "timm_vit_parallel", "timm_vit_pwee", "timm_vit_pwee_qk_norm", "timm_dinov3", "timm_dinov3_plus_qkvb",
            "timm_dinov3_token", "hf_dinov3", "hf_dinov3_gated", "timm_eva02_clip", "timm_eva_giant_clip",
            "hf_siglip2_vision", "hf_siglip2", "timm_naflexvit_siglip", "timm_naflexvit_gap", "timm_naflexvit_par_gap",
            "timm_naflexvit_parfac_gap", "timm_naflexvit_so150m2_map", "timm_naflexvit_radio_v3",
            "timm_naflexvit_radio_v4",
            "timm_pe_core", "timm_pe_core_gigantic", "timm_pe_spatial", "timm_pe_lang",
            "timm_vit_xp", "timm_dinov2_giant", "timm_tipsv2_giant",
            "timm_eva02_enormous", "timm_lingbot",
            "timm_lingbot_giant", "timm_sapiens2", "hf_dinov2_giant",
            "hf_timm_wrapper_pe_core", "hf_timm_wrapper_classifier", "timm_aimv2", "hf_aimv2", "hf_aimv2_native",
            "timm_qwen3", "timm_qwen3_merge", "timm_qwen3_enc", "timm_gemma4", "timm_gemma4_enc",
            "timm_deepseek", "timm_deepseek_align", "timm_deepseek_enc"}
DYNAMIC = sorted(p.parent.name for p in BACKBONES.glob("*/io_dynamic.safetensors"))
TOL = 1e-4


def test_every_backbone_fixture_is_there():
    assert {p.name for p in BACKBONES.iterdir() if (p / "io.safetensors").is_file()} == EXPECTED
    assert len(DYNAMIC) >= 15


def check(model, io):
    with torch.no_grad():
        features = model.forward_features(io["input"])
        logits = model.forward_head(features)
    assert logits.shape == io["logits"].shape and features.shape == io["features"].shape
    assert (logits - io["logits"]).abs().max() <= TOL
    assert (features - io["features"]).abs().max() <= TOL


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_backbone_matches_its_peer(name):
    check(vitlab.load(BACKBONES / name), load_file(BACKBONES / name / "io.safetensors"))


@pytest.mark.parametrize("name", DYNAMIC)
def test_backbone_matches_its_peer_at_another_size(name):
    io = load_file(BACKBONES / name / "io_dynamic.safetensors")
    model = vitlab.load(BACKBONES / name, dynamic_img_size=True)
    assert tuple(io["input"].shape[-2:]) != tuple(model.patch_embed.img_size)
    check(model, io)


def test_options_are_read_off_the_folders():
    clip = vitlab.load(BACKBONES / "timm_clip")
    assert clip.arch == "vit_base_patch16_clip_224" and clip.norm_pre.eps == 1e-5 and clip.patch_embed.proj.bias is None
    assert isinstance(vitlab.load(BACKBONES / "timm_clip_quickgelu").blocks[0].mlp.act, QuickGELU)
    siglip = vitlab.load(BACKBONES / "timm_siglip")
    assert siglip.global_pool == "map" and siglip.attn_pool is not None and siglip.family == "ViT (attention-pool head)"
    qk = vitlab.load(BACKBONES / "timm_vit_qk_norm")
    assert qk.blocks[0].attn.q_norm.normalized_shape == (8,) and isinstance(qk.blocks[0].mlp.act, torch.nn.SiLU)
    no_final = vitlab.load(BACKBONES / "timm_vit_no_final_norm")
    assert isinstance(no_final.norm, torch.nn.Identity) and no_final.blocks[0].attn.proj.bias is None
    dinov2 = vitlab.load(BACKBONES / "hf_dinov2_registers")
    assert dinov2.reg_token.shape[1] == 4 and dinov2.no_embed_class and dinov2.num_classes == 0


def test_clip_projection_is_the_head_with_zero_bias():
    model = vitlab.load(BACKBONES / "hf_clip_vision_projection")
    state = load_file(BACKBONES / "hf_clip_vision_projection" / "model.safetensors")
    assert torch.equal(model.head.weight, state["visual_projection.weight"])
    assert model.num_classes == 24 and not model.head.bias.any()


def test_dinov2_classifier_reads_class_and_mean_patch_token(tmp_path):
    model = vitlab.load(BACKBONES / "hf_dinov2_registers_classifier")
    assert model.global_pool == "token_avg" and model.num_features == 32 and model.head.in_features == 32
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        tokens = model.forward_features(x)
        pooled = model.forward_head(tokens, pre_logits=True)
    assert torch.equal(pooled, torch.cat([tokens[:, 0], tokens[:, 5:].mean(1)], dim=-1))  # registers left out
    from vitlab.export import export

    for to in ("timm", "hf"):
        with pytest.raises(ValueError, match="global_pool='token_avg'|pooling other than the class token"):
            export(model, to, tmp_path / to)


def test_dinov2_swiglu_reads_as_the_packed_swiglu(tmp_path):
    model = vitlab.load(BACKBONES / "hf_dinov2_giant")
    mlp = model.blocks[0].mlp  # transformers: two thirds of int(16 * 2) rounded up to a multiple of 8, gate first
    assert model.mlp_layer == "swiglu_packed" and mlp.fc1.out_features == 48 and mlp.fc2.in_features == 24
    assert isinstance(mlp.act, torch.nn.SiLU)  # whatever hidden_act says
    from vitlab.export import export

    with pytest.raises(ValueError, match="SwiGLU"):  # vitlab writes transformers' ViT/DeiT, which have none
        export(model, "hf", tmp_path / "hf")


def test_timm_wrapper_folders_read_as_the_timm_model_they_wrap(tmp_path):
    pe = vitlab.load(BACKBONES / "hf_timm_wrapper_pe_core")  # its config says num_classes 2, LABEL_0 and LABEL_1
    assert pe.arch == "vit_pe_core_tiny_patch16_384" and pe.num_classes == 0
    assert pe.pretrained_cfg.get("label_names") is None
    classifier = vitlab.load(BACKBONES / "hf_timm_wrapper_classifier")
    assert classifier.num_classes == 3 and classifier.pretrained_cfg["label_names"] == ["cat", "dog", "fox"]
    folder = tmp_path / "wrapped"
    shutil.copytree(BACKBONES / "hf_timm_wrapper_pe_core", folder)
    cfg = json.loads((folder / "config.json").read_text())
    for change, message in ((dict(architecture="resnet50"), "timm architecture 'resnet50'"),
                            (dict(architectures=["TimmWrapperForSomething"]), "'TimmWrapperForSomething'.*accepted: "
                             "TimmWrapperModel, TimmWrapperForImageClassification")):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message) as e:
            vitlab.load(folder)
        assert "\n" not in str(e.value)


def test_size_only_in_pretrained_cfg_builds_at_that_size():
    cfg = json.loads((BACKBONES / "timm_dinov2" / "config.json").read_text())
    assert "img_size" not in cfg["model_args"] and cfg["pretrained_cfg"]["input_size"] == [3, 16, 16]
    model = vitlab.load(BACKBONES / "timm_dinov2")
    assert model.patch_embed.img_size == (16, 16)  # not the registered 518, resampled without a word
    state = load_file(BACKBONES / "timm_dinov2" / "model.safetensors")
    assert torch.equal(model.pos_embed, state["pos_embed"])


def test_timm_names_of_the_backbones_build_with_timms_arguments():
    for name, expected in {"deit3_base_patch16_224": dict(no_embed_class=True, init_values=1e-6),
                           "vit_large_patch14_reg4_dinov2": dict(img_size=518, reg_tokens=4, init_values=1e-5),
                           "vit_base_patch16_gap_224": dict(num_heads=16, fc_norm=False, class_token=False),
                           "vit_large_patch14_clip_quickgelu_336": dict(pre_norm=True, act_layer="quick_gelu"),
                           "vit_so400m_patch14_siglip_378": dict(global_pool="map", mlp_ratio=3.7362)}.items():
        args = vitlab.models.registry.get_spec(name).args
        assert {k: args[k] for k in expected} == expected, name


def test_resnet_export_with_global_pool_avg_loads():
    name, args, _ = timm_interop.model_args({"architecture": "resnet18", "num_classes": 7, "global_pool": "avg",
                                             "model_args": {"global_pool": "avg"}})
    assert name == "resnet18" and args == {"num_classes": 7}
    _, args, _ = timm_interop.model_args({"architecture": "resnet18", "model_args": {"global_pool": "max"}})
    with pytest.raises(ValueError, match="does not take 'global_pool'"):
        vitlab.create_model(name, **args)


@pytest.mark.parametrize("option", [{"dynamic_img_pad": True}, {"pos_embed": "rope"}, {"global_pool": "prr"}])
def test_an_option_vitlab_lacks_is_one_line_naming_it(tmp_path, option):
    folder = tmp_path / "m"
    shutil.copytree(BACKBONES / "timm_deit3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_args"].update(option)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        vitlab.load(folder)
    message = str(e.value)
    assert "\n" not in message and (next(iter(option)) in message or repr(next(iter(option.values()))) in message)


def test_resnet_d_hybrid_is_named_not_redirected():
    with pytest.raises(ValueError) as e:
        timm_interop.model_args({"architecture": "vit_small_resnet26d_224"})
    message = str(e.value)
    assert "vit_small_resnet26d_224" in message and "ResNet-D" in message and "did you mean" not in message


def test_resnetv2_hybrids_build_with_timms_backbones():
    """timm's names: R50 at stride 16, R26 and R50-L at 32, R-Ti the stem alone under 8x8 patches of its map."""
    for name, layers, grid, keys in (
            ("vit_base_r50_s16_384", (3, 4, 9), (24, 24), ["patch_embed.backbone.stages.2.blocks.8.norm3.weight"]),
            ("vit_small_r26_s32_224", (2, 2, 2, 2), (7, 7), ["patch_embed.backbone.stem.conv.weight",
                                                             "patch_embed.backbone.stages.3.blocks.0.downsample.conv.weight"]),
            ("vit_tiny_r_s16_p8_224", (), (7, 7), ["patch_embed.backbone.conv.weight", "patch_embed.proj.weight"])):
        spec = vitlab.models.registry.get_spec(name)
        assert spec.args["backbone_layers"] == layers
        model = vitlab.create_model(name, embed_dim=32, depth=1, num_heads=2)
        assert model.patch_embed.grid_size == grid and model.pos_embed.shape[1] == grid[0] * grid[1] + 1
        assert set(keys) <= set(model.state_dict())
    assert vitlab.create_model("vit_tiny_r_s16_p8_224").patch_embed.proj.kernel_size == (8, 8)


def test_hf_vit_hybrid_is_refused_in_one_line(tmp_path):
    cfg = {"model_type": "vit-hybrid", "architectures": ["ViTHybridForImageClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        vitlab.load(tmp_path)
    assert "vit-hybrid" in str(e.value) and "transformers" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["timm_siglip", "timm_dinov2_reg4", "hf_clip_vision_projection", "timm_vit_pwee",
                                  "hf_siglip2_vision", "timm_naflexvit_parfac_gap",
                                  "timm_vit_xp", "timm_tipsv2_giant"])
def test_inspect_reads_the_backbones(tmp_path, name):
    """The attention analyses (heads, rollout, relevance, ...) run on attention-pool, register and pre-norm towers."""
    from PIL import Image

    from vitlab.cli import main

    Image.new("RGB", (20, 24), (120, 30, 200)).save(tmp_path / "a.png")
    out = tmp_path / "report"
    assert main(["inspect", str(BACKBONES / name), "--images", str(tmp_path / "a.png"), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert {"rollout.png", "attention_heads_0.png"} <= {p.name for p in out.iterdir()} and "rollout" in html
    if vitlab.load(BACKBONES / name).num_classes == 0:  # a backbone without a head: no class to explain or score
        assert "Relevance and faithfulness: skipped, the model has no classifier head" in html
        assert not (out / "faithfulness.json").exists()
        return
    faith = json.loads((out / "faithfulness.json").read_text())
    assert {"raw_attention", "rollout", "relevance"} <= set(faith["methods"])


def test_parallel_blocks_are_timms_and_refused_by_transformers(tmp_path):
    """vit_*_18x2_224: two attention branches then two MLP branches per block, under timm's keys; transformers'
    ViT classes hold sequential blocks only, so an HF export is refused in one line."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / "timm_vit_parallel")
    assert model.num_parallel == 2 and "parallel" in model.family
    assert {"blocks.1.attns.1.norm.weight", "blocks.1.attns.1.ls.gamma", "blocks.1.ffns.0.mlp.fc2.bias"} <= set(
        model.state_dict())
    with pytest.raises(ValueError) as e:
        export(model, "hf", tmp_path / "hf")
    assert "parallel blocks" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="num_parallel 0"):
        vitlab.create_model("vit_small_patch16_18x2_224", num_parallel=0)


def test_fused_parallel_blocks_are_timms_and_their_attention_is_captured(tmp_path):
    """vit_pwee_*: ViT-22B's block, one fused input projection for the MLP and q, k, v (its bias the MLP's too, else
    mlp_bias), attention and MLP summed; each block is its own attention module, so analyses read its maps; a timm
    export loads back as timm wrote it, an HF export is refused in one line."""
    from vitlab.analysis.capture import capture_attention
    from vitlab.export import export

    model = vitlab.load(BACKBONES / "timm_vit_pwee_qk_norm")
    assert model.parallel_scaling and "fused projection" in model.family
    assert {"blocks.1.in_proj.weight", "blocks.1.mlp_bias", "blocks.1.q_norm.weight", "blocks.1.attn_out_proj.bias",
            "blocks.1.mlp_out_proj.weight", "blocks.1.ls.gamma"} <= set(model.state_dict())
    io = load_file(BACKBONES / "timm_vit_pwee_qk_norm" / "io.safetensors")
    with capture_attention(model) as maps:
        logits = model(io["input"])
    assert (logits - io["logits"]).abs().max() <= TOL  # the explicit path computes what the fused one does
    assert [m.name for m in maps] == ["blocks.0", "blocks.1"] and maps[0].prefix_tokens == ("reg",)
    torch.testing.assert_close(maps[0].attn.sum(-1), torch.ones_like(maps[0].attn.sum(-1)))
    back = vitlab.load(export(model, "timm", tmp_path / "timm"))
    check(back, io)
    with pytest.raises(ValueError) as e:
        export(model, "hf", tmp_path / "hf")
    assert "parallel blocks" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="two kinds of block"):
        vitlab.create_model("vit_pwee_patch16_reg1_gap_256", num_parallel=2)


def test_rmsnorm_vits_are_timms_and_export_back(tmp_path):
    """vit_*_xp_224: every norm an RMSNorm (before the blocks, in each block, on queries and keys, at the end), no
    LayerNorm left; a timm export names RMSNorm so timm builds it, and a LayerNorm ViT's does not name a norm."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / "timm_vit_xp")
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert len(norms) == 2 + 3 * 2 and all(isinstance(m, torch.nn.RMSNorm) and m.eps == 1e-6 for m in norms)
    assert model.patch_embed.proj.bias is None and model.blocks[0].in_proj.bias is None
    back = export(model, "timm", tmp_path / "timm")
    assert json.loads((back / "config.json").read_text())["model_args"]["norm_layer"] == "rmsnorm"
    check(vitlab.load(back), load_file(BACKBONES / "timm_vit_xp" / "io.safetensors"))
    plain = export(vitlab.load(BACKBONES / "timm_clip"), "timm", tmp_path / "clip")
    assert "norm_layer" not in json.loads((plain / "config.json").read_text())["model_args"]
    with pytest.raises(ValueError, match="norm_layer 'batchnorm'.*accepted: layernorm, rmsnorm"):
        vitlab.create_model("vit_base_patch16_xp_224", norm_layer="batchnorm")


@pytest.mark.parametrize("name", ["timm_dinov2_giant", "timm_tipsv2_giant"])
def test_swiglu_giants_pack_gate_and_value_in_fc1(tmp_path, name):
    """DINOv2's and TIPSv2's giants: fc1 is int(embed_dim * mlp_ratio) wide, its first half the SiLU gate of the
    second; fc2 reads half that. A timm export loads back to the same outputs; transformers' ViT is refused."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / name)
    mlp = model.blocks[0].mlp
    assert mlp.fc1.out_features == 32 and mlp.fc2.in_features == 16 and isinstance(mlp.act, torch.nn.SiLU)
    x = torch.randn(3, 16)
    gate, value = mlp.fc1(x).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.fc2(torch.nn.functional.silu(gate) * value))
    check(vitlab.load(export(model, "timm", tmp_path / "timm")), load_file(BACKBONES / name / "io.safetensors"))
    with pytest.raises(ValueError, match="SwiGLU"):
        export(model, "hf", tmp_path / "hf")
    with pytest.raises(ValueError, match="even"):
        vitlab.create_model("vit_giant_patch14_dinov2", embed_dim=15, num_heads=3, depth=1, mlp_ratio=1.0)


def test_eva_clip_e_blocks_are_residual_post_norm(tmp_path):
    """eva02_enormous_patch14_clip_224: each block adds norm1(attn(x)), then norm2(mlp(x)), with no LayerScale and no
    RoPE; a timm export loads back to timm's outputs, and post-norm refuses the options timm's block lacks."""
    from vitlab.export import export
    from vitlab.models.eva import EvaBlockPostNorm

    model = vitlab.load(BACKBONES / "timm_eva02_enormous")
    blk = model.blocks[0]
    assert isinstance(blk, EvaBlockPostNorm) and model.rope is None and "post-norm" in model.family
    assert not any(".ls" in k or "gamma" in k for k in model.state_dict()) and model.global_pool == "token"
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        h = x + blk.norm1(blk.attn(x))
        torch.testing.assert_close(blk(x), h + blk.norm2(blk.mlp(h)))
    check(vitlab.load(export(model, "timm", tmp_path / "timm")),
          load_file(BACKBONES / "timm_eva02_enormous" / "io.safetensors"))
    with pytest.raises(ValueError, match="use_post_norm=True takes none of qk_norm"):
        vitlab.create_model("eva02_enormous_patch14_clip_224", depth=1, embed_dim=16, num_heads=2, qk_norm=True)


def test_lingbot_is_dinov3_with_q_and_v_biases_and_class_token_pooling():
    model = vitlab.load(BACKBONES / "timm_lingbot")
    attn = model.blocks[0].attn
    assert attn.q_bias is not None and attn.v_bias is not None and model.global_pool == "token"
    assert model.reg_token.shape[1] == 4 and model.pos_embed is None and model.norm.eps == 1e-5
    giant = vitlab.load(BACKBONES / "timm_lingbot_giant")
    assert giant.blocks[0].mlp.fc1_g.out_features == 48 and giant.blocks[0].attn.q_bias is None  # 42 rounded to 8


def test_sapiens2_groups_keys_and_values_per_block(tmp_path):
    """Sapiens2: the middle block reads 2 key/value heads for 4 query heads (head h reads h // 2), its outputs those
    of full attention with each key and value head repeated; RMSNorm everywhere, LayerScale on attention only; a
    timm export loads back to timm's outputs."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / "timm_sapiens2")
    assert [b.attn.num_kv_heads for b in model.blocks] == [4, 2, 4] and model.blocks[1].attn.k_proj.out_features == 8
    assert all(isinstance(m, torch.nn.RMSNorm) for m in (model.norm, model.blocks[1].attn.q_norm))
    assert isinstance(model.blocks[0].ls2, torch.nn.Identity) and model.blocks[0].ls1.gamma.shape == (16,)
    full = vitlab.create_model("vit_base_patch16_sapiens2", **{**model.model_args, "num_kv_heads": None})
    state = dict(model.state_dict())
    for name in ("k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            key = f"blocks.1.attn.{name}.{kind}"
            state[key] = state[key].reshape(2, 4, *state[key].shape[1:]).repeat_interleave(2, 0).flatten(0, 1)
    full.load_state_dict(state)
    x = torch.randn(2, 3, 16, 12)
    with torch.no_grad():
        torch.testing.assert_close(full.eval()(x), model(x))
    check(vitlab.load(export(model, "timm", tmp_path / "timm")),
          load_file(BACKBONES / "timm_sapiens2" / "io.safetensors"))
    with pytest.raises(ValueError, match="num_kv_heads 3 does not fit 4 heads"):
        vitlab.create_model("vit_base_patch16_sapiens2", depth=1, embed_dim=16, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads has 2 entries for 3 blocks"):
        vitlab.create_model("vit_base_patch16_sapiens2", depth=3, embed_dim=16, num_heads=4, num_kv_heads=(4, 2))


def test_aimv2_is_timms_and_transformers_and_exports_back_to_each(tmp_path):
    """AIMv2: the patch tokens pass an RMSNorm before the position table, the blocks hold RMSNorm and a split SwiGLU
    and no biases; timm's folder exports back to timm's and transformers' (its attention-pool head included) to
    transformers' own keys and outputs; native's table is computed for each grid, which timm's names cannot hold."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / "timm_aimv2")
    mlp = model.blocks[0].mlp
    assert model.family.startswith("AIMv2") and isinstance(model.patch_embed.norm, torch.nn.RMSNorm)
    assert model.patch_embed.norm.eps == 1e-5 and model.cls_token is None and model.global_pool == "avg"
    assert mlp.fc1_g.out_features == mlp.fc1_x.out_features == 32 and mlp.fc2.bias is None
    assert model.blocks[0].attn.qkv.bias is None and model.blocks[0].attn.proj.bias is None
    check(vitlab.load(export(model, "timm", tmp_path / "timm")), load_file(BACKBONES / "timm_aimv2" / "io.safetensors"))
    for name in ("hf_aimv2", "hf_aimv2_native"):
        hf = vitlab.load(BACKBONES / name)
        assert hf.global_pool == "map" and hf.attn_pool.mlp is None and hf.num_classes == 0
        folder = export(hf, "hf", tmp_path / name)
        ours, theirs = load_file(folder / "model.safetensors"), load_file(BACKBONES / name / "model.safetensors")
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        cfg, ref = (json.loads((f / "config.json").read_text()) for f in (folder, BACKBONES / name))
        assert {k: cfg[k] for k in ("is_native", "use_head", "qkv_bias", "mlp_bias", "intermediate_size")} == {
            k: ref[k] for k in ("is_native", "use_head", "qkv_bias", "mlp_bias", "intermediate_size")}
        check(vitlab.load(folder), load_file(BACKBONES / name / "io.safetensors"))
    native = vitlab.load(BACKBONES / "hf_aimv2_native")
    assert native.pos_embed is None and native.pos_embed_type == "sincos_xy"
    with pytest.raises(ValueError, match="sin-cos table is computed for each input.*onnx$") as e:
        export(native, "timm", tmp_path / "native")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="classifier head.*reset_classifier"):
        export(model, "hf", tmp_path / "hf")


def test_aimv2_configs_vitlab_cannot_hold_are_one_line(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(BACKBONES / "hf_aimv2", folder)
    cfg = json.loads((folder / "config.json").read_text())
    for change, message in ((dict(qkv_bias=True), "qkv_bias=true and mlp_bias=false.*accepted: both"),
                            (dict(hidden_act="gelu"), "hidden_act 'gelu'.*accepted: silu")):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message) as e:
            vitlab.load(folder)
        assert "\n" not in str(e.value)
    from vitlab.interop import hf

    _, args, _ = hf.model_args({**cfg, "use_head": False, "is_native": True})  # no head: the mean token, any size
    assert args["global_pool"] == "avg" and args["pos_embed"] == "sincos_xy" and args["dynamic_img_size"]


@pytest.mark.parametrize("name", ["timm_qwen3", "timm_qwen3_merge", "timm_qwen3_enc"])
def test_qwen3_towers_are_timms_and_export_back(tmp_path, name):
    """Qwen3-VL's tower: its 4x4 table resampled bilinearly (corners aligned) to every grid, RoPE, no output norm;
    the classifiers' trunk under timm's encoder. prefix, the encoder's not; the merger concatenates each 2x2 block of
    normalised tokens before fc1. A timm export has timm's keys and loads back to timm's outputs at both sizes."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / name)
    theirs = load_file(BACKBONES / name / "model.safetensors")
    assert model.pos_embed.shape == (1, 16, 16) and model.cls_token is None
    assert isinstance(model.norm, torch.nn.Identity)
    assert all(k.startswith(("encoder.", "head.")) for k in theirs) != (name == "timm_qwen3_enc")
    folder = export(model, "timm", tmp_path / "timm")
    ours = load_file(folder / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    back = vitlab.load(folder, dynamic_img_size=True)
    check(back, load_file(BACKBONES / name / "io_dynamic.safetensors"))
    if model.merger is not None:
        x = torch.randn(1, 4 * 6, 16)  # a 4x6 grid: block (0, 1) holds tokens 2, 3, 8, 9
        merger = model.merger
        with torch.no_grad():
            out = merger(x, (4, 6))
            block = merger.norm(x)[0, [2, 3, 8, 9]].reshape(-1)
            torch.testing.assert_close(out[0, 1], merger.fc2(merger.act(merger.fc1(block))))
        with pytest.raises(ValueError, match="5x4 patch grid does not split.*multiples of 8 pixels"):
            model.forward_features(torch.randn(1, 3, 20, 16))


@pytest.mark.parametrize("name, tower, norm", [("timm_qwen3_enc", "Qwen3 ViT", torch.nn.functional.layer_norm),
                                              ("timm_deepseek_enc", "DeepSeek ViT", torch.nn.functional.rms_norm)])
def test_vlm_encoders_output_their_projectors_tokens_and_fine_tune_as_classifiers(name, tower, norm):
    """Qwen3's merger: 16 tokens merged 2x2; DeepSeek's aligner: a 6x6 grid in 3x3 blocks; each 8 wide."""
    enc = vitlab.load(BACKBONES / name)
    io = load_file(BACKBONES / name / "io.safetensors")
    assert enc.encoder_only and io["logits"].shape == (2, 4, 8)
    with pytest.raises(ValueError, match=f"encoder_only {tower} has no classifier") as e:
        enc.reset_classifier(3)
    assert "\n" not in str(e.value)
    tuned = vitlab.load(BACKBONES / name, encoder_only=False, num_classes=3, global_pool="avg", final_norm=True)
    with torch.no_grad():
        pooled = tuned.forward_head(tuned.forward_features(io["input"]), pre_logits=True)
    torch.testing.assert_close(pooled, norm(io["logits"].mean(1), (8,), eps=1e-6))


@pytest.mark.parametrize("name", ["timm_deepseek", "timm_deepseek_align", "timm_deepseek_enc"])
def test_deepseek_towers_are_timms_and_export_back(tmp_path, name):
    """DeepSeek-V4's tower: RMSNorm blocks with a bias-free packed SwiGLU and RoPE alone (no table, no class token);
    the classifiers' trunk under timm's encoder. prefix, the encoder's not; the aligner zero-pads the grid to its 3x3
    blocks and concatenates each block's tokens channel-major before fc1. A timm export has timm's keys and loads back
    to timm's outputs at both sizes (the encoder's second one padded to its patches: dynamic_img_pad)."""
    from vitlab.export import export

    model = vitlab.load(BACKBONES / name)
    theirs = load_file(BACKBONES / name / "model.safetensors")
    blk = model.blocks[0]
    assert model.pos_embed is None and model.cls_token is None and blk.mlp.fc1.bias is None
    assert blk.attn.qkv.bias is not None and type(model.norm).__name__ == "RMSNorm"
    assert all(k.startswith(("encoder.", "head.")) for k in theirs) != (name == "timm_deepseek_enc")
    folder = export(model, "timm", tmp_path / "timm")
    ours = load_file(folder / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    cfg = json.loads((folder / "config.json").read_text())  # timm's letterbox, which vitlab records, not applies
    assert cfg["architecture"] == name.replace("timm_deepseek", "deepseek_vit_412m")
    assert cfg["pretrained_cfg"]["crop_mode"] == model.pretrained_cfg["crop_mode"] == "border"
    check(vitlab.load(folder, dynamic_img_size=True), load_file(BACKBONES / name / "io_dynamic.safetensors"))
    if model.aligner is not None:
        x = torch.randn(1, 4 * 5, 16)  # a 4x5 grid padded to 6x6: block (1, 1) holds tokens 18 and 19, then zeros
        aligner = model.aligner
        block = torch.zeros(16, 3, 3)  # (C, kh, kw)
        block[:, 0, :2] = x[0, [18, 19]].T
        with torch.no_grad():
            out = aligner(x, (4, 5))
            torch.testing.assert_close(out[0, 3], aligner.fc2(aligner.act(aligner.fc1(block.reshape(-1)))))
        assert out.shape == (1, 4, 8)


def test_deepseek_refuses_what_timm_does_not_build_and_records_timms_letterbox():
    enc = vitlab.load(BACKBONES / "timm_deepseek_enc")
    assert enc.dynamic_img_pad
    from vitlab.data.views import Preprocess

    with pytest.raises(ValueError, match="crop_mode 'border' .*padded with the mean colour.*accepted: center, squash"):
        Preprocess.from_cfg(enc.pretrained_cfg).apply(torch.zeros(1, 3, 30, 20, dtype=torch.uint8))
    small = dict(embed_dim=16, depth=1, num_heads=2, img_size=28)
    for args, message in ((dict(encoder_pool="merge"), "encoder_pool 'merge' is not one vitlab implements; "
                                                       "accepted: '', 'align'"),
                          (dict(encoder_only=True), "encoder_only=True is the DeepSeek ViT's encoder"),
                          (dict(encoder_pool="align", out_features=0), "out_features >= 1")):
        with pytest.raises(ValueError, match=message) as e:
            vitlab.create_model("deepseek_vit_412m", **small, **args)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["timm_gemma4", "timm_gemma4_enc"])
def test_gemma4_towers_are_timms_and_export_back(tmp_path, name):
    """Gemma 4's tower: sandwich blocks of four RMSNorms, a vector per column and row, clamped projections (167m,
    whose ranges cut: without them the outputs change) or standardised soft tokens (570m, 3x3 cells times sqrt(D)); a
    timm export has timm's keys and loads back to timm's outputs at a second size."""
    from vitlab.export import export
    from vitlab.models.gemma4 import ClippableLinear

    model = vitlab.load(BACKBONES / name)
    io = load_file(BACKBONES / name / "io.safetensors")
    blk = model.blocks[0]
    assert {type(getattr(blk, f"norm{i}")).__name__ for i in range(1, 5)} == {"RMSNorm"}
    assert blk.attn.v_norm.weight is None and model.patch_embed.position_embedding_table.shape == (2, 12, 16)
    theirs = load_file(BACKBONES / name / "model.safetensors")
    folder = export(model, "timm", tmp_path / "timm")
    ours = load_file(folder / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    check(vitlab.load(folder, dynamic_img_size=True), load_file(BACKBONES / name / "io_dynamic.safetensors"))
    if name == "timm_gemma4":
        for m in model.modules():
            if isinstance(m, ClippableLinear):
                m.use_clipped = False
        with torch.no_grad():
            assert (model(io["input"]) - io["logits"]).abs().max() > 1e-3
    else:
        assert model.encoder_only and io["logits"].shape == (2, 4, 16) and model.std_bias.abs().sum() > 0
        with torch.no_grad():
            tokens = model.forward_features(io["input"])
            cell = tokens[0].reshape(6, 6, 16)[:3, 3:].mean((0, 1)) * 4.0  # cell (0, 1) of the 6x6 grid, sqrt(16)
            torch.testing.assert_close(model.forward_head(tokens)[0, 1], (cell - model.std_bias) * model.std_scale)
        with pytest.raises(ValueError, match="4x6 patch grid does not split into the soft-token pool's 3x3 cells"):
            model.forward_features(torch.rand(1, 3, 8, 12))
        with pytest.raises(ValueError, match="encoder_only Gemma 4 ViT has no classifier"):
            model.reset_classifier(3)
