"""Every ViT-family name timm 1.0.31 lists (tests/fixtures/timm_names.json, benchmarks/list_timm_names.py) builds in
vitlab or is refused in one line that names the piece vitlab lacks: a name timm adds is never silently missed."""
import json
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.interop import timm as timm_interop
from vitlab.models.registry import list_models

NAMES = json.loads((Path(__file__).parent / "fixtures" / "timm_names.json").read_text())
KNOWN = set(list_models())


def test_the_walk_covers_timms_families():
    assert NAMES["timm"] == "1.0.31" and len(NAMES["names"]) >= 250
    assert {n.split(".")[0] for n in NAMES["pretrained"]} <= set(NAMES["names"])  # every tag is of a listed name
    for expected in ("vit_base_r50_s16_384", "mixer_b16_224", "flexivit_small", "deit_base_distilled_patch16_384"):
        assert expected in NAMES["names"] and expected in KNOWN


@pytest.mark.parametrize("name", NAMES["names"])
def test_each_timm_name_builds_or_says_what_is_missing(name):
    if name in KNOWN:
        with torch.device("meta"):  # the shapes alone: the giants build in no time
            model = vitlab.create_model(name)
        assert model.arch == name and name in model.timm_names
        return
    with pytest.raises(ValueError) as e:
        timm_interop.model_args({"architecture": name})
    message = str(e.value)
    assert "\n" not in message and name in message and "vitlab lacks " in message, message
