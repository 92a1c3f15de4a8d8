"""Hugging Face transformers ViT-family folders: config.json with ``model_type``, the Hub's key names.

BEiT and data2vec-vision have their key maps in ``hf_beit``; this module dispatches to it by model_type.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ..atomic import read_json_object
from ..data.views import Preprocess, scale_size
from ..errors import VitlabError
from ..models.beit import Beit
from ..models.eva import Eva
from ..models.naflex import NaFlexVit
from ..models.vit import VisionTransformer
from ..text import quote
from . import hf_aimv2, hf_beit, hf_dinov3, hf_siglip2
from .keys import check_placed, hf_size, join_qkv

# transformers' hidden_act -> vitlab act_layer
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu", "quick_gelu": "quick_gelu"}
# model_type -> (its architectures -> the head they carry, the weights' prefix, the default architecture)
HF_MODEL_TYPES = {
    "vit": ({"ViTForImageClassification": "vit", "ViTModel": "base"}, "vit", "ViTForImageClassification"),
    "deit": ({"DeiTForImageClassificationWithTeacher": "distilled", "DeiTForImageClassification": "deit",
              "DeiTModel": "base"}, "deit", "DeiTForImageClassificationWithTeacher"),
    "dinov2": ({"Dinov2Model": "base", "Dinov2ForImageClassification": "token_avg"}, "dinov2", "Dinov2Model"),
    "dinov2_with_registers": ({"Dinov2WithRegistersModel": "base",
                               "Dinov2WithRegistersForImageClassification": "token_avg"},
                              "dinov2_with_registers", "Dinov2WithRegistersModel"),
    "clip_vision_model": ({"CLIPVisionModel": "base", "CLIPVisionModelWithProjection": "projection"},
                          "vision_model", "CLIPVisionModel"),
    "siglip_vision_model": ({"SiglipVisionModel": "base"}, "vision_model", "SiglipVisionModel"),
    hf_dinov3.MODEL_TYPE: (hf_dinov3.ARCHITECTURES, "", "DINOv3ViTModel"),
    hf_aimv2.MODEL_TYPE: (hf_aimv2.ARCHITECTURES, "", "Aimv2VisionModel"),
    **{t: (archs, "vision_model", next(iter(archs))) for t, archs in hf_siglip2.MODEL_TYPES.items()},
    # plain ViTs under the ViT's key names: MSN's encoder, MAE's encoder (its decoder is left out; with every patch
    # kept in order, as mask_ratio 0 and ascending noise give, transformers' ViTMAEModel is this ViT)
    "vit_msn": ({"ViTMSNForImageClassification": "vit", "ViTMSNModel": "base"}, "vit", "ViTMSNModel"),
    "vit_mae": ({"ViTMAEModel": "base", "ViTMAEForPreTraining": "base"}, "vit", "ViTMAEModel"),
    **{t: ({a: "classifier" if head else "base" for a, head in archs.items()}, prefix, next(iter(archs)))
       for t, (archs, prefix) in hf_beit.MODEL_TYPES.items()},
}
# model_types of the ViT family vitlab does not read, and why
HF_NOT_READ = {
    "vit-hybrid": "ViTHybrid (a ViT on a BiT ResNet) left transformers in version 5; load timm's folder "
                  "of the same model (vit_base_r50_s16_384) instead",
    "ijepa": "vitlab lacks a key map for transformers' I-JEPA encoder (no class token)",
    "metaclip_2_vision_model": "vitlab lacks a key map for transformers' MetaCLIP 2 image tower",
    "vitdet": "vitlab lacks ViTDet's windowed attention with relative position bias",
}
PLAIN_VIT_TYPES = ("vit", "deit", "vit_msn", "vit_mae")  # the ViT's key names (layernorm_before, attention.attention)
# no preprocessor_config.json is published with these model_types' checkpoints that vitlab could name as its source
UNPUBLISHED = ("vit_msn", "vit_mae")
HF_ARCHITECTURES = {a: role for archs, _, _ in HF_MODEL_TYPES.values() for a, role in archs.items()}


def is_hf_config(cfg: dict[str, Any]) -> bool:
    return "model_type" in cfg


def _get(cfg: dict[str, Any], key: str, default: Any) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def architecture(cfg: dict[str, Any]) -> tuple[str, str]:
    """(model_type, architecture) of a transformers config, each checked against what vitlab reads."""
    model_type = cfg["model_type"]
    if model_type not in HF_MODEL_TYPES:
        why = f" ({HF_NOT_READ[model_type]})" if model_type in HF_NOT_READ else ""
        raise VitlabError(f"Hugging Face model_type {model_type!r} is not supported{why}; "
                          f"accepted: {', '.join(HF_MODEL_TYPES)}")
    archs, _, default = HF_MODEL_TYPES[model_type]
    arch = (cfg.get("architectures") or [default])[0]
    if arch not in archs:
        raise VitlabError(f"Hugging Face architecture {arch!r} is not supported for model_type {model_type!r}; "
                          f"accepted: {', '.join(archs)}")
    return model_type, arch


def _family_args(cfg: dict[str, Any], model_type: str, role: str, dim: int) -> dict[str, Any]:
    """The arguments each model_type fixes: DINOv2's LayerScale and registers, CLIP's pre-norm, SigLIP's head."""
    if model_type in PLAIN_VIT_TYPES:
        return dict(qkv_bias=bool(_get(cfg, "qkv_bias", True)), distilled=role == "distilled",
                    reg_tokens=1 if (model_type == "deit" and role != "distilled") else 0)
    if model_type.startswith("dinov2"):
        regs = int(_get(cfg, "num_register_tokens", 0)) if model_type == "dinov2_with_registers" else 0
        return dict(qkv_bias=bool(_get(cfg, "qkv_bias", True)), init_values=float(_get(cfg, "layerscale_value", 1.0)),
                    reg_tokens=regs, no_embed_class=regs > 0, dynamic_img_size=True,
                    pos_embed_antialias=regs > 0,  # transformers' Dinov2 resamples its table without antialiasing
                    global_pool="token_avg" if role == "token_avg" else "token",
                    **_dinov2_mlp(cfg, dim))
    if model_type == "clip_vision_model":  # pooler_output: post_layernorm on the class token
        return dict(pre_norm=True, fc_norm=True)
    if not _get(cfg, "vision_use_head", True):
        raise VitlabError("a SigLIP vision model with vision_use_head=False is not supported")
    return dict(class_token=False, global_pool="map")


