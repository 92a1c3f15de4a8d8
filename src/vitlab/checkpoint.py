"""vitlab.load and vitlab.save: model folders of config.json + model.safetensors.

``load`` reads vitlab's own folders, timm Hub exports and Hugging Face ViT/DeiT folders, local or
by Hub id (``hf-hub:org/name[@revision]``, through huggingface_hub's cache). It
never unpickles: weights come from safetensors (or, for old Hub folders, ``torch.load`` with
``weights_only=True``), and every tensor must find its place, shape for shape.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .atomic import atomic_path, atomic_write_json, read_json_object
from .interop import hf, hub, timm
from .models.base import make_pretrained_cfg
from .models.beit import resize_rel_pos_table
from .models.layers import resample_abs_pos_embed, resample_patch_embed, to_2tuple
from .models.registry import build, check_model, create_model, get_spec, model_class

FORMAT_VERSION = 1
CONFIG, WEIGHTS = "config.json", "model.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def current_args(model: nn.Module) -> dict[str, Any]:
    """The model's construction arguments, updated for a replaced head or a new input size."""
    args = dict(getattr(model, "model_args", {}))
    args["num_classes"] = model.num_classes
    embed = getattr(model, "patch_embed", None)
    if embed is not None:  # an int stays one while it says the same
        same = isinstance(args.get("img_size"), int) and (args["img_size"],) * 2 == tuple(embed.img_size)
        args["img_size"] = args["img_size"] if same else list(embed.img_size)
    return args


