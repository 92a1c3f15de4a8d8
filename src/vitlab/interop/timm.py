"""timm Hub folders (``save_for_hf``): config.json with ``architecture`` and ``model_args``, timm's keys.

Both ways: ``model_args``/``convert_state_dict`` read timm's folders, ``export_config``/``export_state_dict``
write them for every family timm has (ViT, DeiT, CaiT, ConViT, ResNet with the ImageNet stem).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..data.views import Preprocess
from ..errors import VitlabError
from ..models.base import make_pretrained_cfg
from ..models.registry import accepted_args, get_spec, list_models

TIMM_CROP_PCT = 0.875  # timm's DEFAULT_CROP_PCT, for a pretrained_cfg without crop_pct


def is_timm_config(cfg: dict[str, Any]) -> bool:
    return "architecture" in cfg and cfg.get("library") != "vitlab"


# timm names of models vitlab does not compute, and the piece each lacks (first match wins)
MISSING_PIECES = (
    (r"^beit3_", "BEiT-3's extra LayerNorms inside attention and MLP (scale_attn_norm, scale_mlp_norm)"),
    (r"^beit", "BEiT's relative position bias (timm's Beit class)"),
    (r"^eva02_", "EVA02's rotary position embedding, SwiGLU MLP and sub-LayerNorm (timm's Eva class)"),
    (r"^eva_giant", "EVA's attention with separate q and v biases (timm's Eva class)"),
    (r"_rope_", "rotary position embedding (timm's Eva class: RoPE ViT)"),
    (r"_s?relpos_", "relative position bias (timm's VisionTransformerRelPos)"),
    (r"_dpwee_", "differential attention in ViT-22B's parallel block (timm's DiffParallelScalingBlock)"),
    (r"_rpn_", "residual post-norm blocks (timm's ResPostBlock)"),
    (r"_(dwee|dlittle)_", "differential attention (timm's DiffAttention)"),
    (r"_resnet\d+d_", "a ViT on timm's ResNet-D backbone"),
    (r"_mci_", "MobileCLIP's convolutional stem (timm's ConvStem)"),
    (r"_patch14_siglip(_gap)?_384$", "an input size not divisible by the patch: 384 over 14-pixel patches (timm crops "
                                     "to 378; load the _378 name)"),
)


def missing_piece(name: str) -> str:
    """What vitlab lacks to compute the timm model ``name`` ('' when the name says nothing vitlab knows of)."""
    return next((piece for pattern, piece in MISSING_PIECES if re.search(pattern, name)), "")


# transformers' wrappers of a timm model (model_type timm_wrapper, weights under timm_model.) -> whether it has a head
WRAPPER_HEADS = {"TimmWrapperModel": False, "TimmWrapperForImageClassification": True}


def unwrapped(cfg: dict[str, Any]) -> dict[str, Any]:
    """The timm config inside transformers' TimmWrapper config.json: TimmWrapperModel builds the timm model without
    its head (num_classes=0) whatever num_classes and label_names say."""
    arch = (cfg.get("architectures") or ["TimmWrapperModel"])[0]
    if arch not in WRAPPER_HEADS:
        raise VitlabError(f"Hugging Face architecture {arch!r} is not supported for model_type 'timm_wrapper'; "
                          f"accepted: {', '.join(WRAPPER_HEADS)}")
    if WRAPPER_HEADS[arch]:
        return cfg
    pre = {k: v for k, v in (cfg.get("pretrained_cfg") or {}).items() if k != "label_names"}
    return {**cfg, "num_classes": 0, "label_names": None, "pretrained_cfg": pre}


def model_args(cfg: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(vitlab name, its arguments, preprocessing) from a timm config.json, or transformers' wrapper of one."""
    if cfg.get("model_type") == "timm_wrapper":
        cfg = unwrapped(cfg)
    name = cfg["architecture"]
    if name not in list_models(name):
        piece = missing_piece(name)
        what = f": vitlab lacks {piece}" if piece else " is not one vitlab implements"
        families = sorted({n.split("_")[0] for n in list_models()})
        raise VitlabError(f"timm architecture {name!r}{what}; it reads timm's {', '.join(families)} names "
                          "(`vitlab models` lists them)")
    args = {k: v for k, v in (cfg.get("model_args") or {}).items() if v is not None}  # timm: None is the default
    for key in ("num_classes", "global_pool"):
        if key in cfg and key not in args:
            args[key] = cfg[key]
    pre = cfg.get("pretrained_cfg") or {}
    spec = get_spec(name)
    accepted = accepted_args(spec.cls)
    if "global_pool" not in accepted and args.get("global_pool") == "avg":
        del args["global_pool"]  # a ResNet's only pooling, which timm writes out
    size = pre.get("input_size")
    if "img_size" not in args and "img_size" in accepted and pre.get("fixed_input_size") and size:
        args["img_size"] = tuple(size[-2:])  # timm builds at the checkpoint's size (older exports say it only here)
    # what timm's resolve_data_config reads, with timm's defaults where the config has none
    preprocess = {"crop_mode": "center", "crop_pct": TIMM_CROP_PCT, "interpolation": "bicubic",
                  **{k: pre[k] for k in ("mean", "std", "input_size", "interpolation", "crop_pct", "crop_mode")
                     if pre.get(k)}}
    names = cfg.get("label_names") or pre.get("label_names")  # save_for_hf writes them at the top level
    if isinstance(names, dict):
        names = [names.get(str(i), names.get(i, str(i))) for i in range(len(names))]
    if names:  # one per class, as text: checked when the model is loaded (checkpoint.check_preprocess)
        preprocess["label_names"] = list(names) if isinstance(names, (list, tuple)) else names
    return name, args, preprocess


