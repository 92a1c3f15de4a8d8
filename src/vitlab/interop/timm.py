"""timm Hub folders (``save_for_hf``): config.json with ``architecture`` and ``model_args``, timm's keys.

Both ways: ``model_args``/``convert_state_dict`` read timm's folders, ``export_config``/``export_state_dict``
write them for every family timm has (ViT, DeiT, CaiT, ConViT, ResNet with the ImageNet stem).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

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
    names = cfg.get("label_names") or pre.get("label_names")  # save_for_hf writes them at the top level
    if isinstance(names, dict):
        names = [names.get(str(i), names.get(i, str(i))) for i in range(len(names))]
    if names:
        preprocess["label_names"] = list(names)
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


_VITLAB_GAMMA = re.compile(r"^(blocks(?:_token_only)?\.\d+)\.ls([12])\.gamma$")


def export_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vitlab keys -> timm keys: CaiT's ``ls1.gamma`` -> ``gamma_1`` (timm's ViT keeps ``ls1.gamma``)."""
    if type(model).__name__ != "Cait":
        return dict(state)
    return {_VITLAB_GAMMA.sub(r"\1.gamma_\2", k): v for k, v in state.items()}


# timm's class per vitlab class (and the arguments timm's class takes that vitlab's does too)
_VIT_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "mlp_ratio", "qkv_bias", "init_values", "class_token", "pos_embed", "no_embed_class", "reg_tokens",
             "fc_norm", "dynamic_img_size", "act_layer", "drop_rate", "pos_drop_rate", "proj_drop_rate",
             "attn_drop_rate", "drop_path_rate")
_TIMM_ARGS = {
    "VisionTransformer": _VIT_ARGS,
    "Cait": ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "mlp_ratio", "qkv_bias", "init_values", "depth_token_only", "mlp_ratio_token_only", "drop_rate",
             "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"),
    "ConVit": ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
               "mlp_ratio", "qkv_bias", "local_up_to_layer", "locality_strength", "use_pos_embed", "drop_rate",
               "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"),
    "ResNet": ("layers", "num_classes", "in_chans", "drop_rate"),
}
# vitlab arguments timm's class lacks, with the one value timm's model behaves as
_FIXED = {
    "VisionTransformer": {"norm_eps": 1e-6},
    "Cait": {"norm_eps": 1e-6, "act_layer": "gelu", "dynamic_img_size": False},
    "ConVit": {"norm_eps": 1e-6, "dynamic_img_size": False},
    "ResNet": {"stem": "imagenet", "widths": [64, 128, 256, 512]},
}
# a timm name of the same family: its defaults are all overridden by model_args
_BASE_ARCH = {"VisionTransformer": "vit_tiny_patch16_224", "distilled": "deit_tiny_distilled_patch16_224",
              "Cait": "cait_xxs24_224", "ConVit": "convit_tiny", "ResNet": "resnet18"}
# registered vitlab names that are timm's names for the same architecture
TIMM_NAMES = frozenset(
    [f"cait_{n}" for n in ("s24_224", "s24_384", "s36_384", "xs24_384", "xxs24_224", "xxs24_384", "xxs36_224",
                           "xxs36_384")]
    + [f"convit_{n}" for n in ("tiny", "small", "base")]
    + [f"deit_{s}{d}_patch16_224" for s in ("tiny", "small", "base") for d in ("", "_distilled")]
    + ["resnet18", "resnet34"]
    + [f"vit_{s}_patch{p}_{i}" for s in ("small", "base", "large") for p in (16, 32) for i in (224, 384)]
    + ["vit_tiny_patch16_224", "vit_tiny_patch16_384"])


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def export_config(model: nn.Module, args: dict[str, Any]) -> dict[str, Any]:
    """timm's config.json for a vitlab model whose complete arguments are ``args``.

    Raises ValueError naming what timm cannot express (the hybrid ViT, a CIFAR-stem ResNet, ...).
    """
    cls = type(model).__name__
    if cls not in _TIMM_ARGS:
        what = ("timm has no hybrid ViT on a ResNet-18-style backbone (its hybrids use ResNetV2 stems)"
                if cls == "HybridVisionTransformer" else f"timm has no {cls}")
        raise ValueError(f"{what}; export this model with --to onnx")
    kind = "distilled" if cls == "VisionTransformer" and args.get("distilled") else cls
    args = {k: _plain(v) for k, v in args.items() if k != "distilled"}
    if cls == "VisionTransformer" and args.get("pos_embed") == "sincos":
        args["pos_embed"] = "learn"  # the fixed table is exported as the values of a learned one
    if cls == "ResNet":
        args.pop("img_size", None)  # fully convolutional: timm takes any size
    fixed = _FIXED[cls]
    unsupported = [f"{k}={args[k]!r} (timm's is {v!r})" for k, v in fixed.items() if k in args and args[k] != v]
    unknown = [k for k in args if k not in fixed and k not in _TIMM_ARGS[cls]]
    if unsupported or unknown:
        raise ValueError(f"timm's {cls} cannot express {', '.join(unsupported + unknown)}; "
                         "export this model with --to onnx")
    model_args = {k: v for k, v in args.items() if k in _TIMM_ARGS[cls]}
    arch = getattr(model, "arch", None)
    arch = arch if arch in TIMM_NAMES else _BASE_ARCH[kind]
    pre = dict(getattr(model, "pretrained_cfg", {}) or {})
    in_chans = model_args.get("in_chans", 3)
    if cls == "ResNet":
        input_size = [in_chans, *(pre.get("input_size") or (in_chans, 224, 224))[1:]]
    else:
        input_size = [in_chans, *model.patch_embed.img_size]
    classifier = {"distilled": ["head", "head_dist"], "ResNet": "fc"}.get(kind, "head")
    pretrained_cfg = {
        "custom_load": False, "input_size": input_size,
        "fixed_input_size": cls != "ResNet" and not model_args.get("dynamic_img_size", False),
        "interpolation": pre.get("interpolation", "bicubic"), "crop_pct": pre.get("crop_pct", 1.0),
        "crop_mode": "center", "mean": list(pre.get("mean", (0.5,) * in_chans)),
        "std": list(pre.get("std", (0.5,) * in_chans)), "num_classes": model.num_classes, "pool_size": None,
        "first_conv": "conv1" if cls == "ResNet" else "patch_embed.proj", "classifier": classifier,
    }
    cfg: dict[str, Any] = {"architecture": arch, "num_classes": model.num_classes,
                           "num_features": model.num_features}
    if isinstance(getattr(model, "global_pool", None), str) and model.global_pool:
        cfg["global_pool"] = model.global_pool
    if pre.get("label_names"):
        cfg["label_names"] = list(pre["label_names"])
    cfg["model_args"] = model_args
    cfg["pretrained_cfg"] = pretrained_cfg
    return cfg
