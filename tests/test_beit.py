"""BEiT and data2vec-vision: timm's and transformers' folders load with their relative position bias and LayerScale."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.analysis.capture import capture_attention
from vitlab.models.beit import Beit, relative_position_index

PARITY = Path(__file__).parent / "fixtures" / "parity"


def test_relative_position_index_matches_offsets_and_class_rows():
    index = relative_position_index((2, 3))
    offsets = 3 * 5
    assert index.shape == (7, 7)
    assert index[0, 0] == offsets + 2 and (index[0, 1:] == offsets).all() and (index[1:, 0] == offsets + 1).all()
    # patch (0, 0) to itself is offset (0, 0), the table's centre row; (1, 2) -> (0, 0) is offset (+1, +2)
    assert index[1, 1] == (2 - 1) * 5 + (3 - 1)
    assert index[6, 1] == (1 + 1) * 5 + (2 + 2)
    assert index[1:, 1:].max() < offsets


@pytest.mark.parametrize("name", ["timm_beit", "timm_beit_shared_abs", "hf_beit_shared", "hf_data2vec_vision"])
def test_options_are_read_off_the_folders(name):
    model = vitlab.load(PARITY / name)
    assert isinstance(model, Beit) and model.family.startswith("BEiT")
    shared = name.endswith(("shared", "shared_abs"))
    assert (model.rel_pos_bias is not None) == shared and (model.pos_embed is not None) == shared
    assert (model.blocks[0].attn.relative_position_bias_table is None) == shared


def test_relative_bias_changes_the_captured_attention():
    """The probabilities capture reads include the relative position bias (slow path = fused path)."""
    model = vitlab.load(PARITY / "timm_beit")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad(), capture_attention(model) as maps:
        model(x)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.relative_position_bias_table.zero_()
        with capture_attention(model) as flat:
            model(x)
    assert len(maps) == 2 and maps[0].prefix_tokens == ("cls",) and maps[0].grid_size == (4, 4)
    assert not torch.allclose(maps[0].attn, flat[0].attn, atol=1e-3)


@pytest.mark.parametrize("size", [(24, 24), (28, 20)])
def test_another_size_on_load_resizes_the_tables_as_timm_does(size):
    """timm loads a BEiT folder at another img_size by resizing each table on BEiT's geometric offsets: vitlab
    loads it alike (tests/fixtures/parity/timm_beit/io_resized_*, timm 1.0.31's outputs)."""
    io = load_file(PARITY / "timm_beit" / f"io_resized_{size[0]}x{size[1]}.safetensors")
    model = vitlab.load(PARITY / "timm_beit", img_size=size)
    with torch.no_grad():
        torch.testing.assert_close(model(io["input"]), io["logits"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model.forward_features(io["input"]), io["features"], atol=1e-4, rtol=1e-4)


def test_the_resized_table_keeps_the_class_rows_and_a_constant_and_refuses_an_unknown_grid():
    from vitlab.models.beit import resize_rel_pos_table

    table = torch.randn(7 * 7 + 3, 2)
    assert resize_rel_pos_table(table, (4, 4)) is table
    big = resize_rel_pos_table(table, (6, 5))
    assert big.shape == (11 * 9 + 3, 2) and torch.equal(big[-3:], table[-3:])
    assert torch.equal(big[(11 * 9) // 2], table[(7 * 7) // 2])  # offset (0, 0) stays where it was
    torch.testing.assert_close(resize_rel_pos_table(torch.ones(52, 2), (6, 5)), torch.ones(11 * 9 + 3, 2))
    with pytest.raises(ValueError, match="not square") as e:
        resize_rel_pos_table(torch.randn(7 * 9 + 3, 2), (6, 6))  # a 4x5 grid's table
    assert "\n" not in str(e.value)


def test_dynamic_size_resamples_the_tables_bilinearly(tmp_path):
    """dynamic_img_size: the offset rows resampled as an image per head, the class-token rows kept."""
    from vitlab.models.beit import resample_rel_pos_table

    table = torch.randn(7 * 7 + 3, 2)
    same = resample_rel_pos_table(table, (4, 4), (4, 4))
    assert same is table
    big = resample_rel_pos_table(table, (4, 4), (6, 5))
    assert big.shape == (11 * 9 + 3, 2) and torch.equal(big[-3:], table[-3:])
    const = resample_rel_pos_table(torch.ones(52, 2), (4, 4), (6, 5))
    torch.testing.assert_close(const, torch.ones_like(const))
    model = vitlab.load(PARITY / "timm_beit", dynamic_img_size=True)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 24, 20)).shape == (1, 5)
    with pytest.raises(ValueError, match="timm's Beit cannot express dynamic_img_size"):
        from vitlab.export import export

        export(model, "timm", tmp_path / "t")


def test_layer_scale_off_exports_as_timm_reads_it(tmp_path):
    """timm reads init_values=None as its name's default (0.1): a model without LayerScale exports 0.0."""
    from vitlab.export import export

    model = vitlab.create_model("beit_base_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=1,
                                num_heads=2, init_values=None)
    folder = export(model, "timm", tmp_path / "t")
    assert json.loads((folder / "config.json").read_text())["model_args"]["init_values"] == 0.0
    back = vitlab.load(folder)
    assert isinstance(back.blocks[0].ls1, torch.nn.Identity)


def test_hf_key_generations_both_load(tmp_path):
    """transformers 5 writes ``layers.i.attention.q_proj``; the Hub's folders say ``encoder.layer.i...query``."""
    from safetensors.torch import load_file, save_file

    from vitlab.export import export

    model = vitlab.load(PARITY / "hf_beit_classifier")
    folder = export(model, "hf", tmp_path / "new")
    keys = load_file(folder / "model.safetensors").keys()
    assert "beit.layers.0.attention.q_proj.weight" in keys and "beit.layers.1.lambda_2" in keys
    old = tmp_path / "old"
    shutil.copytree(PARITY / "hf_beit_classifier", old)
    assert "beit.encoder.layer.0.attention.attention.query.weight" in load_file(old / "model.safetensors")
    back = vitlab.load(folder)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(back(x), vitlab.load(old)(x))
    state = load_file(old / "model.safetensors")
    state["beit.encoder.layer.0.attention.attention.key.bias"] = torch.zeros(16)
    save_file(state, old / "model.safetensors")
    with pytest.raises(ValueError, match="no place in a beit model: beit.encoder.layer.0.attention.attention.key.bias"):
        vitlab.load(old)
