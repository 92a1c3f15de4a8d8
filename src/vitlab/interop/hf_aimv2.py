"""transformers' AIMv2 image towers (``Aimv2VisionModel``, model_type ``aimv2_vision_model``): config and key names
both ways.

transformers' AIMv2 is timm's AIMv2 ViT: the patch tokens through an RMSNorm (``embeddings.rms_norm``: vitlab's
``patch_embed.norm``), a learned table per patch or, with ``is_native``, a sin-cos table computed for each input's
grid (columns' channels first: vitlab's ``pos_embed='sincos_xy'``), pre-norm blocks of RMSNorm, separate
``q_proj``/``k_proj``/``v_proj`` (joined into ``qkv``) and a SwiGLU (``gate_proj``, ``up_proj``, ``down_proj``:
timm's ``fc1_g``, ``fc1_x``, ``fc2``), the final RMSNorm on every token. ``use_head`` adds its attention pool
(``head.*``): a learned token attends over the tokens with its own keys and values, then ``output_proj``; that is
vitlab's ``global_pool='map'`` with ``attn_pool_kind='aimv2'``. Without it the model is pooled by the mean token.
The attention's output projection takes ``qkv_bias``, the MLP ``mlp_bias``: vitlab's ``qkv_bias`` and
``proj_bias``, which hold the output projection's and the MLP's biases together.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..errors import VitlabError
from .keys import check_placed, hf_size, join_qkv, place_layer

MODEL_TYPE = "aimv2_vision_model"
ARCHITECTURES = {"Aimv2VisionModel": "base"}
DEFAULT_EPS = 1e-5
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_LAYER_KEYS = {"rms_norm1": "norm1", "rms_norm2": "norm2", "attention.out_proj": "attn.proj",
               "ffn.gate_proj": "mlp.fc1_g", "ffn.up_proj": "mlp.fc1_x", "ffn.down_proj": "mlp.fc2"}
_QKV = {"attention.q_proj": 0, "attention.k_proj": 1, "attention.v_proj": 2}
_TOP_KEYS = {"embeddings.patch_embed.weight": "patch_embed.proj.weight",
             "embeddings.patch_embed.bias": "patch_embed.proj.bias",
             "embeddings.rms_norm.weight": "patch_embed.norm.weight", "rms_norm.weight": "norm.weight",
             "head.cls_token": "attn_pool.latent", "head.output_proj.weight": "attn_pool.proj.weight",
             "head.output_proj.bias": "attn_pool.proj.bias"}


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    return bool(default if cfg.get(key) is None else cfg[key])


def model_args(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """The ViT's arguments from an aimv2_vision_model config.json (``common``: what every ViT config says)."""
    qkv_bias, mlp_bias = _bool(cfg, "qkv_bias", False), _bool(cfg, "mlp_bias", False)
    if qkv_bias != mlp_bias:
        raise VitlabError(f"an AIMv2 with qkv_bias={str(qkv_bias).lower()} and mlp_bias={str(mlp_bias).lower()} is "
                          "not supported (vitlab's proj_bias holds the attention output's and the MLP's biases "
                          "together); accepted: both true or both false")
    if (cfg.get("hidden_act") or "silu") not in ("silu", "swish"):  # silu where the config says none
        raise VitlabError(f"an AIMv2 with hidden_act {cfg['hidden_act']!r} is not supported; accepted: silu "
                          "(its SwiGLU's activation)")
    native, head = _bool(cfg, "is_native", False), _bool(cfg, "use_head", True)
    args = {k: v for k, v in common.items() if k not in ("pos_drop_rate", "proj_drop_rate", "act_layer")}
    args.update(class_token=False, fc_norm=False, qkv_bias=qkv_bias, proj_bias=mlp_bias, norm_layer="rmsnorm",
                norm_eps=float(cfg.get("rms_norm_eps") or DEFAULT_EPS), embed_norm=True, mlp_layer="swiglu",
                act_layer="silu", pos_embed="sincos_xy" if native else "learn", dynamic_img_size=native,
                global_pool="map" if head else "avg", attn_pool_kind="aimv2")
    return args


