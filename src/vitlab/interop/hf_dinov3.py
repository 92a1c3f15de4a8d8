"""transformers' DINOv3 ViT folders (``DINOv3ViTModel``, model_type ``dinov3_vit``): config and key names both ways.

transformers' DINOv3 is timm's Eva with DINOv3's RoPE (``rope_type='dinov3'``, half layout): the class token, then
the register tokens, then the patches; separate ``q_proj``/``k_proj``/``v_proj`` (joined into vitlab's ``qkv``),
LayerScale ``lambda1``, a plain MLP (``up_proj``, ``down_proj``) or a gated one (``gate_proj``, ``up_proj``,
``down_proj``: timm's SwiGLU ``fc1_g``, ``fc1_x``, ``fc2``), and the final LayerNorm on every token. The model has
no classifier: its pooled output is the class token after that norm. ``pos_embed_shift``, ``_jitter`` and
``_rescale`` (2.0 unless the config says otherwise) change the rotary coordinates in training, as timm's
``rope_{shift,jitter,rescale}_coords``.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..errors import VitlabError
from .keys import check_placed, hf_size, join_qkv

MODEL_TYPE = "dinov3_vit"
ARCHITECTURES = {"DINOv3ViTModel": "base"}
DEFAULT_EPS = 1e-5
_BIAS_LAYOUTS = {(True, False, True): dict(qkv_bias=True, attn_type="eva"),  # q_bias, v_bias (DINOv3's own)
                 (False, False, False): dict(qkv_bias=False, attn_type="eva"),
                 (True, True, True): dict(qkv_bias=True, attn_type="rope")}  # one qkv.bias
_LAYER = re.compile(r"^(?:model\.)?layer\.(\d+)\.(.+)$")  # as saved, and as the module holds it
_LAYER_KEYS = {"norm1": "norm1", "norm2": "norm2", "attention.o_proj": "attn.proj", "layer_scale1": "ls1",
               "layer_scale2": "ls2", "mlp.down_proj": "mlp.fc2", "mlp.gate_proj": "mlp.fc1_g"}
_QKV = {"attention.q_proj": 0, "attention.k_proj": 1, "attention.v_proj": 2}
_TOP_KEYS = {"embeddings.cls_token": "cls_token", "embeddings.register_tokens": "reg_token",
             "embeddings.patch_embeddings.weight": "patch_embed.proj.weight",
             "embeddings.patch_embeddings.bias": "patch_embed.proj.bias", "norm.weight": "norm.weight",
             "norm.bias": "norm.bias"}


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    return bool(default if cfg.get(key) is None else cfg[key])


def model_args(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """Eva's arguments from a dinov3_vit config.json (``common``: what every ViT config says)."""
    biases = tuple(_bool(cfg, f"{n}_bias", d) for n, d in (("query", True), ("key", False), ("value", True)))
    if biases not in _BIAS_LAYOUTS:
        raise VitlabError(f"a DINOv3 with query_bias, key_bias, value_bias = {biases} is not supported; accepted: "
                          "(true, false, true), (false, false, false) or (true, true, true)")
    for key in ("proj_bias", "mlp_bias"):
        if not _bool(cfg, key, True):
            raise VitlabError(f"a DINOv3 with {key}=false is not supported; accepted: {key}=true")
    gated = _bool(cfg, "use_gated_mlp", False)
    if gated and common["act_layer"] != "silu":
        raise VitlabError(f"a DINOv3 gated MLP with hidden_act {cfg.get('hidden_act')!r} is not supported; "
                          "accepted: silu")
    args = {k: v for k, v in common.items() if k not in ("pos_drop_rate", "proj_drop_rate")}
    if gated:  # SwiGLU's activation is SiLU; act_layer is the plain MLP's
        args.pop("act_layer")
    scale = cfg.get("layerscale_value")
    args.update(
        _BIAS_LAYOUTS[biases], global_pool="token", use_fc_norm=False, use_abs_pos_emb=False, use_rot_pos_emb=True,
        rope_type="dinov3", rope_rotate_half=True, rope_temperature=float(cfg.get("rope_theta") or 100.0),
        num_reg_tokens=int(cfg.get("num_register_tokens") or 0), init_values=1.0 if scale is None else float(scale),
        dynamic_img_size=True, drop_path_rate=float(cfg.get("drop_path_rate") or 0.0),
        rope_shift_coords=cfg.get("pos_embed_shift"), rope_jitter_coords=cfg.get("pos_embed_jitter"),
        rope_rescale_coords=cfg["pos_embed_rescale"] if "pos_embed_rescale" in cfg else 2.0,
        **(dict(swiglu_mlp=True, swiglu_align_to=1) if gated else {}))  # split SwiGLU at intermediate_size exactly
    return args


