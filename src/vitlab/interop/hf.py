"""Hugging Face transformers ViT and DeiT folders: config.json with ``model_type``, the Hub's key names."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..models.vit import VisionTransformer

# transformers' hidden_act -> vitlab act_layer
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "relu": "relu", "silu": "silu", "swish": "silu", "quick_gelu": "quick_gelu"}
HF_MODEL_TYPES = ("vit", "deit")
# architectures -> (dist token role, heads)
HF_ARCHITECTURES = {
    "ViTForImageClassification": "vit",
    "ViTModel": "base",
    "DeiTForImageClassificationWithTeacher": "distilled",
    "DeiTForImageClassification": "deit",
    "DeiTModel": "base",
}


def is_hf_config(cfg: dict[str, Any]) -> bool:
    return "model_type" in cfg


def _get(cfg: dict[str, Any], key: str, default: Any) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def model_args(cfg: dict[str, Any]) -> tuple[type[VisionTransformer], dict[str, Any], dict[str, Any]]:
    """(vitlab class, arguments, preprocessing) from a transformers ViT/DeiT config.json."""
    model_type = cfg["model_type"]
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"Hugging Face model_type {model_type!r} is not supported; "
                         f"accepted: {', '.join(HF_MODEL_TYPES)}")
    arch = (cfg.get("architectures") or ["ViTForImageClassification" if model_type == "vit"
                                         else "DeiTForImageClassificationWithTeacher"])[0]
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"Hugging Face architecture {arch!r} is not supported; "
                         f"accepted: {', '.join(HF_ARCHITECTURES)}")
    role = HF_ARCHITECTURES[arch]
    act = _get(cfg, "hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; accepted: {', '.join(HF_ACTIVATIONS)}")
    dim = int(cfg["hidden_size"])
    id2label = cfg.get("id2label") or {}
    num_classes = 0 if role == "base" else int(cfg.get("num_labels") or len(id2label) or 2)
    img, patch = _get(cfg, "image_size", 224), _get(cfg, "patch_size", 16)
    args = dict(
        img_size=tuple(img) if isinstance(img, (list, tuple)) else int(img),
        patch_size=tuple(patch) if isinstance(patch, (list, tuple)) else int(patch),
        in_chans=int(_get(cfg, "num_channels", 3)),
        num_classes=num_classes,
        embed_dim=dim,
        depth=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        mlp_ratio=int(_get(cfg, "intermediate_size", 4 * dim)) / dim,
        qkv_bias=bool(_get(cfg, "qkv_bias", True)),
        act_layer=HF_ACTIVATIONS[act],
        norm_eps=float(_get(cfg, "layer_norm_eps", 1e-12)),
        pos_drop_rate=float(_get(cfg, "hidden_dropout_prob", 0.0)),
        proj_drop_rate=float(_get(cfg, "hidden_dropout_prob", 0.0)),
        attn_drop_rate=float(_get(cfg, "attention_probs_dropout_prob", 0.0)),
        distilled=role == "distilled",
        reg_tokens=1 if (model_type == "deit" and role != "distilled") else 0,
    )
    preprocess: dict[str, Any] = {}
    if id2label and num_classes:
        names = [str(id2label.get(str(i), id2label.get(i, i))) for i in range(num_classes)]
        if names != default_labels(num_classes):  # transformers' placeholders are no names
            preprocess["label_names"] = names
    return VisionTransformer, args, preprocess


def default_labels(num_classes: int) -> list[str]:
    """The names transformers gives classes that have none: LABEL_0, LABEL_1, ..."""
    return [f"LABEL_{i}" for i in range(num_classes)]


# PIL's resampling codes, as image processors store them -> timm's interpolation names
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
PREPROCESSOR = "preprocessor_config.json"


def _side(size: Any) -> int | None:
    if isinstance(size, dict):
        size = size.get("height", size.get("shortest_edge"))
    return int(size) if isinstance(size, (int, float)) else None


def preprocessing(folder: Path) -> dict[str, Any]:
    """mean, std, interpolation and crop_pct from a folder's preprocessor_config.json (empty when it has none)."""
    path = Path(folder) / PREPROCESSOR
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    out: dict[str, Any] = {}
    if cfg.get("do_normalize", True) and cfg.get("image_mean") is not None and cfg.get("image_std") is not None:
        out["mean"], out["std"] = tuple(cfg["image_mean"]), tuple(cfg["image_std"])
    if cfg.get("resample") in PIL_RESAMPLE:
        out["interpolation"] = PIL_RESAMPLE[cfg["resample"]]
    resize, crop = _side(cfg.get("size")), _side(cfg.get("crop_size"))
    if cfg.get("do_center_crop") and resize and crop:
        out["crop_pct"] = crop / resize
    elif resize:
        out["crop_pct"] = 1.0
    return out


