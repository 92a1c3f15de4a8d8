"""DINOv3: timm's Eva with RoPE on patch centres in [-1, 1], read off timm's and transformers' folders and written
back in both layouts (tests/fixtures/parity/*dinov3*, benchmarks/make_parity_fixtures.py)."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.export import export
from vitlab.models.eva import Eva
from vitlab.models.rope import CenteredRope, CoordAugment, apply_rope, grid_coords

PARITY = Path(__file__).parent / "fixtures" / "parity"


def test_centred_coordinates_are_patch_centres_in_minus_one_one():
    coords = grid_coords((2, 4), centered=True)
    assert coords[:4].tolist() == [[-0.5, -0.75], [-0.5, -0.25], [-0.5, 0.25], [-0.5, 0.75]]
    assert coords[-1].tolist() == [0.5, 0.75]
    assert grid_coords((2, 4), "xy", centered=True)[1].tolist() == [-0.25, -0.5]  # (column, row)
    big = grid_coords((8, 8), centered=True)  # another size spans the same range
    assert big.min() == -0.875 and big.max() == 0.875


def test_centred_rope_angles_and_half_layout_by_hand():
    rope = CenteredRope(8, temperature=100.0)
    emb = rope((2, 4))
    sin, cos = emb.chunk(2, -1)
    assert emb.shape == (8, 16) and torch.equal(sin[:, :4], sin[:, 4:])  # half layout: angles written twice over
    periods = [100.0 ** (4 * j / 8) for j in range(2)]  # head_dim / 4 = 2 bands per axis
    y, x = -0.5, 0.25  # patch (0, 2)
    expected = [2 * math.pi * c / p for c in (y, x) for p in periods]
    torch.testing.assert_close(sin[2, :4], torch.tensor(expected).sin())
    q, k = torch.randn(8), torch.randn(8)
    rq, rk = apply_rope(q.expand(8, 8), emb, half=True), apply_rope(k.expand(8, 8), emb, half=True)
    torch.testing.assert_close(rq[0] @ rk[1], rq[1] @ rk[2])  # the same offset, the same score
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(8))


def test_coordinate_augmentation_only_in_training_and_checked():
    rope = CenteredRope(8, augment=CoordAugment(shift=0.1, jitter=1.5, rescale=2.0))
    still = rope.eval()((3, 3))
    assert torch.equal(still, rope((3, 3)))
    rope.train()
    torch.manual_seed(1)
    moved = rope((3, 3))
    assert not torch.allclose(moved, still)
    torch.manual_seed(1)
    assert torch.equal(moved, rope((3, 3)))  # one draw of the generator: reproducible
    for bad in (dict(rope_rescale_coords=0.5), dict(rope_shift_coords=-1.0), dict(rope_jitter_coords=float("nan"))):
        with pytest.raises(ValueError) as e:
            vitlab.create_model("vit_small_patch16_dinov3", embed_dim=32, depth=1, num_heads=2, **bad)
        assert next(iter(bad)) in str(e.value) and "accepted" in str(e.value) and "\n" not in str(e.value)


def test_timm_names_build_timms_layout():
    with torch.device("meta"):
        plus = vitlab.create_model("vit_huge_plus_patch16_dinov3_qkvb")
        small = vitlab.create_model("vit_small_patch16_dinov3")
    blk = plus.blocks[0]
    assert plus.embed_dim == 1280 and len(plus.blocks) == 32 and blk.mlp.fc1_g.out_features == 5120
    assert blk.attn.q_bias is not None and blk.attn.rotate_half and plus.reg_token.shape == (1, 4, 1280)
    assert small.pos_embed is None and small.blocks[0].attn.q_bias is None and small.norm.eps == 1e-5
    assert small.patch_embed.img_size == (256, 256) and small.dynamic_img_size and small.global_pool == "avg"
    assert small.family.startswith("DINOv3") and small.hf_model_type == "dinov3_vit"


def test_options_are_read_off_the_folders():
    plus = vitlab.load(PARITY / "timm_dinov3_plus_qkvb")
    assert plus.blocks[0].mlp.fc1_g.out_features == 40  # 16 x 2.25 = 36, rounded up to a multiple of 8
    assert plus.num_prefix_tokens == 5 and plus.blocks[0].attn.q_bias is not None and plus.num_classes == 0
    gated = vitlab.load(PARITY / "hf_dinov3_gated")
    assert gated.reg_token.shape[1] == 2 and gated.blocks[0].mlp.fc1_g.out_features == 40
    assert gated.rope.augment == CoordAugment(rescale=2.0)  # transformers' default, in training only
    assert gated.global_pool == "token" and gated.num_classes == 0 and isinstance(gated, Eva)
    state = load_file(PARITY / "hf_dinov3_gated" / "model.safetensors")
    assert torch.equal(gated.blocks[1].ls1.gamma, state["layer.1.layer_scale1.lambda1"])


@pytest.mark.parametrize("name", ["hf_dinov3", "hf_dinov3_gated"])
def test_hf_export_writes_transformers_keys_and_config(tmp_path, name):
    model = vitlab.load(PARITY / name)
    folder = export(model, "hf", tmp_path / "h")
    ours, theirs = load_file(folder / "model.safetensors"), load_file(PARITY / name / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs if k != "embeddings.mask_token")
    cfg, ref = (json.loads((f / "config.json").read_text()) for f in (folder, PARITY / name))
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "hidden_act", "use_gated_mlp",
                "layer_norm_eps", "rope_theta", "query_bias", "key_bias", "value_bias", "layerscale_value",
                "num_register_tokens", "pos_embed_shift", "pos_embed_jitter", "pos_embed_rescale"):
        assert cfg[key] == ref[key], key
    io = load_file(PARITY / name / "io_dynamic.safetensors")
    with torch.no_grad():
        assert torch.equal(vitlab.load(folder).forward_features(io["input"]), model.forward_features(io["input"]))


def test_timm_models_export_to_transformers_once_they_pool_like_it(tmp_path):
    """timm's SwiGLU (fc1_g, fc1_x) and a packed one (fc1, gate first) both become gate_proj and up_proj."""
    model = vitlab.load(PARITY / "timm_dinov3")
    with pytest.raises(ValueError) as e:
        export(model, "hf", tmp_path / "x")
    message = str(e.value)
    assert "classifier head" in message and "global_pool='avg'" in message and "\n" not in message
    assert not (tmp_path / "x").exists()
    model.reset_classifier(0, global_pool="token")
    x = torch.randn(1, 3, 20, 24)
    with torch.no_grad():
        assert torch.equal(vitlab.load(export(model, "hf", tmp_path / "t")).forward_features(x),
                           model.forward_features(x))
    packed = vitlab.create_model("vit_small_patch16_dinov3", img_size=16, patch_size=4, embed_dim=32, depth=2,
                                 num_heads=2, num_classes=0,
                                 global_pool="token", swiglu_mlp=True).eval()
    assert packed.blocks[0].mlp.packed
    with torch.no_grad():
        for p in packed.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        back = vitlab.load(export(packed, "hf", tmp_path / "p"))
        torch.testing.assert_close(back.forward_features(x), packed.forward_features(x), rtol=0, atol=1e-5)


