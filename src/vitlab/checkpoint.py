"""vitlab.load and vitlab.save: model folders of config.json + model.safetensors.

``load`` reads vitlab's own folders, timm Hub exports and Hugging Face ViT/DeiT folders, local or
by Hub id (``hf-hub:org/name[@revision]``, through huggingface_hub's cache). It
never unpickles: weights come from safetensors (or, for old Hub folders, ``torch.load`` with
``weights_only=True``), and every tensor must find its place, shape for shape.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import math
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
from .errors import NotFoundError, VitlabError
from .interop import hf, hub, timm
from .models.base import make_pretrained_cfg
from .models.beit import resize_rel_pos_table
from .models.groups import patch_embedding
from .models.layers import resample_abs_pos_embed, resample_patch_embed, to_2tuple
from .models.registry import build, check_model, create_model, get_spec, model_class
from .text import quote

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
    embed = patch_embedding(model)
    if embed is not None:  # an int stays one while it says the same
        same = isinstance(args.get("img_size"), int) and (args["img_size"],) * 2 == tuple(embed.img_size)
        args["img_size"] = args["img_size"] if same else list(embed.img_size)
    return args


def save(model: nn.Module, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` to a folder as config.json + model.safetensors that vitlab.load reads.

    Example::

        vitlab.save(result.model, "my_vit")           # a folder: config.json and model.safetensors
    """
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