def image_processor(model_cfg: dict[str, Any]) -> dict[str, Any]:
    """A ViTImageProcessor preprocessor_config.json for a model's input size, mean, std and interpolation."""
    _, h, w = model_cfg["input_size"]
    resample = {v: k for k, v in PIL_RESAMPLE.items()}.get(model_cfg.get("interpolation", "bicubic"), 3)
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": h, "width": w},
            "resample": resample, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(model_cfg["mean"]), "image_std": list(model_cfg["std"])}


_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_LAYER_KEYS = {
    "attention.output.dense": "attn.proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
}
_TOP_KEYS = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}
_HEADS = {"classifier": "head", "cls_classifier": "head", "distillation_classifier": "head_dist"}
IGNORED_PREFIXES = ("pooler.",)  # ViTModel's tanh pooler: not part of the classifier's computation


def convert_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Hub's key names -> vitlab's; query/key/value are concatenated into qkv."""
    distilled = HF_ARCHITECTURES.get((cfg.get("architectures") or [""])[0]) == "distilled"
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, v in state.items():
        head, _, rest = key.partition(".")
        if head in _HEADS and rest in ("weight", "bias"):
            out[f"{_HEADS[head]}.{rest}"] = v
            continue
        k = rest if head in ("vit", "deit") else key
        if k.startswith(IGNORED_PREFIXES):
            continue
        if k == "embeddings.distillation_token":
            out["dist_token" if distilled else "reg_token"] = v
        elif k in _TOP_KEYS:
            out[_TOP_KEYS[k]] = v
        elif m := _LAYER.match(k):
            i, sub = int(m.group(1)), m.group(2)
            if sub.startswith("attention.attention."):
                which, param = sub[len("attention.attention."):].split(".")
                qkv.setdefault((i, param), {})[which] = v
            else:
                mod, _, param = sub.rpartition(".")
                if mod not in _LAYER_KEYS:
                    unknown.append(key)
                    continue
                out[f"blocks.{i}.{_LAYER_KEYS[mod]}.{param}"] = v
        else:
            unknown.append(key)
    for (i, param), parts in qkv.items():
        missing = [p for p in ("query", "key", "value") if p not in parts]
        if missing:
            raise ValueError(f"layer {i} attention {param} lacks {', '.join(missing)}")
        out[f"blocks.{i}.attn.qkv.{param}"] = torch.cat([parts["query"], parts["key"], parts["value"]], dim=0)
    if unknown:
        raise ValueError(f"tensors with no place in a ViT/DeiT: {', '.join(unknown[:8])}"
                         + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    return out


# --- writing: a vitlab ViT/DeiT as a transformers folder --------------------------------------------------------

_HF_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu",
                 "quick_gelu": "quick_gelu"}
_TO_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_TO_HF_TOP = {v: k for k, v in _TOP_KEYS.items()}


def _size(v: Any) -> int | list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [int(v), int(v)]
    return int(v[0]) if v[0] == v[1] else [int(x) for x in v]


def export_config(model: torch.nn.Module, args: dict[str, Any]) -> dict[str, Any]:
    """transformers' config.json (ViTForImageClassification or DeiTForImageClassificationWithTeacher).

    Raises ValueError naming what transformers' ViT/DeiT cannot express.
    """
    if model.hf_model_type is None:
        other = "--to onnx" if model.timm_spec is None else "--to timm or --to onnx"
        raise ValueError(f"transformers' ViT and DeiT classes cannot express {model.no_hf}; export it with {other}")
    a = {"class_token": True, "reg_tokens": 0, "no_embed_class": False, "pos_embed": "learn", "init_values": None,
         "global_pool": "token", "fc_norm": None, "act_layer": "gelu", "mlp_ratio": 4.0, "qkv_bias": True,
         "norm_eps": 1e-6, "in_chans": 3, "distilled": False, **args}
    missing = []
    if not a["class_token"] or a["global_pool"] != "token":
        missing.append("pooling other than the class token")
    if a["reg_tokens"]:
        missing.append("register tokens")
    if a["no_embed_class"]:
        missing.append("no_embed_class")
    if a["pos_embed"] == "none":
        missing.append("a model without position embedding")
    if a["init_values"]:
        missing.append("LayerScale (init_values)")
    if a["fc_norm"]:
        missing.append("fc_norm")
    if a["act_layer"] not in _HF_ACT_NAMES:
        missing.append(f"act_layer {a['act_layer']!r}")
    if model.num_classes <= 0:
        missing.append("a model without a classifier head (num_classes=0)")
    dim = model.embed_dim
    hidden = a["mlp_ratio"] * dim
    if hidden != int(hidden):
        missing.append(f"an MLP width of {hidden:g} (mlp_ratio x embed_dim must be whole)")
    if missing:
        raise ValueError(f"transformers' ViT/DeiT cannot express {', '.join(missing)}; export with --to timm or onnx")
    distilled = model.hf_model_type == "deit"
    names = list((getattr(model, "pretrained_cfg", {}) or {}).get("label_names") or default_labels(model.num_classes))
    drop = float(a.get("proj_drop_rate", 0.0))
    return {
        "architectures": ["DeiTForImageClassificationWithTeacher" if distilled else "ViTForImageClassification"],
        "model_type": model.hf_model_type,
        "hidden_size": dim,
        "num_hidden_layers": len(model.blocks),
        "num_attention_heads": model.blocks[0].attn.num_heads,
        "intermediate_size": int(hidden),
        "hidden_act": _HF_ACT_NAMES[a["act_layer"]],
        "hidden_dropout_prob": drop,
        "attention_probs_dropout_prob": float(a.get("attn_drop_rate", 0.0)),
        "initializer_range": 0.02,
        "layer_norm_eps": float(a["norm_eps"]),
        "image_size": _size(model.patch_embed.img_size),
        "patch_size": _size(model.patch_embed.patch_size),
        "num_channels": int(a["in_chans"]),
        "qkv_bias": bool(a["qkv_bias"]),
        "encoder_stride": int(model.patch_embed.patch_size[0]),
        "id2label": {str(i): str(n) for i, n in enumerate(names)},
        "label2id": {str(n): i for i, n in enumerate(names)},
        "dtype": "float32",
    }


def export_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vitlab keys -> the Hub's (``vit.``/``deit.`` prefixed); qkv is split into query, key and value."""
    distilled = cfg["model_type"] == "deit"
    base = "deit" if distilled else "vit"
    heads = {"head": "cls_classifier" if distilled else "classifier", "head_dist": "distillation_classifier"}
    out: dict[str, torch.Tensor] = {}
    for key, v in state.items():
        mod, _, param = key.rpartition(".")
        if mod in heads:
            out[f"{heads[mod]}.{param}"] = v
        elif key == "dist_token":
            out[f"{base}.embeddings.distillation_token"] = v
        elif key in _TO_HF_TOP:
            out[f"{base}.{_TO_HF_TOP[key]}"] = v
        elif key.startswith("blocks."):
            _, i, sub = key.split(".", 2)
            sub_mod, _, param = sub.rpartition(".")
            prefix = f"{base}.encoder.layer.{i}"
            if sub_mod == "attn.qkv":
                for name, part in zip(("query", "key", "value"), v.chunk(3, dim=0)):
                    out[f"{prefix}.attention.attention.{name}.{param}"] = part.contiguous()
            elif sub_mod == "attn.proj":
                out[f"{prefix}.attention.output.dense.{param}"] = v
            else:
                out[f"{prefix}.{_TO_HF_LAYER[sub_mod]}.{param}"] = v
        else:
            raise ValueError(f"tensor {key!r} has no place in transformers' ViT/DeiT")
    return out