def test_a_dinov3_config_vitlab_cannot_express_is_one_line(tmp_path):
    folder = tmp_path / "d"
    shutil.copytree(PARITY / "hf_dinov3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    for change, named in ((dict(key_bias=True, query_bias=False), "key_bias"), (dict(proj_bias=False), "proj_bias"),
                          (dict(use_gated_mlp=True, hidden_act="gelu"), "hidden_act")):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError) as e:
            vitlab.load(folder)
        assert named in str(e.value) and "accepted" in str(e.value) and "\n" not in str(e.value)


def test_rotary_similarity_depends_on_the_offset_only():
    from vitlab.analysis.embeddings import rotary_similarity

    model = vitlab.create_model("vit_small_patch16_dinov3", img_size=64, embed_dim=32, depth=1, num_heads=2).train()
    sim = rotary_similarity(model)
    assert sim.shape == (4, 4, 4, 4) and model.rope.training  # read in eval mode, the mode left as it was
    torch.testing.assert_close(sim[0, 0, 0, 0], torch.tensor(1.0))
    torch.testing.assert_close(sim[0, 0, 1, 2], sim[1, 1, 2, 3])  # the same offset, the same similarity
    torch.testing.assert_close(sim[1, 1, 1, 2], sim[1, 2, 1, 1])  # symmetric
    assert sim[1, 1, 1, 2] < 0.99 and sim[1, 1].max() == sim[1, 1, 1, 1]  # the patch itself is the most alike
    with pytest.raises(ValueError, match="no rotary"):
        rotary_similarity(vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2))


@pytest.mark.parametrize("name", ["hf_dinov3", "timm_dinov3", "timm_lingbot", "timm_sapiens2"])
def test_inspect_says_there_is_no_position_table_and_draws_the_rotation(tmp_path, name):
    from PIL import Image

    from vitlab.cli import main

    Image.new("RGB", (20, 24), (120, 30, 200)).save(tmp_path / "a.png")
    out = tmp_path / "report"
    assert main(["inspect", str(PARITY / name), "--images", str(tmp_path / "a.png"), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert (out / "rotary_similarity.png").is_file() and not (out / "position_similarity.png").exists()
    assert "This model has no position table" in html and "rollout.png" in html
