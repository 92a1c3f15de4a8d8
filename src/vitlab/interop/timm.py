"""timm Hub exports (``save_for_hf``): config.json with ``architecture`` and ``model_args``, timm's keys."""
from __future__ import annotations

import re
from typing import Any

import torch

from ..models.registry import get_spec, list_models


def is_timm_config(cfg: dict[str, Any]) -> bool:
    return "architecture" in cfg and cfg.get("library") != "vitlab"


def model_args(cfg: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(vitlab name, its arguments, preprocessing) from a timm config.json."""
    name = cfg["architecture"]
    try:
        get_spec(name)
    except ValueError as e:
        families = sorted({n.split("_")[0] for n in list_models()})
        raise ValueError(f"timm architecture {name!r} is not one vitlab implements ({e}); "
                         f"supported families: {', '.join(families)}") from None
    args = dict(cfg.get("model_args") or {})
    for key in ("num_classes", "global_pool"):
        if key in cfg and key not in args:
            args[key] = cfg[key]
    pre = cfg.get("pretrained_cfg") or {}
    preprocess = {k: pre[k] for k in ("mean", "std", "input_size", "interpolation", "crop_pct") if k in pre}
    if pre.get("label_names"):
        preprocess["label_names"] = list(pre["label_names"])
    return name, args, preprocess


_CAIT_GAMMA = re.compile(r"^(blocks(?:_token_only)?\.\d+)\.gamma_([12])$")


def convert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm keys -> vitlab keys: identical but for CaiT's LayerScale (``gamma_1`` -> ``ls1.gamma``)."""
    out = {}
    for k, v in state.items():
        k = k.removeprefix("module.")
        k = _CAIT_GAMMA.sub(r"\1.ls\2.gamma", k)
        out[k] = v
    return out