_CAIT_GAMMA = re.compile(r"^(blocks(?:_token_only)?\.\d+)\.gamma_([12])$")


def convert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm keys -> vitlab keys: identical but for CaiT's and BEiT's LayerScale (``gamma_1`` -> ``ls1.gamma``);
    the prefixes of a DataParallel (``module.``), of transformers' TimmWrapper (``timm_model.``) and of a trunk timm
    nests under its classifier (``encoder.``: Qwen3's, Gemma 4's and DeepSeek's; no other family vitlab reads has keys
    under it) go."""
    out = {}
    for k, v in state.items():
        k = k.removeprefix("module.").removeprefix("timm_model.").removeprefix("encoder.")
        if k.endswith((".relative_position_index", ".k_bias")):  # buffers older timm checkpoints hold (BEiT)
            continue
        k = _CAIT_GAMMA.sub(r"\1.ls\2.gamma", k)
        out[k] = v
    return out


_VITLAB_GAMMA = re.compile(r"^(blocks(?:_token_only)?\.\d+)\.ls([12])\.gamma$")


def export_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vitlab keys -> timm keys: CaiT's and BEiT's ``ls1.gamma`` -> ``gamma_1`` (timm's ViT keeps ``ls1.gamma``); the
    trunk under its prefix where timm nests it (the classifiers' tensors stay outside)."""
    spec = model.timm_spec
    if spec.trunk_prefix:
        heads = tuple(f"{name}." for name in model.classifier_names)
        return {k if k.startswith(heads) else spec.trunk_prefix + k: v for k, v in state.items()}
    if not spec.layer_scale_as_gamma:
        return dict(state)
    return {_VITLAB_GAMMA.sub(r"\1.gamma_\2", k): v for k, v in state.items()}


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _timm_model_args(model: nn.Module, args: dict[str, Any]) -> dict[str, Any]:
    """The model_args timm's class takes for ``args``; ValueError naming what it cannot express."""
    spec = model.timm_spec
    if spec is None:
        raise VitlabError(f"{model.no_timm}; export this model with --to onnx")
    args = {k: _plain(spec.values[k].get(v, v) if k in spec.values else v)
            for k, v in args.items() if k not in spec.dropped}
    unsupported = [f"{k}={args[k]!r} (timm's is {v!r})" for k, v in spec.fixed.items() if k in args and args[k] != v]
    unknown = [k for k in args if k not in spec.fixed and k not in spec.args]
    if unsupported or unknown:
        raise VitlabError(f"timm's {spec.cls} cannot express {', '.join(unsupported + unknown)}; "
                          "export this model with --to onnx")
    return {k: v for k, v in args.items() if k in spec.args}


def export_config(model: nn.Module, args: dict[str, Any]) -> dict[str, Any]:
    """timm's config.json for a vitlab model whose complete arguments are ``args``.

    Raises ValueError naming what timm cannot express (the hybrid ViT, a CIFAR-stem ResNet, ...).
    """
    model_args = _timm_model_args(model, args)
    arch = getattr(model, "arch", None)
    arch = arch if arch in model.timm_names else model.timm_spec.base_arch
    own = make_pretrained_cfg(model, model_args.get("in_chans", 3))  # the model's input size; defaults
    pre = {**own, **(getattr(model, "pretrained_cfg", None) or {}), "input_size": own["input_size"]}
    prep = Preprocess.from_cfg(pre)  # what vitlab applies, in the keys timm's eval transform reads
    fixed_size = (hasattr(model, "patch_embed") and not model_args.get("dynamic_img_size", False)  # CNNs: any size
                  and not getattr(model, "any_input_size", False))  # nor a NaFlex ViT (timm's traits say so too)
    classifier = list(model.classifier_names)
    pretrained_cfg = {
        "custom_load": False, "input_size": list(own["input_size"]), "fixed_input_size": fixed_size,
        "interpolation": prep.interpolation, "crop_pct": prep.crop_pct, "crop_mode": prep.crop_mode,
        "mean": list(prep.mean), "std": list(prep.std),
        "num_classes": model.num_classes, "pool_size": None,
        "first_conv": next(n for n, m in model.named_modules()  # a NaFlex ViT's is its linear patch projection
                           if isinstance(m, nn.Conv2d) or m is getattr(getattr(model, "patch_embed", None), "proj", 0)),
        "classifier": classifier if len(classifier) > 1 else classifier[0],
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