def _dinov2_mlp(cfg: dict[str, Any], dim: int) -> dict[str, Any]:
    """DINOv2's MLP: fc1 int(dim * mlp_ratio) wide, or with use_swiglu_ffn the giants' SwiGLU, whose gate and value
    (``mlp.weights_in``, side by side) are each two thirds of that rounded up to a multiple of 8 (transformers'
    Dinov2SwiGLUFFN, silu whatever hidden_act says): vitlab's packed SwiGLU with fc1 twice that wide."""
    ratio = float(_get(cfg, "mlp_ratio", 4.0))
    if not cfg.get("use_swiglu_ffn"):
        return dict(mlp_ratio=ratio)
    hidden = (int(int(dim * ratio) * 2 / 3) + 7) // 8 * 8
    return dict(mlp_ratio=2 * hidden / dim, mlp_layer="swiglu_packed", act_layer="silu")


def _num_classes(cfg: dict[str, Any], role: str) -> int:
    if role == "base":
        return 0
    if role == "projection":
        return int(cfg["projection_dim"])
    labels = cfg.get("id2label") or {}
    return int(cfg.get("num_labels") or (len(labels) if isinstance(labels, dict) else 0) or 2)


def model_args(cfg: dict[str, Any]) -> tuple[type[VisionTransformer | Beit | Eva | NaFlexVit], dict[str, Any],
                                             dict[str, Any]]:
    """(vitlab class, arguments, preprocessing) from a transformers config.json (HF_MODEL_TYPES)."""
    model_type, arch = architecture(cfg)
    if model_type in hf_siglip2.MODEL_TYPES:
        return NaFlexVit, hf_siglip2.model_args(cfg, HF_ACTIVATIONS), {}
    role = HF_ARCHITECTURES[arch]
    act = _get(cfg, "hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise VitlabError(f"hidden_act {act!r} is not supported; accepted: {', '.join(HF_ACTIVATIONS)}")
    dim = int(cfg["hidden_size"])
    id2label = cfg.get("id2label") or {}
    if not isinstance(id2label, dict):
        raise VitlabError(f"id2label is {quote(id2label)}; accepted: an object of class index -> name")
    num_classes = _num_classes(cfg, role)
    img, patch = _get(cfg, "image_size", 224), _get(cfg, "patch_size", 16)
    default_eps = (1e-12 if model_type in ("vit", "deit", "vit_mae", *hf_beit.MODEL_TYPES) else
                   1e-5 if model_type in ("clip_vision_model", hf_dinov3.MODEL_TYPE) else 1e-6)
    args = dict(
        img_size=tuple(img) if isinstance(img, (list, tuple)) else int(img),
        patch_size=tuple(patch) if isinstance(patch, (list, tuple)) else int(patch),
        in_chans=int(_get(cfg, "num_channels", 3)),
        num_classes=num_classes,
        embed_dim=dim,
        depth=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        mlp_ratio=int(_get(cfg, "intermediate_size", 4 * dim)) / dim,
        act_layer=HF_ACTIVATIONS[act],
        norm_eps=float(_get(cfg, "layer_norm_eps", default_eps)),
        pos_drop_rate=float(_get(cfg, "hidden_dropout_prob", 0.0)),
        proj_drop_rate=float(_get(cfg, "hidden_dropout_prob", 0.0)),
        attn_drop_rate=float(_get(cfg, "attention_probs_dropout_prob", _get(cfg, "attention_dropout", 0.0))),
    )
    preprocess: dict[str, Any] = {}
    if id2label and num_classes and role != "projection":
        names = [str(id2label.get(str(i), id2label.get(i, i))) for i in range(num_classes)]
        if names != default_labels(num_classes):  # transformers' placeholders are no names
            preprocess["label_names"] = names
    if model_type in hf_beit.MODEL_TYPES:
        return Beit, hf_beit.model_args(cfg, arch, args), preprocess
    if model_type == hf_dinov3.MODEL_TYPE:
        return Eva, hf_dinov3.model_args(cfg, args), preprocess
    if model_type == hf_aimv2.MODEL_TYPE:
        return VisionTransformer, hf_aimv2.model_args(cfg, args), preprocess
    args.update(_family_args(cfg, model_type, role, dim))
    return VisionTransformer, args, preprocess


def default_labels(num_classes: int) -> list[str]:
    """The names transformers gives classes that have none: LABEL_0, LABEL_1, ..."""
    return [f"LABEL_{i}" for i in range(num_classes)]


# PIL's resampling codes, as image processors store them -> timm's interpolation names
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
PREPROCESSOR = "preprocessor_config.json"


def _hw(size: Any) -> tuple[int, int] | None:
    """(height, width) of an image processor's size {height, width} (or a bare number), None otherwise."""
    if isinstance(size, dict) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    return (int(size), int(size)) if isinstance(size, (int, float)) and not isinstance(size, bool) else None


def _crop_pct(crop: int, scale: int) -> float:
    """crop / scale, nudged down where floor(crop / crop_pct) would land below ``scale`` in floating point."""
    pct = crop / scale
    while math.floor(crop / pct) < scale:
        pct = math.nextafter(pct, 0.0)
    return pct


IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]


