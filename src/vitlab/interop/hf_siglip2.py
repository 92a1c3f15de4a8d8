"""transformers' SigLIP 2 image tower (``Siglip2VisionModel``, model_type ``siglip2_vision_model``, and the vision half
of a ``siglip2`` folder, ``Siglip2Model``): config and key names, read into vitlab's NaFlexVit.

Its embedding is a linear layer on patches flattened as (ph, pw, C); the position table (``num_patches`` entries, a
square grid) is resized to each image's grid with antialiased bilinear interpolation; padded patches are masked as
keys only and carry the first resized entry; ``post_layernorm`` normalises every token and the attention-pool head
(``head.probe`` attending with ``nn.MultiheadAttention``) pools the real ones. A folder with
``vision_use_head=false`` has no pooled output: vitlab pools it by the mean of the final tokens.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import VitlabError
from .keys import check_placed, join_qkv, place_layer

MODEL_TYPES = {"siglip2_vision_model": {"Siglip2VisionModel": "base"}, "siglip2": {"Siglip2Model": "base"}}
DEFAULT_ACT = "gelu_pytorch_tanh"
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_LAYER_KEYS = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
               "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
_TOP_PREFIXES = {"embeddings.patch_embedding.": "embeds.proj.", "post_layernorm.": "norm.",
                 "head.attention.out_proj.": "attn_pool.proj.", "head.layernorm.": "attn_pool.norm.",
                 "head.mlp.": "attn_pool.mlp."}
IGNORED = ("text_model.", "logit_scale", "logit_bias", "embeddings.position_ids")  # the text tower, the CLIP scale


def tower(cfg: dict[str, Any]) -> dict[str, Any]:
    """The image tower's config: a siglip2 folder's ``vision_config``, or the config itself."""
    if cfg.get("model_type") != "siglip2":
        return cfg
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise VitlabError("a siglip2 config.json without a 'vision_config' object; accepted: the config "
                          "Siglip2Model.save_pretrained writes")
    return vision


def _get(cfg: dict[str, Any], key: str, default: Any) -> Any:
    return default if cfg.get(key) is None else cfg[key]


def grid_side(cfg: dict[str, Any]) -> int:
    """The side of the square position table: sqrt(num_patches)."""
    n = int(_get(tower(cfg), "num_patches", 256))
    side = math.isqrt(n) if n > 0 else 0
    if side * side != n or n <= 0:
        raise VitlabError(f"num_patches {n} is not a square number of patches; accepted: a square (256 = 16 x 16), "
                          "the position table's grid")
    return side


def image_size(cfg: dict[str, Any]) -> int:
    """The input size at which the tower sees its whole table without resizing: side x patch."""
    patch = _get(tower(cfg), "patch_size", 16)
    return grid_side(cfg) * int(patch[0] if isinstance(patch, (list, tuple)) else patch)


def model_args(cfg: dict[str, Any], activations: dict[str, str]) -> dict[str, Any]:
    """NaFlexVit's arguments from a siglip2_vision_model or siglip2 config.json (``activations``: transformers'
    hidden_act -> vitlab's)."""
    v = tower(cfg)
    act = _get(v, "hidden_act", DEFAULT_ACT)
    if act not in activations:
        raise VitlabError(f"hidden_act {act!r} is not supported; accepted: {', '.join(activations)}")
    dim, side, patch = int(_get(v, "hidden_size", 768)), grid_side(cfg), _get(v, "patch_size", 16)
    head = bool(_get(v, "vision_use_head", True))
    return dict(
        img_size=image_size(cfg), patch_size=tuple(patch) if isinstance(patch, (list, tuple)) else int(patch),
        in_chans=int(_get(v, "num_channels", 3)), num_classes=0, embed_dim=dim,
        depth=int(_get(v, "num_hidden_layers", 12)), num_heads=int(_get(v, "num_attention_heads", 12)),
        mlp_ratio=int(_get(v, "intermediate_size", 4 * dim)) / dim, act_layer=activations[act],
        norm_eps=float(_get(v, "layer_norm_eps", 1e-6)), attn_drop_rate=float(_get(v, "attention_dropout", 0.0)),
        pos_embed_grid_size=(side, side), pos_embed_interp_mode="bilinear", pos_embed_antialias=True,
        use_key_only_attn_mask=True, pos_embed_pad_first=True,
        **(dict(global_pool="map") if head else dict(global_pool="avg", fc_norm=False)))