def save(model: nn.Module, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` to a folder as config.json + model.safetensors that vitlab.load reads."""
    check_model(model, "vitlab.save")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
        digest = _sha256(tmp)
    cfg = {
        "library": "vitlab",
        "format_version": FORMAT_VERSION,
        "architecture": getattr(model, "arch", None),
        "class": type(model).__name__,
        "model_args": current_args(model),
        "pretrained_cfg": dict(getattr(model, "pretrained_cfg", {}) or {}),
        "sha256": digest,
        **(extra or {}),
    }
    atomic_write_json(folder / CONFIG, cfg)
    return folder


def resolve(path: str | os.PathLike) -> Path:
    """A local path for a model folder, its config.json, or a Hub id (fetched into huggingface_hub's cache)."""
    return hub.download(path) if hub.is_hub_id(path) else Path(path)


def read_config(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(folder, parsed config.json) for a model folder, its config.json or a Hub id."""
    p = resolve(path)
    folder = p.parent if p.name == CONFIG else p
    if not folder.exists():
        raise FileNotFoundError(f"no model at {folder}: expected a folder with {CONFIG} and {WEIGHTS}")
    cfg_path = folder / CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG}; a model folder holds {CONFIG} and {WEIGHTS} "
                                "(written by vitlab.save, timm's save_for_hf or transformers' save_pretrained)")
    return folder, read_json_object(cfg_path)


def files_sha256(path: str | os.PathLike) -> dict[str, str]:
    """The sha256 of every file ``load`` reads from a model folder (config.json, its weights, a transformers folder's
    preprocessing), by file name: what a run records of a model it starts from or learns from."""
    folder, _ = read_config(path)
    names = [CONFIG, WEIGHTS, "model.safetensors.index.json", "pytorch_model.bin", hf.PREPROCESSOR]
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / WEIGHTS).is_file():
        try:
            names += sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # the load says what is wrong with the index
    return {name: _sha256(folder / name) for name in names if (folder / name).is_file()}


def read_weights(folder: Path, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a folder: model.safetensors (or a sharded index, or pytorch_model.bin without pickle code)."""
    st = folder / WEIGHTS
    if st.is_file():
        if expected_sha256 and _sha256(st) != expected_sha256:
            raise ValueError(f"{st} is corrupt or was changed: its sha256 does not match the one in {CONFIG}")
        try:
            return load_file(st)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{st} is truncated or corrupt ({e})") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            try:
                state.update(load_file(folder / shard))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"{folder / shard} is missing, truncated or corrupt ({e})") from None
        return state
    pt = folder / "pytorch_model.bin"
    if pt.is_file():
        return load_plain(pt, "cannot be read as plain tensors")
    raise FileNotFoundError(f"{folder} has no weights: expected {WEIGHTS}")


def load_plain(path: Path, broken: str = "is truncated or corrupt") -> Any:
    """torch.load of tensors and plain values only (nothing unpickled runs); a file it refuses or cannot read is one
    line, without torch's advice to load it unsafely."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means an unusable file
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
        if found:
            raise ValueError(f"{path} cannot be read as plain tensors: it holds a Python object ({found.group(1)}) "
                             "that vitlab never unpickles; accepted: tensors and plain values (model.safetensors, or "
                             "torch.save of a state_dict)") from None
        raise ValueError(f"{path} {broken} ({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None


def _adapt_patch_embed(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """A checkpoint's patch-embedding kernel resampled to the model's patch size (FlexiViT's pseudo-inverse resize,
    as timm); returns the checkpoint's patch size (None for a model without a patch embedding)."""
    key = "patch_embed.proj.weight"
    own, ckpt = model.state_dict().get(key), state.get(key)
    if own is None or ckpt is None or own.ndim != 4 or ckpt.ndim != 4:
        return None
    old = tuple(ckpt.shape[-2:])
    if old != tuple(own.shape[-2:]) and own.shape[:2] == ckpt.shape[:2]:
        state[key] = resample_patch_embed(ckpt, own.shape[-2:])
    return old


def _adapt_pos_embed(model: nn.Module, state: dict[str, torch.Tensor], old_img, old_patch=None) -> None:
    """Resample a checkpoint's position embedding to the model's patch grid, bicubic, prefix tokens kept apart
    (its grid: the checkpoint's image size over the checkpoint's patch size)."""
    own = model.state_dict().get("pos_embed")
    ckpt = state.get("pos_embed")
    if own is None or ckpt is None or own.shape == ckpt.shape or own.shape[-1] != ckpt.shape[-1]:
        return
    grid = model.patch_embed.grid_size
    prefix = own.shape[1] - grid[0] * grid[1]
    n_old = ckpt.shape[1] - prefix
    patch = old_patch or model.patch_embed.patch_size
    old_grid = None
    if old_img is not None:
        h, w = to_2tuple(old_img)
        if (h // patch[0]) * (w // patch[1]) == n_old:
            old_grid = (h // patch[0], w // patch[1])
    state["pos_embed"] = resample_abs_pos_embed(ckpt, grid, old_grid, num_prefix_tokens=prefix,
                                                antialias=getattr(model, "pos_embed_antialias", True))


def _adapt_rel_pos_tables(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """BEiT's relative position tables of a checkpoint resized to the model's patch grid (another img_size) by
    timm's rule on load (models.beit.resize_rel_pos_table)."""
    own = model.state_dict()
    for key, table in list(state.items()):
        mine = own.get(key)
        if key.endswith("relative_position_bias_table") and mine is not None and mine.shape != table.shape \
                and mine.shape[1:] == table.shape[1:]:
            state[key] = resize_rel_pos_table(table, model.get_submodule(key.rsplit(".", 1)[0]).window_size)


def load_state_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load every tensor or none: missing, unexpected and mis-shaped keys are named in the error."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} (file {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
                  for k in own if k in state and state[k].shape != own[k].shape]
    problems = []
    for label, keys in (("missing tensors", missing), ("unexpected tensors", unexpected),
                        ("shape mismatches", mismatched)):
        if keys:
            problems.append(f"{label}: {', '.join(keys[:6])}" + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
    if problems:
        raise ValueError(f"{source} does not fit a {type(model).__name__}: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)


def _check_config_types(cfg: dict[str, Any], path: Path) -> None:
    """One line for a config.json whose names are not text or whose argument tables are not objects."""
    for key in ("library", "architecture", "class", "model_type"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise ValueError(f"{path}: {key!r} must be text, not {type(cfg[key]).__name__}")
    for key in ("model_args", "pretrained_cfg"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"{path}: {key!r} must be a JSON object, not {type(cfg[key]).__name__}")


def load(path: str | os.PathLike, **overrides: Any) -> nn.Module:
    """A ready model (eval mode) from a vitlab, timm or Hugging Face folder; overrides change its arguments.

    ``img_size=`` resamples the position embedding to a new input size; ``patch_size=`` resamples the patch
    embedding (FlexiViT's pseudo-inverse resize) and the position table to the new grid; ``num_classes=`` with a
    different count gives fresh, untrained heads; ``dynamic_img_size=True`` accepts any input size.
    """
    folder, cfg = read_config(path)
    _check_config_types(cfg, folder / CONFIG)
    expected_sha = None
    if cfg.get("library") == "vitlab":
        arch = cfg.get("architecture")
        cls = None if arch else model_class(cfg.get("class"), str(folder / CONFIG))
        args, preprocess = dict(cfg.get("model_args") or {}), dict(cfg.get("pretrained_cfg") or {})
        expected_sha = cfg.get("sha256")
        convert = dict
    elif timm.is_timm_config(cfg):
        arch, args, preprocess = timm.model_args(cfg)
        cls, convert = None, timm.convert_state_dict
    elif hf.is_hf_config(cfg):
        cls, args, preprocess = hf.model_args(cfg)
        preprocess.update(hf.preprocessing(folder, cfg))
        arch = None
        convert = lambda s: hf.convert_state_dict(s, cfg)
    else:
        raise ValueError(f"{folder / CONFIG} is not a model config vitlab knows: expected 'library': 'vitlab', "
                         "'architecture' (timm) or 'model_type' (Hugging Face)")
    old_img = args.get("img_size", get_spec(arch).args.get("img_size", 224) if arch else 224)
    old_classes = args.get("num_classes", get_spec(arch).args.get("num_classes", 1000) if arch else 1000)
    state = convert(read_weights(folder, expected_sha))
    args.update(overrides)
    try:
        model = create_model(arch, **args) if arch else build(cls, args)
    except (TypeError, OverflowError, RuntimeError) as e:  # a value of the wrong kind or size (text, -1)
        raise ValueError(f"{folder / CONFIG}: its model arguments do not build a model ({e})") from None
    except ValueError as e:
        if arch:
            raise
        raise no_architecture(cfg, folder, e) from None
    if not arch:
        model.arch, model.model_args = None, dict(args)
        model.pretrained_cfg = make_pretrained_cfg(model, args.get("in_chans", 3))
    new_head = "num_classes" in overrides and overrides["num_classes"] != old_classes
    if new_head:
        heads = tuple(f"{name}." for name in model.classifier_names)
        state = {k: v for k, v in state.items() if not k.startswith(heads)}
        state.update({k: v for k, v in model.state_dict().items() if k.startswith(heads)})
        preprocess.pop("label_names", None)
    # a patch size asked for (patch_size=) resamples the kernel; one the config implies by mistake stays a mismatch
    _adapt_pos_embed(model, state, old_img, _adapt_patch_embed(model, state) if "patch_size" in overrides else None)
    _adapt_rel_pos_tables(model, state)
    try:
        load_state_strict(model, state, str(folder))
    except ValueError as e:
        raise no_architecture(cfg, folder, e) from None
    preprocess.pop("input_size", None)
    model.pretrained_cfg.update(preprocess)
    return model.eval()


def no_architecture(cfg: dict[str, Any], folder: Path, e: ValueError) -> ValueError:
    """A vitlab config.json without its model's name, said as such (its class's defaults are what then failed)."""
    if cfg.get("library") != "vitlab" or cfg.get("architecture"):
        return e
    return ValueError(f"{folder / CONFIG} names no 'architecture' (accepted: a registered model name, see `vitlab "
                      f"models`); its class and model_args alone do not make the saved model: {e}")