def published_processor(model_type: str, size: int) -> tuple[dict[str, Any], str]:
    """The preprocessor_config.json the authors of a model_type publish with their checkpoints, for an input of
    ``size``, and where it comes from: what a folder saved without one (``save_pretrained`` of a model alone) was
    trained with. Resample codes are PIL's (2 bilinear, 3 bicubic); every one rescales by 1/255."""
    short = round(size / 0.875)  # 256 for 224: DeiT's and DINOv2's resize before their centre crop
    published = {
        "vit": ({"size": {"height": size, "width": size}, "resample": 2, "image_mean": HALF, "image_std": HALF},
                "google/vit-*: ViTImageProcessor"),
        "deit": ({"size": {"height": short, "width": short}, "do_center_crop": True,
                  "crop_size": {"height": size, "width": size}, "resample": 3, "image_mean": IMAGENET_MEAN,
                  "image_std": IMAGENET_STD}, "facebook/deit-*: DeiTImageProcessor"),
        "dinov2": ({"size": {"shortest_edge": short}, "do_center_crop": True,
                    "crop_size": {"height": size, "width": size}, "resample": 3, "image_mean": IMAGENET_MEAN,
                    "image_std": IMAGENET_STD}, "facebook/dinov2-*: BitImageProcessor"),
        "clip_vision_model": ({"size": {"shortest_edge": size}, "do_center_crop": True,
                               "crop_size": {"height": size, "width": size}, "resample": 3, "image_mean": CLIP_MEAN,
                               "image_std": CLIP_STD}, "openai/clip-vit-*: CLIPImageProcessor"),
        "siglip_vision_model": ({"size": {"height": size, "width": size}, "resample": 3, "image_mean": HALF,
                                 "image_std": HALF}, "google/siglip-*: SiglipImageProcessor"),
    }
    published["beit"] = ({"size": {"height": size, "width": size}, "resample": 3, "image_mean": HALF,
                          "image_std": HALF}, "microsoft/beit-*: BeitImageProcessor")
    published["data2vec-vision"] = (published["beit"][0], "facebook/data2vec-vision-*: BeitImageProcessor")
    published["dinov2_with_registers"] = published["dinov2"]
    for siglip2 in hf_siglip2.MODEL_TYPES:  # the whole square grid, each image squashed to it
        published[siglip2] = ({"size": {"height": size, "width": size}, "resample": 2, "image_mean": HALF,
                               "image_std": HALF}, "google/siglip2-*-naflex: Siglip2ImageProcessor")
    published[hf_dinov3.MODEL_TYPE] = ({"size": {"height": size, "width": size}, "resample": 2,
                                        "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD},
                                       "facebook/dinov3-vit*: DINOv3ViTImageProcessorFast")
    published[hf_aimv2.MODEL_TYPE] = (published["clip_vision_model"][0], "apple/aimv2-*: CLIPImageProcessor")
    cfg, where = published[model_type]
    return {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, **cfg}, where


def preprocessing(folder: Path, model_cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """A folder's preprocessor_config.json as ``views.Preprocess`` pretrained_cfg keys, with ``preprocess_from``
    saying where they came from: the file, or where it is missing, the preprocessing published for the
    ``model_type`` of ``model_cfg`` (its config.json); empty without either.

    ``size`` {height, width} is an exact resize (crop_mode squash), ``size`` {shortest_edge} the shorter side
    (crop_mode center); a centre crop of ``crop_size`` after it sets crop_pct.
    """
    path = Path(folder) / PREPROCESSOR
    if not path.is_file():
        if not model_cfg or model_cfg.get("model_type") not in HF_MODEL_TYPES or model_cfg["model_type"] in UNPUBLISHED:
            return {}
        siglip2 = model_cfg["model_type"] in hf_siglip2.MODEL_TYPES
        image = hf_siglip2.image_size(model_cfg) if siglip2 else _get(model_cfg, "image_size", 224)
        cfg, where = published_processor(model_cfg["model_type"], int(image[0] if isinstance(image, list) else image))
        return dict(_processor_keys(cfg), preprocess_from=f"{folder} has no {PREPROCESSOR}: the preprocessing "
                    f"published for model_type {model_cfg['model_type']} ({where})")
    processor = read_json_object(path)
    return dict(_processor_keys(processor), **hf_siglip2.processor_keys(processor), preprocess_from=str(path))


def _processor_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """An image processor's config as ``views.Preprocess`` pretrained_cfg keys."""
    out: dict[str, Any] = {}
    if cfg.get("do_normalize", True) and cfg.get("image_mean") is not None and cfg.get("image_std") is not None:
        out["mean"], out["std"] = tuple(cfg["image_mean"]), tuple(cfg["image_std"])
    if cfg.get("resample") in PIL_RESAMPLE:
        out["interpolation"] = PIL_RESAMPLE[cfg["resample"]]
    size, crop = cfg.get("size"), _hw(cfg.get("crop_size")) if cfg.get("do_center_crop") else None
    short = size.get("shortest_edge") if isinstance(size, dict) else None
    if crop:
        out["crop_offset"] = "floor"  # transformers' center_crop
    if short is not None:
        out["crop_mode"], out["crop_pct"] = "center", _crop_pct(crop[0], int(short)) if crop else 1.0
    elif _hw(size):
        out["crop_mode"] = "squash"
        out["crop_pct"] = _crop_pct(crop[0], _hw(size)[0]) if crop else 1.0
    return out


def image_processor(model_cfg: dict[str, Any], cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """A preprocessor_config.json that does what ``views.Preprocess.from_cfg(model_cfg)`` does: transformers'
    ViTImageProcessor for an exact resize, its CLIPImageProcessor (resize, then centre crop) otherwise.

    transformers places a centre crop at floor((H - h) / 2): a rule of crop_offset round (timm's) lands one pixel
    lower or further right where H - h is 3 mod 4 (e.g. 35 - 32), which no processor option expresses.
    """
    if cfg is not None and cfg["model_type"] in hf_siglip2.MODEL_TYPES:  # SigLIP 2 (``cfg``: its config.json)
        return hf_siglip2.image_processor(model_cfg, cfg)
    prep = Preprocess.from_cfg(model_cfg)
    (h, w), (sh, sw) = prep.size, scale_size(prep.size, prep.crop_pct)
    resample = {v: k for k, v in PIL_RESAMPLE.items()}[prep.interpolation]
    common = {"do_resize": True, "resample": resample, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": list(prep.mean), "image_std": list(prep.std)}
    if prep.crop_mode == "squash" and (sh, sw) == (h, w):
        return {"image_processor_type": "ViTImageProcessor", "size": {"height": h, "width": w}, **common}
    if prep.crop_mode == "border" or (prep.crop_mode == "center" and sh != sw):
        raise VitlabError(f"transformers' image processors cannot express {prep.describe()}; export with --to timm "
                          "or onnx")
    size = {"shortest_edge": sh} if prep.crop_mode == "center" else {"height": sh, "width": sw}
    return {"image_processor_type": "CLIPImageProcessor", "size": size, "do_center_crop": True,
            "crop_size": {"height": h, "width": w}, "do_convert_rgb": model_cfg["input_size"][0] == 3, **common}


_LAYER = re.compile(r"^encoder\.layers?\.(\d+)\.(.+)$")
_LAYER_KEYS = {  # ViT, DeiT
    "attention.output.dense": "attn.proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
}
_DINOV2_LAYER_KEYS = {"attention.output.dense": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
                      "mlp.weights_in": "mlp.fc1", "mlp.weights_out": "mlp.fc2",  # use_swiglu_ffn (gate first)
                      "norm1": "norm1", "norm2": "norm2", "layer_scale1": "ls1", "layer_scale2": "ls2"}
_CLIP_LAYER_KEYS = {"self_attn.out_proj": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
                    "layer_norm1": "norm1", "layer_norm2": "norm2"}
_QKV = {"attention.attention.": ("query", "key", "value"), "self_attn.": ("q_proj", "k_proj", "v_proj")}
_TOP_KEYS = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}
_CLIP_TOP_KEYS = {
    "embeddings.class_embedding": "cls_token",
    "embeddings.position_embedding.weight": "pos_embed",
    "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
    "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
    "pre_layrnorm.weight": "norm_pre.weight",
    "pre_layrnorm.bias": "norm_pre.bias",
    "post_layernorm.weight": "fc_norm.weight",  # CLIP: on the pooled class token
    "post_layernorm.bias": "fc_norm.bias",
    "head.probe": "attn_pool.latent",  # SigLIP's attention-pool head
    "head.attention.out_proj.weight": "attn_pool.proj.weight",
    "head.attention.out_proj.bias": "attn_pool.proj.bias",
    "head.layernorm.weight": "attn_pool.norm.weight",
    "head.layernorm.bias": "attn_pool.norm.bias",
    "head.mlp.fc1.weight": "attn_pool.mlp.fc1.weight",
    "head.mlp.fc1.bias": "attn_pool.mlp.fc1.bias",
    "head.mlp.fc2.weight": "attn_pool.mlp.fc2.weight",
    "head.mlp.fc2.bias": "attn_pool.mlp.fc2.bias",
}
_HEADS = {"classifier": "head", "cls_classifier": "head", "distillation_classifier": "head_dist",
          "visual_projection": "head"}
IGNORED = ("pooler.", "embeddings.mask_token", "embeddings.position_ids")  # ViTModel's tanh pooler, DINOv2's mask


def _layer_key(i: int, sub: str, layer_keys: dict[str, str]) -> str | None:
    """A layer's key below ``encoder.layer(s).i`` -> vitlab's (``layer_scale1.lambda1`` -> ``ls1.gamma``)."""
    mod, _, param = sub.rpartition(".")
    if mod not in layer_keys:
        return None
    return f"blocks.{i}.{layer_keys[mod]}.{'gamma' if param == 'lambda1' else param}"


def _top_key(k: str, v: torch.Tensor, model_type: str, distilled: bool, out: dict[str, torch.Tensor]) -> bool:
    """Place a tensor outside the encoder layers; False where it has no place."""
    if k == "embeddings.distillation_token":
        out["dist_token" if distilled else "reg_token"] = v
    elif k == "embeddings.register_tokens":
        out["reg_token"] = v
    elif k == "head.attention.in_proj_weight" or k == "head.attention.in_proj_bias":
        q, kv = v.split([v.shape[0] // 3, 2 * v.shape[0] // 3])
        param = k.rsplit("_", 1)[1]
        out[f"attn_pool.q.{param}"], out[f"attn_pool.kv.{param}"] = q, kv
    elif model_type.endswith("vision_model") and k in _CLIP_TOP_KEYS:
        out[_CLIP_TOP_KEYS[k]] = v
    elif k in _TOP_KEYS:
        out[_TOP_KEYS[k]] = v
    else:
        return False
    return True


def _fix_embeddings(out: dict[str, torch.Tensor], model_type: str) -> None:
    """CLIP/SigLIP hold the class token as (D,) and the position table as (N, D); DINOv2 with registers gives
    the class token its position entry and the patches the rest (vitlab's no_embed_class)."""
    if model_type.endswith("vision_model"):
        if "cls_token" in out:
            out["cls_token"] = out["cls_token"].reshape(1, 1, -1)
        out["pos_embed"] = out["pos_embed"].unsqueeze(0)
        if model_type == "clip_vision_model" and "head.weight" in out:  # the projection has no bias
            out["head.bias"] = out["head.weight"].new_zeros(out["head.weight"].shape[0])
        if model_type == "siglip_vision_model":  # SigLIP: post_layernorm on every token, before the head
            out.update({f"norm.{p}": out.pop(f"fc_norm.{p}") for p in ("weight", "bias") if f"fc_norm.{p}" in out})
    if model_type == "dinov2_with_registers":
        pos = out["pos_embed"]
        out["cls_token"], out["pos_embed"] = out["cls_token"] + pos[:, :1], pos[:, 1:]


def convert_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Hub's key names -> vitlab's; query/key/value are concatenated into qkv."""
    model_type, arch = architecture(cfg)
    if model_type in hf_beit.MODEL_TYPES:
        return hf_beit.convert_state_dict(state, model_type, bool(cfg.get("use_mean_pooling", True)))
    if model_type == hf_dinov3.MODEL_TYPE:
        return hf_dinov3.convert_state_dict(state, cfg)
    if model_type == hf_aimv2.MODEL_TYPE:
        return hf_aimv2.convert_state_dict(state, cfg)
    if model_type in hf_siglip2.MODEL_TYPES:
        return hf_siglip2.convert_state_dict(state, cfg)
    distilled = HF_ARCHITECTURES[arch] == "distilled"
    prefix = HF_MODEL_TYPES[model_type][1] + "."
    layer_keys = (_LAYER_KEYS if model_type in PLAIN_VIT_TYPES else
                  _DINOV2_LAYER_KEYS if model_type.startswith("dinov2") else _CLIP_LAYER_KEYS)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, v in state.items():
        head, _, rest = key.partition(".")
        if head in _HEADS and rest in ("weight", "bias"):
            out[f"{_HEADS[head]}.{rest}"] = v
            continue
        k = key.removeprefix(prefix)
        if k.startswith(IGNORED) or (model_type == "vit_mae" and k.startswith("decoder.")):  # MAE's pixel decoder
            continue
        m = _LAYER.match(k)
        if m is None:
            if not _top_key(k, v, model_type, distilled, out):
                unknown.append(key)
            continue
        i, sub = int(m.group(1)), m.group(2)
        attn = next((a for a in _QKV if sub.startswith(a) and sub[len(a):].split(".")[0] in _QKV[a]), None)
        if attn is not None:
            which, param = sub[len(attn):].split(".")
            qkv.setdefault((i, param), {})[_QKV[attn].index(which)] = v
        elif (name := _layer_key(i, sub, layer_keys)) is not None:
            out[name] = v
        else:
            unknown.append(key)
    join_qkv(out, qkv)
    check_placed(unknown, model_type)
    _fix_embeddings(out, model_type)
    return out


# --- writing: a vitlab ViT/DeiT as a transformers folder --------------------------------------------------------

_HF_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu",
                 "quick_gelu": "quick_gelu"}
_TO_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_TO_HF_TOP = {v: k for k, v in _TOP_KEYS.items()}


def _vit_missing(a: dict[str, Any]) -> list[str]:
    """What of a ViT/DeiT's arguments transformers' ViT and DeiT classes cannot express."""
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
    return missing + [name for name, on in (("qk_norm", a.get("qk_norm")), ("pre_norm", a.get("pre_norm")),
                                             ("proj_bias=False", a.get("proj_bias") is False),
                                             ("final_norm=False", a.get("final_norm") is False)) if on]


def export_config(model: torch.nn.Module, args: dict[str, Any]) -> dict[str, Any]:
    """transformers' config.json (ViTForImageClassification, DeiTForImageClassificationWithTeacher or
    BeitForImageClassification).

    Raises ValueError naming what transformers' class cannot express.
    """
    if model.hf_model_type is None:
        other = "--to onnx" if model.timm_spec is None else "--to timm or --to onnx"
        raise VitlabError(f"transformers' ViT-family classes cannot express {model.no_hf}; export it with {other}")
    if model.hf_model_type == hf_dinov3.MODEL_TYPE:
        return hf_dinov3.export_config(model, args, _HF_ACT_NAMES)
    if model.hf_model_type == hf_aimv2.MODEL_TYPE:
        return hf_aimv2.export_config(model, args)
    if model.hf_model_type in hf_siglip2.MODEL_TYPES:
        return hf_siglip2.export_config(model, args, _HF_ACT_NAMES)
    a = {"class_token": True, "reg_tokens": 0, "no_embed_class": False, "pos_embed": "learn", "init_values": None,
         "global_pool": "token", "fc_norm": None, "act_layer": "gelu", "mlp_ratio": 4.0, "qkv_bias": True,
         "norm_eps": 1e-6, "in_chans": 3, "distilled": False, **args}
    beit = model.hf_model_type in hf_beit.MODEL_TYPES
    missing = [] if beit else _vit_missing(a)
    if a["act_layer"] not in _HF_ACT_NAMES:
        missing.append(f"act_layer {a['act_layer']!r}")
    if model.num_classes <= 0:
        missing.append("a model without a classifier head (num_classes=0)")
    dim = model.embed_dim
    hidden = a["mlp_ratio"] * dim
    if hidden != int(hidden):
        missing.append(f"an MLP width of {hidden:g} (mlp_ratio x embed_dim must be whole)")
    if missing:
        raise VitlabError(f"transformers' {'BEiT' if beit else 'ViT/DeiT'} cannot express {', '.join(missing)}; "
                          "export with --to timm or onnx")
    distilled = model.hf_model_type == "deit"
    names = list((getattr(model, "pretrained_cfg", {}) or {}).get("label_names") or default_labels(model.num_classes))
    drop = float(a.get("proj_drop_rate", 0.0))
    cfg = {
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
        "image_size": hf_size(model.patch_embed.img_size),
        "patch_size": hf_size(model.patch_embed.patch_size),
        "num_channels": int(a["in_chans"]),
        "qkv_bias": bool(a["qkv_bias"]),
        "encoder_stride": int(model.patch_embed.patch_size[0]),
        "id2label": {str(i): str(n) for i, n in enumerate(names)},
        "label2id": {str(n): i for i, n in enumerate(names)},
        "dtype": "float32",
    }
    return hf_beit.export_config(model, a, cfg) if beit else cfg


def export_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vitlab keys -> the Hub's (``vit.``/``deit.`` prefixed); qkv is split into query, key and value."""
    if cfg["model_type"] in hf_beit.MODEL_TYPES:
        return hf_beit.export_state_dict(state)
    if cfg["model_type"] == hf_dinov3.MODEL_TYPE:
        return hf_dinov3.export_state_dict(state, cfg)
    if cfg["model_type"] == hf_aimv2.MODEL_TYPE:
        return hf_aimv2.export_state_dict(state, cfg)
    if cfg["model_type"] in hf_siglip2.MODEL_TYPES:
        return hf_siglip2.export_state_dict(state, cfg)
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
            raise VitlabError(f"tensor {key!r} has no place in transformers' ViT/DeiT")
    return out