def no_loop(path: Path) -> Path:
    """``path``, refused in one line when it is a symbolic link that leads back to itself (a loop, which
    ``is_file`` and ``exists`` would call missing) or to nothing."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise VitlabError(f"{path} is a symlink loop (it leads back to itself); accepted: a file, or a link to "
                              "one") from None
        if path.is_symlink():
            raise VitlabError(f"{path} is a symlink to {os.readlink(path)}, which does not exist; accepted: a file, "
                              "or a link to one") from None
    return path


def _shards(index: Path) -> list[str]:
    """The shard files a model.safetensors.index.json names (its weight_map's values), each a file of the folder."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) and v and "/" not in v and v not in (".", "..") for v in weight_map.values()):
        raise VitlabError(f"{index}: 'weight_map' is {quote(weight_map) if weight_map is not None else 'missing'}; "
                          "accepted: an object mapping each tensor name to a shard file of the folder")
    return sorted(set(weight_map.values()))


def read_model_config(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(folder, parsed config.json) for a model folder, its config.json or a Hub id."""
    p = resolve(path)
    folder = no_loop(p.parent if p.name == CONFIG else p)
    if not folder.exists():
        raise NotFoundError(f"no model at {folder}: expected a folder with {CONFIG} and {WEIGHTS}")
    cfg_path = no_loop(folder / CONFIG)
    if not cfg_path.is_file():
        raise NotFoundError(f"{folder} has no {CONFIG}; a model folder holds {CONFIG} and {WEIGHTS} "
                            "(written by vitlab.save, timm's save_for_hf or transformers' save_pretrained)")
    return folder, read_json_object(cfg_path)


def files_sha256(path: str | os.PathLike) -> dict[str, str]:
    """The sha256 of every file ``load`` reads from a model folder (config.json, its weights, a transformers folder's
    preprocessing), by file name: what a run records of a model it starts from or learns from."""
    folder, _ = read_model_config(path)
    names = [CONFIG, WEIGHTS, "model.safetensors.index.json", "pytorch_model.bin", hf.PREPROCESSOR]
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / WEIGHTS).is_file():
        try:
            names += _shards(index)
        except ValueError:
            pass  # the load says what is wrong with the index
    return {name: _sha256(folder / name) for name in names if (folder / name).is_file()}


def read_weights(folder: Path, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a folder: model.safetensors (or a sharded index, or pytorch_model.bin without pickle code)."""
    st = no_loop(folder / WEIGHTS)
    if st.is_file():
        if expected_sha256 and _sha256(st) != expected_sha256:
            raise VitlabError(f"{st} is corrupt or was changed: its sha256 does not match the one in {CONFIG}")
        try:
            return load_file(st)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise VitlabError(f"{st} is truncated or corrupt ({e})") from None
    index = folder / "model.safetensors.index.json"
    if no_loop(index).is_file():
        state: dict[str, torch.Tensor] = {}
        for shard in _shards(index):
            try:
                state.update(load_file(no_loop(folder / shard)))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise VitlabError(f"{folder / shard} is missing, truncated or corrupt ({e})") from None
        return state
    pt = no_loop(folder / "pytorch_model.bin")
    if pt.is_file():
        return load_plain(pt, "cannot be read as plain tensors")
    raise NotFoundError(f"{folder} has no weights: expected {WEIGHTS}")


def load_plain(path: Path, broken: str = "is truncated or corrupt") -> Any:
    """torch.load of tensors and plain values only (nothing unpickled runs); a file it refuses or cannot read is one
    line, without torch's advice to load it unsafely."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means an unusable file
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
        if found:
            raise VitlabError(f"{path} cannot be read as plain tensors: it holds a Python object ({found.group(1)}) "
                              "that vitlab never unpickles; accepted: tensors and plain values (model.safetensors, or "
                              "torch.save of a state_dict)") from None
        raise VitlabError(f"{path} {broken} ({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None


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
    grid = patch_embedding(model).grid_size
    prefix = own.shape[1] - grid[0] * grid[1]
    n_old = ckpt.shape[1] - prefix
    patch = old_patch or patch_embedding(model).patch_size
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


def state_problems(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    """The missing, unexpected and mis-shaped tensors of ``state`` against a model's own (its state_dict), in
    words ("" when every tensor finds its place)."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} (file {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
                  for k in own if k in state and state[k].shape != own[k].shape]
    problems = []
    for label, keys in (("missing tensors", missing), ("unexpected tensors", unexpected),
                        ("shape mismatches", mismatched)):
        if keys:
            problems.append(f"{label}: {', '.join(keys[:6])}" + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
    return "; ".join(problems)


def load_state_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load every tensor or none: missing, unexpected and mis-shaped keys are named in the error."""
    problems = state_problems(model.state_dict(), state)
    if problems:
        raise VitlabError(f"{source} does not fit a {type(model).__name__}: {problems}")
    model.load_state_dict(state, strict=True)


def _check_config_types(cfg: dict[str, Any], path: Path) -> None:
    """One line for a config.json whose names are not text or whose argument tables are not objects."""
    for key in ("library", "architecture", "class", "model_type"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise VitlabError(f"{path}: {key!r} must be text, not {type(cfg[key]).__name__}")
    for key in ("model_args", "pretrained_cfg"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise VitlabError(f"{path}: {key!r} must be a JSON object, not {type(cfg[key]).__name__}")


def _kind(cfg: dict[str, Any], folder: Path) -> tuple[str | None, Any, dict, dict, Any, str | None]:
    """(registered name, class, model arguments, preprocessing, state-dict converter, expected sha256) of a vitlab,
    timm or Hugging Face config.json."""
    if cfg.get("library") == "vitlab":
        arch = cfg.get("architecture")
        cls = None if arch else model_class(cfg.get("class"), str(folder / CONFIG))
        return arch, cls, dict(cfg.get("model_args") or {}), dict(cfg.get("pretrained_cfg") or {}), dict, \
            cfg.get("sha256")
    try:  # another library's config translated: a field of the wrong kind is one line naming the file
        if timm.is_timm_config(cfg):
            arch, args, preprocess = timm.model_args(cfg)
            return arch, None, args, preprocess, timm.convert_state_dict, None
        if hf.is_hf_config(cfg):
            cls, args, preprocess = hf.model_args(cfg)
            preprocess.update(hf.preprocessing(folder, cfg))
            return None, cls, args, preprocess, lambda s: hf.convert_state_dict(s, cfg), None
    except ValueError as e:  # named with its file, once
        raise VitlabError(str(e) if str(folder) in str(e) else f"{folder / CONFIG}: {e}") from None
    except KeyError as e:
        raise VitlabError(f"{folder / CONFIG} has no {e} field, which its model type needs") from None
    except (TypeError, AttributeError, OverflowError) as e:
        raise VitlabError(f"{folder / CONFIG}: a field holds a value of the wrong kind ({e}); accepted: the "
                          "config.json its library writes") from None
    raise VitlabError(f"{folder / CONFIG} is not a model config vitlab knows: expected 'library': 'vitlab', "
                      "'architecture' (timm) or 'model_type' (Hugging Face)")


def _build(arch: str | None, cls: Any, args: dict[str, Any], cfg: dict[str, Any], folder: Path) -> nn.Module:
    """The model the config's arguments describe (on torch's current default device: "meta" builds no tensor)."""
    try:
        return create_model(arch, **args) if arch else build(cls, args)
    except (TypeError, OverflowError, RuntimeError) as e:  # a value of the wrong kind or size (text, -1)
        raise VitlabError(f"{folder / CONFIG}: its model arguments do not build a model ({e})") from None
    except ValueError as e:
        if arch:
            raise
        raise no_architecture(cfg, folder, e) from None


# torch.nn.init's in-place initialisers (nn.Linear's reset_parameters and the models' init_weights call them)
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def random_init_skipped():
    """Build models without drawing their initial weights (torch.nn.init's initialisers leave the tensor as it is),
    for a model whose every parameter and buffer a strict load then overwrites: a ViT-B/16's draws took three
    quarters of loading its folder. It sets torch.nn.init's functions for the time of the block (a model built in
    another thread meanwhile would be left undrawn too), as transformers does when it loads a checkpoint."""
    saved = {name: getattr(nn.init, name) for name in INITIALISERS}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _size(tensors) -> str:
    n = sum(t.numel() for t in tensors)
    return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def load(path: str | os.PathLike, **overrides: Any) -> nn.Module:
    """A ready model (eval mode) from a vitlab, timm or Hugging Face folder; overrides change its arguments.

    ``img_size=`` resamples the position embedding to a new input size; ``patch_size=`` resamples the patch
    embedding (FlexiViT's pseudo-inverse resize) and the position table to the new grid; ``num_classes=`` with a
    different count gives fresh, untrained heads; ``dynamic_img_size=True`` accepts any input size. The model the
    config describes is first built on the meta device (no memory) and held to the weights' tensors, so a config
    that disagrees with its weights (a depth or width far beyond them) is refused before anything is allocated.

    Example::

        model = vitlab.load("my_vit")                 # or a run folder, a timm or Hugging Face folder
        bigger = vitlab.load("my_vit", img_size=64)   # the position table resampled to 64x64
    """
    folder, cfg = read_model_config(path)
    _check_config_types(cfg, folder / CONFIG)
    arch, cls, args, preprocess, convert, expected_sha = _kind(cfg, folder)
    old_img = args.get("img_size", get_spec(arch).args.get("img_size", 224) if arch else 224)
    old_classes = args.get("num_classes", get_spec(arch).args.get("num_classes", 1000) if arch else 1000)
    state = convert(read_weights(folder, expected_sha))
    args.update(overrides)
    with torch.device("meta"), random_init_skipped():  # shapes only (a first draw on meta imports seconds of torch)
        shell = _build(arch, cls, args, cfg, folder)
    heads = tuple(f"{name}." for name in shell.classifier_names)
    new_head = "num_classes" in overrides and overrides["num_classes"] != old_classes
    if new_head:  # fresh heads: the file's are dropped, the model's own kept
        state = {k: v for k, v in state.items() if not k.startswith(heads)}
        preprocess.pop("label_names", None)
    # a patch size asked for (patch_size=) resamples the kernel; one the config implies by mistake stays a mismatch
    _adapt_pos_embed(shell, state, old_img, _adapt_patch_embed(shell, state) if "patch_size" in overrides else None)
    _adapt_rel_pos_tables(shell, state)
    own = {k: v for k, v in shell.state_dict().items() if not (new_head and k.startswith(heads))}
    problems = state_problems(own, state)
    if problems:
        raise no_architecture(cfg, folder, VitlabError(
            f"{folder} does not fit a {type(shell).__name__}: {folder / CONFIG} describes {_size(own.values())} "
            f"values, its weights hold {_size(state.values())}; {problems}"))
    with contextlib.nullcontext() if new_head else random_init_skipped():  # a new head needs its own draw
        model = _build(arch, cls, args, cfg, folder)
    if not arch:
        model.arch, model.model_args = None, dict(args)
        model.pretrained_cfg = make_pretrained_cfg(model, args.get("in_chans", 3))
    if new_head:
        state.update({k: v for k, v in model.state_dict().items() if k.startswith(heads)})
    load_state_strict(model, state, str(folder))
    preprocess.pop("input_size", None)
    check_preprocess(preprocess, model, folder / CONFIG)
    model.pretrained_cfg.update(preprocess)
    return model.eval()


def _numbers(value: Any) -> list[float] | None:
    """A list of finite numbers, or None when ``value`` is not one (text, nested lists, NaN, true)."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    return [float(v) for v in value] if ok else None


def check_preprocess(preprocess: dict[str, Any], model: nn.Module, where: Path) -> None:
    """One line naming the file and the field for a mean or std that would make the input NaN or Inf (std 0, text,
    of another channel count) and for label names that are not one per class.

    A one-channel model's statistic given once per RGB channel, the three values the same (Hugging Face's processors
    save [0.5, 0.5, 0.5] whatever the model's channels), is that value: the one statistic it can apply. Three values
    that differ cannot be applied to one channel and are refused."""
    chans = model.pretrained_cfg["input_size"][0]
    source = preprocess.get("preprocess_from")
    where = source if isinstance(source, str) and source.endswith(".json") else where
    for key in ("mean", "std"):
        if key not in preprocess:
            continue
        values = _numbers(preprocess[key])
        if values is not None and chans == 1 and len(values) == 3 and len(set(values)) == 1:
            preprocess[key] = (values[0],)
            values = [values[0]]
        if values is None or len(values) not in (1, chans) or (key == "std" and min(values) <= 0):
            each = ", each > 0" if key == "std" else ""
            rgb = " or 3 equal ones (one per RGB channel)" if chans == 1 else ""
            raise VitlabError(f"{where}: pretrained_cfg {key} is {quote(preprocess[key])}; accepted: {chans} finite "
                              f"number{'s' if chans > 1 else ''} (one per input channel){rgb}{each}")
    names = preprocess.get("label_names")
    if names and model.num_classes and (not isinstance(names, (list, tuple)) or len(names) != model.num_classes
                                        or not all(isinstance(n, str) for n in names)):
        got = f"{len(names)} names" if isinstance(names, (list, tuple)) else quote(names)
        raise VitlabError(f"{where}: pretrained_cfg label_names holds {got} for a model of {model.num_classes} "
                          f"classes; accepted: {model.num_classes} names (text), one per class, or none")


def no_architecture(cfg: dict[str, Any], folder: Path, e: ValueError) -> ValueError:
    """A vitlab config.json without its model's name, said as such (its class's defaults are what then failed)."""
    if cfg.get("library") != "vitlab" or cfg.get("architecture"):
        return e
    return VitlabError(f"{folder / CONFIG} names no 'architecture' (accepted: a registered model name, see `vitlab "
                       f"models`); its class and model_args alone do not make the saved model: {e}")
