"""transformers' BEiT and data2vec-vision folders (``BeitModel``, ``BeitForImageClassification``,
``Data2VecVisionModel``, ``Data2VecVisionForImageClassification``): config and key names both ways.

Two generations of key names are read: the Hub's (``beit.encoder.layer.0.attention.attention.query.weight``,
``lambda_1``, which data2vec-vision still writes) and those transformers 5 writes for BEiT
(``beit.layers.0.attention.q_proj.weight``). Folders are written in the names transformers writes today.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import VitlabError
from .keys import check_placed, join_qkv

# model_type -> (architectures -> whether they carry a classifier, the weights' prefix)
MODEL_TYPES = {
    "beit": ({"BeitModel": False, "BeitForImageClassification": True}, "beit"),
    "data2vec-vision": ({"Data2VecVisionModel": False, "Data2VecVisionForImageClassification": True},
                        "data2vec_vision"),
}

_LAYER = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)$")
_LAYER_KEYS = {  # below a layer, both generations -> vitlab's names below blocks.i
    "layernorm_before": "norm1", "layernorm_after": "norm2",
    "attention.output.dense": "attn.proj", "attention.o_proj": "attn.proj",
    "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
_QKV = {"attention.attention.query": 0, "attention.attention.key": 1, "attention.attention.value": 2,
        "attention.q_proj": 0, "attention.k_proj": 1, "attention.v_proj": 2}
_TABLES = ("attention.attention.relative_position_bias.relative_position_bias_table",
           "relative_position_bias.relative_position_bias_table")
_TOP_KEYS = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "encoder.relative_position_bias.relative_position_bias_table": "rel_pos_bias.relative_position_bias_table",
    "shared_position_bias.relative_position_bias_table": "rel_pos_bias.relative_position_bias_table",
    "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
    "pooler.layernorm.weight": "fc_norm.weight", "pooler.layernorm.bias": "fc_norm.bias",
    "classifier.weight": "head.weight", "classifier.bias": "head.bias",
}
IGNORED = ("embeddings.mask_token", ".relative_position_index")


def model_args(cfg: dict[str, Any], arch: str, common: dict[str, Any]) -> dict[str, Any]:
    """Beit's arguments from a BEiT or data2vec-vision config.json (``common``: what every ViT config says)."""
    archs, _ = MODEL_TYPES[cfg["model_type"]]
    mean_pooling = bool(cfg.get("use_mean_pooling", True))
    scale = float(cfg.get("layer_scale_init_value", 0.1) or 0.0)
    args = {k: v for k, v in common.items() if k not in ("pos_drop_rate",)}
    args.update(
        num_classes=common["num_classes"] if archs[arch] else 0,
        init_values=scale if scale > 0 else None,
        use_abs_pos_emb=bool(cfg.get("use_absolute_position_embeddings", False)),
        use_rel_pos_bias=bool(cfg.get("use_relative_position_bias", False)),
        use_shared_rel_pos_bias=bool(cfg.get("use_shared_relative_position_bias", False)),
        global_pool="avg" if mean_pooling else "token", use_fc_norm=mean_pooling,
        drop_path_rate=float(cfg.get("drop_path_rate", 0.0) or 0.0),
    )
    return args


def _layer_key(i: int, sub: str, v: torch.Tensor, out: dict, qkv: dict) -> bool:
    """Place a tensor below ``layer(s).i``; False where it has no place."""
    mod, _, param = sub.rpartition(".")
    if mod in _QKV:
        if param == "weight":
            qkv.setdefault((i, "weight"), {})[_QKV[mod]] = v
        elif _QKV[mod] != 1:  # BEiT's key projection has no bias
            out[f"blocks.{i}.attn.{'q' if _QKV[mod] == 0 else 'v'}_bias"] = v
        else:
            return False
    elif mod in _LAYER_KEYS:
        out[f"blocks.{i}.{_LAYER_KEYS[mod]}.{param}"] = v
    elif sub in ("lambda_1", "lambda_2"):
        out[f"blocks.{i}.ls{sub[-1]}.gamma"] = v
    elif sub in _TABLES:
        out[f"blocks.{i}.attn.relative_position_bias_table"] = v
    else:
        return False
    return True