def _top_key(k: str, v: torch.Tensor, side: int, out: dict[str, torch.Tensor]) -> bool:
    """Place a tensor outside the encoder layers; False where it has no place."""
    if k == "embeddings.position_embedding.weight":
        out["embeds.pos_embed"] = v.reshape(1, side, side, v.shape[-1])
    elif k == "head.probe":
        out["attn_pool.latent"] = v
    elif k in ("head.attention.in_proj_weight", "head.attention.in_proj_bias"):
        param = k.rsplit("_", 1)[1]
        out[f"attn_pool.q.{param}"], out[f"attn_pool.kv.{param}"] = v.split([v.shape[0] // 3, 2 * v.shape[0] // 3])
    else:
        prefix = next((p for p in _TOP_PREFIXES if k.startswith(p)), None)
        if prefix is None:
            return False
        out[_TOP_PREFIXES[prefix] + k[len(prefix):]] = v
    return True


def convert_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Hub's key names (with or without the ``vision_model.`` prefix) -> NaFlexVit's; q, k, v joined into qkv."""
    side = grid_side(cfg)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown = []
    for key, v in state.items():
        if key.startswith(IGNORED):
            continue
        k = key.removeprefix("vision_model.")
        m = _LAYER.match(k)
        if m is None:
            if not _top_key(k, v, side, out):
                unknown.append(key)
            continue
        if not place_layer(int(m.group(1)), m.group(2), v, out, qkv, _QKV, _LAYER_KEYS):
            unknown.append(key)
    join_qkv(out, qkv)
    check_placed(unknown, cfg["model_type"])
    return out


def processor_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a Siglip2ImageProcessor config (``max_num_patches``, no fixed size) means for vitlab's one-size eval
    view: the image squashed to the model's size (the processor keeps each image's aspect ratio instead: give the
    model a NaFlex batch, ``models.naflex.naflex_batch``, for that)."""
    return {"crop_mode": "squash", "crop_pct": 1.0} if "max_num_patches" in cfg and "size" not in cfg else {}


# --- writing: a NaFlex ViT as transformers' Siglip2VisionModel ---------------------------------------------------


def export_config(model: torch.nn.Module, a: dict[str, Any], act_names: dict[str, str]) -> dict[str, Any]:
    """transformers' config.json for Siglip2VisionModel (``a``: the model's complete arguments)."""
    missing = [] if model.num_classes <= 0 else ["a classifier head (Siglip2VisionModel has none: "
                                                 "reset_classifier(0) first)"]
    if a["act_layer"] not in act_names:
        missing.append(f"act_layer {a['act_layer']!r}")
    missing += [f"{k}={a[k]}" for k in ("pos_drop_rate", "proj_drop_rate") if a[k]]  # it has attention dropout only
    if missing:
        raise VitlabError(f"transformers' SigLIP 2 cannot express {', '.join(missing)}; export with --to timm or onnx")
    blk, table = model.blocks[0], model.embeds.pos_embed
    return {
        "architectures": ["Siglip2VisionModel"], "model_type": "siglip2_vision_model",
        "hidden_size": model.embed_dim, "intermediate_size": blk.mlp.fc1.out_features,
        "num_hidden_layers": len(model.blocks), "num_attention_heads": blk.attn.num_heads,
        "num_channels": model.embeds.proj.in_features // model.embeds.patch_size[0] ** 2,
        "patch_size": model.embeds.patch_size[0], "num_patches": table.shape[1] * table.shape[2],
        "hidden_act": act_names[a["act_layer"]], "layer_norm_eps": float(a["norm_eps"]),
        "attention_dropout": float(a["attn_drop_rate"]), "vision_use_head": True, "dtype": "float32",
    }


_TO_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_TO_HF_PREFIXES = {v: k for k, v in _TOP_PREFIXES.items()}


def export_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """NaFlexVit's keys -> the names Siglip2VisionModel.save_pretrained writes; qkv split into q, k and v, the pool's
    q and kv joined into nn.MultiheadAttention's in_proj."""
    out: dict[str, torch.Tensor] = {}
    for key, v in state.items():
        m = re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", key)
        if m and m.group(2) == "attn.qkv":
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                out[f"encoder.layers.{m.group(1)}.self_attn.{name}.{m.group(3)}"] = part.contiguous()
        elif m:
            out[f"encoder.layers.{m.group(1)}.{_TO_HF_LAYER[m.group(2)]}.{m.group(3)}"] = v
        elif key == "embeds.pos_embed":
            out["embeddings.position_embedding.weight"] = v.reshape(-1, v.shape[-1])
        elif key == "attn_pool.latent":
            out["head.probe"] = v
        elif key.startswith("attn_pool.q."):
            param = key.rsplit(".", 1)[1]
            out[f"head.attention.in_proj_{param}"] = torch.cat([v, state[f"attn_pool.kv.{param}"]])
        elif not key.startswith("attn_pool.kv."):
            prefix = next(p for p in _TO_HF_PREFIXES if key.startswith(p))
            out[_TO_HF_PREFIXES[prefix] + key[len(prefix):]] = v
    return out


def image_processor(model_cfg: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The Siglip2ImageProcessor config of a model (``model_cfg``: its pretrained_cfg, ``cfg``: its config.json):
    each image resized to at most the table's patch count, the model's mean and std."""
    return {"image_processor_type": "Siglip2ImageProcessor", "patch_size": cfg["patch_size"],
            "max_num_patches": cfg["num_patches"], "do_resize": True, "resample": 2, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(model_cfg["mean"]),
            "image_std": list(model_cfg["std"])}
