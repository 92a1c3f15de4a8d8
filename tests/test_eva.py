"""EVA02 and the RoPE ViTs: rotary position embedding as timm builds it, read off timm's folders."""
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.analysis.capture import capture_attention
from vitlab.models.eva import Eva
from vitlab.models.rope import AxialRope, MixedRope, apply_rope, grid_coords

PARITY = Path(__file__).parent / "fixtures" / "parity"


def test_grid_coords_order_and_rescaling():
    ij = grid_coords((2, 3))
    assert ij.tolist()[:4] == [[0, 0], [0, 1], [0, 2], [1, 0]]  # (row, column), row-major
    assert grid_coords((2, 3), "xy").tolist()[3] == [0, 1]  # (column, row)
    assert grid_coords((2, 4), ref_grid=(4, 8))[-1].tolist() == [2, 6]  # EVA02: spans the reference grid


def test_axial_rope_rotates_pairs_so_scores_depend_on_offsets():
    rope = AxialRope(8, temperature=100.0)
    emb = rope((3, 3))
    assert emb.shape == (9, 16)
    sin, cos = emb.chunk(2, -1)
    torch.testing.assert_close(sin ** 2 + cos ** 2, torch.ones_like(sin))
    assert torch.equal(sin[:, 0::2], sin[:, 1::2])  # each pair turns by one angle
    q, k = torch.randn(8), torch.randn(8)
    rq, rk = apply_rope(q.expand(9, 8), emb), apply_rope(k.expand(9, 8), emb)
    # (0, 0)-(1, 1) and (1, 1)-(2, 2) are the same offset: the same score; the norm is kept
    torch.testing.assert_close(rq[0] @ rk[4], rq[4] @ rk[8])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(9))


def test_mixed_rope_is_learned_per_block_and_head():
    rope = MixedRope(8, depth=3, num_heads=2)
    assert rope.freqs.shape == (2, 3, 2, 4) and rope((2, 2)).shape == (3, 2, 4, 16)


@pytest.mark.parametrize("name, family", [("timm_eva02", "EVA02"), ("timm_vit_rope_mixed_ape", "RoPE ViT (mixed)"),
                                          ("timm_vit_rope_reg_gap", "EVA02")])
def test_options_are_read_off_the_folders(name, family):
    model = vitlab.load(PARITY / name)
    assert isinstance(model, Eva) and model.family.startswith(family)
    if name == "timm_vit_rope_reg_gap":
        assert model.cls_token is None and model.reg_token.shape[1] == 1 and model.global_pool == "avg"
        assert model.blocks[0].attn.num_prefix_tokens == 1


def test_captured_attention_includes_the_rotation():
    """The probabilities capture reads are the rotated ones (slow path = fused path): another grid changes them."""
    model = vitlab.load(PARITY / "timm_eva02")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad(), capture_attention(model) as maps:
        model(x)
    model.rope.ref_grid = (8, 8)  # the same patches at other rotary positions
    with torch.no_grad(), capture_attention(model) as moved:
        model(x)
    assert len(maps) == 2 and maps[0].grid_size == (4, 4)
    assert not torch.allclose(maps[0].attn, moved[0].attn, atol=1e-4)


def test_timm_export_keeps_timms_names(tmp_path):
    from safetensors.torch import load_file

    from vitlab.export import export

    model = vitlab.load(PARITY / "timm_vit_rope_mixed_ape")
    keys = load_file(export(model, "timm", tmp_path / "t") / "model.safetensors").keys()
    assert {"rope.freqs", "blocks.0.gamma_1", "blocks.0.attn.qkv.bias"} <= keys
    with pytest.raises(ValueError, match="rotary attention"):
        export(model, "hf", tmp_path / "h")
