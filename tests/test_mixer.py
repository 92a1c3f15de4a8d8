"""MLP-Mixer: timm's names and folders, its fixed grid, and an inspection without attention."""
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.analysis.report import inspect_model

FIXTURE = Path(__file__).parent / "fixtures" / "parity" / "timm_mixer"


def test_timm_names_build_with_timms_sizes():
    for name, (dim, blocks, patch) in {"mixer_s32_224": (512, 8, 32), "mixer_b16_224": (768, 12, 16),
                                       "mixer_l16_224": (1024, 24, 16)}.items():
        args = vitlab.models.registry.get_spec(name).args
        assert (args["embed_dim"], args["num_blocks"], args["patch_size"]) == (dim, blocks, patch)
    model = vitlab.create_model("mixer_b16_224", num_blocks=1)
    assert model.blocks[0].mlp_tokens.fc1.weight.shape == (384, 196)  # N * 0.5 hidden units over 14x14 tokens
    assert model.blocks[0].mlp_channels.fc1.weight.shape == (3072, 768)


def test_token_mlp_fixes_the_input_size():
    with pytest.raises(ValueError, match="does not take 'dynamic_img_size'"):
        vitlab.load(FIXTURE, dynamic_img_size=True)
    model = vitlab.load(FIXTURE)
    with pytest.raises(ValueError, match="does not match the model's 16x16"):
        model(torch.randn(1, 3, 24, 24))
    from vitlab.train.progressive import any_size
    with pytest.raises(ValueError, match="one input size only .*token-mixing MLP.*progressive-scale 1"):
        any_size(model)


def test_token_mixing_weights_are_maps_over_the_grid():
    model = vitlab.load(FIXTURE)
    maps = model.token_mixing_weights(1)
    assert maps.shape == (8, 4, 4)  # 16 tokens * 0.5 hidden units, each over the 4x4 grid
    assert torch.equal(maps[3].flatten(), model.blocks[1].mlp_tokens.fc1.weight[3])


def test_inspect_draws_token_mixing_and_skips_attention_with_a_note(tmp_path):
    model = vitlab.create_model("mixer_nano_patch4_32", num_blocks=2, embed_dim=32)
    html = inspect_model(model, torch.randn(2, 3, 32, 32), tmp_path).read_text()
    assert {"token_mixing.png", "patch_grid.png", "embedding_filters.png"} <= {p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / "rollout.png").exists() and not (tmp_path / "faithfulness.json").exists()
    assert "rollout, relevance" in html and "skipped, an MLP-Mixer mixes its tokens with a fixed MLP" in html