def convert_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Hub's key names -> vitlab's; query, key and value are joined into qkv, the head's keys and values into
    ``attn_pool.kv``."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    pool: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, v in state.items():
        m = _LAYER.match(key)
        if m is None:
            if key in _TOP_KEYS:
                out[_TOP_KEYS[key]] = v
            elif key == "embeddings.position_embedding.weight":
                out["pos_embed"] = v.unsqueeze(0)
            elif (h := re.match(r"^head\.([kv])_proj\.(weight|bias)$", key)) is not None:
                pool.setdefault(h.group(2), {})[h.group(1)] = v
            elif key != "embeddings.position_ids":
                unknown.append(key)
            continue
        if not place_layer(int(m.group(1)), m.group(2), v, out, qkv, _QKV, _LAYER_KEYS):
            unknown.append(key)
    join_qkv(out, qkv)
    for param, parts in pool.items():
        if set(parts) != {"k", "v"}:
            raise VitlabError(f"the AIMv2 head's {param} lacks one of k_proj, v_proj")
        out[f"attn_pool.kv.{param}"] = torch.cat([parts["k"], parts["v"]])
    check_placed(unknown, MODEL_TYPE)
    return out


def export_config(model: nn.Module, a: dict[str, Any]) -> dict[str, Any]:
    """transformers' config.json for Aimv2VisionModel (``a``: the model's complete arguments)."""
    missing = []
    if model.num_classes > 0:
        missing.append("a classifier head (Aimv2VisionModel has none: reset_classifier(0) first)")
    head = model.global_pool == "map" and a["attn_pool_kind"] == "aimv2"
    if not head and model.global_pool != "avg":
        missing.append(f"global_pool={model.global_pool!r} (its pooling is AIMv2's attention pool or the mean token)")
    if a["qkv_bias"] != a["proj_bias"]:
        missing.append("qkv_bias other than proj_bias (its attention output projection takes qkv_bias)")
    missing += [name for name, on in (
        ("a class, distillation or register token", model.num_prefix_tokens > 0),
        ("LayerScale (init_values)", bool(a["init_values"])), ("qk_norm", a["qk_norm"]), ("pre_norm", a["pre_norm"]),
        ("final_norm=False", not a["final_norm"]), ("fc_norm", bool(a["fc_norm"])),
        (f"pos_embed={a['pos_embed']!r}", a["pos_embed"] not in ("learn", "sincos_xy")),
        ("pos_drop_rate or proj_drop_rate", bool(a["pos_drop_rate"] or a["proj_drop_rate"]))) if on]
    if missing:
        raise VitlabError(f"transformers' AIMv2 cannot express {', '.join(missing)}; export with --to timm or onnx")
    embed = model.patch_embed
    return {
        "architectures": ["Aimv2VisionModel"], "model_type": MODEL_TYPE,
        "hidden_size": model.embed_dim, "num_hidden_layers": len(model.blocks),
        "num_attention_heads": model.blocks[0].attn.num_heads,
        "intermediate_size": model.blocks[0].mlp.fc2.in_features, "hidden_act": "silu",
        "attention_dropout": float(a["attn_drop_rate"]), "rms_norm_eps": float(a["norm_eps"]),
        "qkv_bias": bool(a["qkv_bias"]), "mlp_bias": bool(a["proj_bias"]), "initializer_range": 0.02,
        "image_size": hf_size(embed.img_size), "patch_size": hf_size(embed.patch_size),
        "num_channels": int(a["in_chans"]), "use_head": head, "is_native": a["pos_embed"] == "sincos_xy",
        "dtype": "float32",
    }


_TO_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_TO_HF_TOP = {v: k for k, v in _TOP_KEYS.items()}


def export_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vitlab keys -> the Hub's; qkv is split into q_proj, k_proj and v_proj, the head's kv into k_proj and v_proj."""
    out: dict[str, torch.Tensor] = {}
    for key, v in state.items():
        if key in _TO_HF_TOP:
            out[_TO_HF_TOP[key]] = v
        elif key == "pos_embed":
            out["embeddings.position_embedding.weight"] = v[0]
        elif key.startswith("attn_pool.kv."):
            param = key.rsplit(".", 1)[1]
            out[f"head.k_proj.{param}"], out[f"head.v_proj.{param}"] = (p.contiguous() for p in v.chunk(2))
        elif key.startswith("blocks."):
            _, i, sub = key.split(".", 2)
            mod, _, param = sub.rpartition(".")
            if mod == "attn.qkv":
                for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                    out[f"encoder.layers.{i}.attention.{name}.{param}"] = part.contiguous()
            else:
                out[f"encoder.layers.{i}.{_TO_HF_LAYER[mod]}.{param}"] = v
        else:
            raise VitlabError(f"tensor {key!r} has no place in transformers' AIMv2")
    return out