def convert_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Hub's key names -> vitlab's; query, key and value are joined into qkv."""
    up = "mlp.fc1_x" if _bool(cfg, "use_gated_mlp", False) else "mlp.fc1"
    key_bias = _bool(cfg, "key_bias", False)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown = []
    for key, v in state.items():
        m = _LAYER.match(key)
        if m is None:
            if key in _TOP_KEYS:
                out[_TOP_KEYS[key]] = v
            elif key != "embeddings.mask_token":  # used in DINOv3's masked pre-training only
                unknown.append(key)
            continue
        i, (mod, _, param) = int(m.group(1)), m.group(2).rpartition(".")
        if mod in _QKV and (param == "weight" or key_bias):
            qkv.setdefault((i, param), {})[_QKV[mod]] = v
        elif mod in _QKV and mod != "attention.k_proj":
            out[f"blocks.{i}.attn.{'q' if _QKV[mod] == 0 else 'v'}_bias"] = v
        elif mod in _LAYER_KEYS or mod == "mlp.up_proj":
            target = _LAYER_KEYS.get(mod, up)
            out[f"blocks.{i}.{target}.{'gamma' if param == 'lambda1' else param}"] = v
        else:
            unknown.append(key)
    join_qkv(out, qkv)
    check_placed(unknown, MODEL_TYPE)
    return out


def export_missing(model: nn.Module) -> list[str]:
    """What of a DINOv3 Eva (one transformers can hold) DINOv3ViTModel's output cannot express."""
    missing = []
    if model.num_classes > 0:
        missing.append("a classifier head (DINOv3ViTModel has none: reset_classifier(0) first)")
    if model.global_pool != "token":
        missing.append(f"global_pool={model.global_pool!r} (its pooled output is the class token)")
    return missing


def export_config(model: nn.Module, a: dict[str, Any], act_names: dict[str, str]) -> dict[str, Any]:
    """transformers' config.json for DINOv3ViTModel (``a``: the model's complete arguments)."""
    missing = export_missing(model)
    gated = a["swiglu_mlp"]
    if not gated and a["act_layer"] not in act_names:
        missing.append(f"act_layer {a['act_layer']!r}")
    missing += [f"{k}={a[k]}" for k in ("pos_drop_rate", "proj_drop_rate") if a[k]]  # it has attention dropout only
    if missing:
        raise VitlabError(f"transformers' DINOv3 cannot express {', '.join(missing)}; export with --to timm or onnx")
    bias = bool(a["qkv_bias"])
    rope, embed = model.rope, model.patch_embed
    return {
        "architectures": ["DINOv3ViTModel"], "model_type": MODEL_TYPE,
        "hidden_size": model.embed_dim, "num_hidden_layers": len(model.blocks),
        "num_attention_heads": model.blocks[0].attn.num_heads,
        "intermediate_size": model.blocks[0].mlp.fc2.in_features,
        "hidden_act": "silu" if gated else act_names[a["act_layer"]], "use_gated_mlp": bool(gated),
        "attention_dropout": float(a["attn_drop_rate"]), "drop_path_rate": float(a["drop_path_rate"]),
        "initializer_range": 0.02, "layer_norm_eps": float(a["norm_eps"]), "rope_theta": rope.temperature,
        "image_size": hf_size(embed.img_size), "patch_size": hf_size(embed.patch_size),
        "num_channels": int(a["in_chans"]),
        "query_bias": bias, "key_bias": bias and a["attn_type"] == "rope", "value_bias": bias, "proj_bias": True,
        "mlp_bias": True, "layerscale_value": float(a["init_values"]),
        "num_register_tokens": int(a["num_reg_tokens"]), "pos_embed_shift": rope.augment.shift,
        "pos_embed_jitter": rope.augment.jitter, "pos_embed_rescale": rope.augment.rescale, "dtype": "float32",
    }


_TO_HF_LAYER = {**{v: k for k, v in _LAYER_KEYS.items()}, "mlp.fc1": "mlp.up_proj", "mlp.fc1_x": "mlp.up_proj"}
_TO_HF_TOP = {v: k for k, v in _TOP_KEYS.items()}
_TO_HF_BIAS = {"q_bias": "q_proj", "v_bias": "v_proj"}


def export_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vitlab keys -> the Hub's; qkv is split into q_proj, k_proj and v_proj, a packed SwiGLU fc1 (gate first)
    into gate_proj and up_proj."""
    out: dict[str, torch.Tensor] = {"embeddings.mask_token": state["cls_token"].new_zeros(state["cls_token"].shape)}
    for key, v in state.items():
        if key in _TO_HF_TOP:
            out[_TO_HF_TOP[key]] = v
            continue
        _, i, sub = key.split(".", 2)
        mod, _, param = sub.rpartition(".")
        prefix = f"layer.{i}"  # the name save_pretrained writes (the module's is model.layer.i)
        if mod == "attn.qkv":
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                out[f"{prefix}.attention.{name}.{param}"] = part.contiguous()
        elif mod == "attn" and param in _TO_HF_BIAS:
            out[f"{prefix}.attention.{_TO_HF_BIAS[param]}.bias"] = v
        elif mod in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
            out[f"{prefix}.attention.{mod.split('.')[1]}.{param}"] = v
        elif mod == "mlp.fc1" and cfg["use_gated_mlp"]:
            gate, up = v.chunk(2, dim=0)
            out[f"{prefix}.mlp.gate_proj.{param}"], out[f"{prefix}.mlp.up_proj.{param}"] = gate, up
        else:
            out[f"{prefix}.{_TO_HF_LAYER[mod]}.{'lambda1' if param == 'gamma' else param}"] = v
    return out