def convert_state_dict(state: dict[str, torch.Tensor], model_type: str,
                       mean_pooling: bool = True) -> dict[str, torch.Tensor]:
    """The Hub's key names (either generation) -> vitlab's; query/key/value weights concatenated into qkv."""
    prefix = MODEL_TYPES[model_type][1] + "."
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown = []
    for key, v in state.items():
        k = key.removeprefix(prefix)
        if k.startswith(IGNORED) or k.endswith(IGNORED):
            continue
        m = _LAYER.match(k)
        placed = _layer_key(int(m.group(1)), m.group(2), v, out, qkv) if m else k in _TOP_KEYS
        if m is None and placed:
            out[_TOP_KEYS[k]] = v
        if not placed:
            unknown.append(key)
    join_qkv(out, qkv)
    check_placed(unknown, model_type)
    if mean_pooling and "fc_norm.weight" not in out and "cls_token" in out:
        # a model saved without its pooler (Data2VecVisionModel's default): its tokens are the output, and the
        # mean token goes through a LayerNorm without a learned scale or shift
        dim = out["cls_token"].shape[-1]
        out["fc_norm.weight"], out["fc_norm.bias"] = torch.ones(dim), torch.zeros(dim)
    return out


def export_config(model: torch.nn.Module, a: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """transformers' BeitForImageClassification config.json for a vitlab Beit (``common``: the ViT keys)."""
    missing = [name for name, on in (("qkv_bias=False", not a.get("qkv_bias", True)),
                                     ("global_pool='avg' without fc_norm",
                                      a.get("global_pool") == "avg" and a.get("use_fc_norm") is False),
                                     ("global_pool='token' with fc_norm",
                                      a.get("global_pool") == "token" and a.get("use_fc_norm")),
                                     ("global_pool=''", a.get("global_pool") == "")) if on]
    if missing:
        raise VitlabError(f"transformers' BEiT cannot express {', '.join(missing)}; export with --to timm or onnx")
    return {**common, "architectures": ["BeitForImageClassification"], "model_type": "beit",
            "layer_scale_init_value": float(a.get("init_values") or 0.0),
            "use_absolute_position_embeddings": bool(a.get("use_abs_pos_emb", True)),
            "use_relative_position_bias": bool(a.get("use_rel_pos_bias", False)),
            "use_shared_relative_position_bias": bool(a.get("use_shared_rel_pos_bias", False)),
            "use_mean_pooling": a.get("global_pool", "avg") == "avg", "use_mask_token": False}


_TO_HF_LAYER = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.proj": "attention.o_proj",
                "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_TO_HF_TOP = {v: k for k, v in _TOP_KEYS.items() if not k.startswith("encoder.")}


def export_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vitlab keys -> the names transformers 5 writes for BeitForImageClassification (``beit.layers.i...``)."""
    out: dict[str, torch.Tensor] = {}
    for key, v in state.items():
        if key in _TO_HF_TOP:
            name = _TO_HF_TOP[key]
            out[name if name.startswith("classifier") else f"beit.{name}"] = v
            continue
        _, i, sub = key.split(".", 2)
        base = f"beit.layers.{i}"
        mod, _, param = sub.rpartition(".")
        if sub == "attn.qkv.weight":
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                out[f"{base}.attention.{name}.weight"] = part.contiguous()
        elif sub in ("attn.q_bias", "attn.v_bias"):
            out[f"{base}.attention.{sub[5]}_proj.bias"] = v
        elif mod in ("ls1", "ls2"):
            out[f"{base}.lambda_{mod[-1]}"] = v
        elif sub == "attn.relative_position_bias_table":
            out[f"{base}.relative_position_bias.relative_position_bias_table"] = v
        else:
            out[f"{base}.{_TO_HF_LAYER[mod]}.{param}"] = v
    return out
