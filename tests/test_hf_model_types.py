"""transformers' ViT-family model types (tests/fixtures/hf_model_types.json, benchmarks/list_hf_model_types.py):
each is read by vitlab or refused in one line naming the piece vitlab lacks."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitlab.interop import hf

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "hf_model_types.json").read_text())
TYPES = FIXTURE["model_types"] + FIXTURE["no_longer_in_transformers"]
TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4,
            intermediate_size=32)


def test_the_fixture_lists_the_families_vitlab_reads():
    assert {"vit", "deit", "dinov2", "clip_vision_model", "siglip_vision_model", "beit", "vit_msn", "vit_mae"} <= set(
        FIXTURE["model_types"])
    assert "vit-hybrid" in FIXTURE["no_longer_in_transformers"]


@pytest.mark.parametrize("model_type", TYPES)
def test_each_model_type_builds_or_names_what_vitlab_lacks(model_type):
    cfg = {"model_type": model_type, **TINY}
    if model_type in hf.HF_MODEL_TYPES:
        cls, args, _ = hf.model_args(cfg)
        model = cls(**args).eval()
        with torch.no_grad():
            assert model(torch.randn(1, 3, 16, 16)).shape[0] == 1
        return
    with pytest.raises(ValueError) as e:
        hf.model_args(cfg)
    message = str(e.value)
    assert "\n" not in message and repr(model_type) in message and hf.HF_NOT_READ[model_type] in message


def test_mae_pretraining_folder_loads_its_encoder_and_leaves_the_decoder():
    """facebook/vit-mae-* hold ViTMAEForPreTraining: the encoder under ``vit.``, the pixel decoder beside it."""
    folder = Path(__file__).parent / "fixtures" / "parity" / "hf_vit_mae"
    cfg = {**json.loads((folder / "config.json").read_text()), "architectures": ["ViTMAEForPreTraining"]}
    state = {f"vit.{k}": v for k, v in load_file(folder / "model.safetensors").items()}
    state["decoder.decoder_embed.weight"] = torch.zeros(8, 16)
    cls, args, _ = hf.model_args(cfg)
    model = cls(**args).eval()
    model.load_state_dict(hf.convert_state_dict(state, cfg))  # strict: every key placed, none left over
    io = load_file(folder / "io.safetensors")
    with torch.no_grad():
        assert (model.forward_features(io["input"]) - io["features"]).abs().max() <= 1e-4
