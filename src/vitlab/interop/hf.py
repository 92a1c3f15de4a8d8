"""Hugging Face transformers ViT and DeiT folders: config.json with ``model_type``, the Hub's key names."""
from __future__ import annotations

import re
from typing import Any

import torch

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


def model_args(cfg: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(vitlab class name, arguments, preprocessing) from a transformers ViT/DeiT config.json."""
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
        preprocess["label_names"] = [id2label.get(str(i), id2label.get(i, str(i))) for i in range(num_classes)]
    return "VisionTransformer", args, preprocess


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
