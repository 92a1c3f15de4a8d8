"""A frozen model's pre-logits features of a set of uint8 images, computed once and cached on disk.

The cache is one safetensors file per (weights, images, preprocessing): the weights' and the
images' content hashes and every preprocessing setting make its name, so changed weights, other
images or another normalisation compute afresh, and the same request reads the file back. The file
carries the sha256 of its features, checked on every read: features changed on disk are computed again.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic import atomic_path
from ..data.augment import normalize
from ..data.owned import make_owned_folder
from ..data.views import eval_view
from ..devices import to_device
from ..errors import VitlabError
from ..finite import check_finite
from ..progress import progress_bar

CACHE_FORMAT = 2  # 2: the features' sha256 in the file's metadata
PRECISIONS = ("fp32", "bf16")


def weights_hash(model: nn.Module) -> str:
    """A content hash of the model's state (parameters and buffers, with their names, dtypes and shapes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def images_hash(images: torch.Tensor | np.ndarray, rows: int = 256) -> str:
    """A content hash of a uint8 (N, C, H, W) image array, read ``rows`` images at a time."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(images.shape)};".encode())
    for i in range(0, len(images), rows):
        chunk = images[i:i + rows]
        chunk = chunk.cpu().numpy() if isinstance(chunk, torch.Tensor) else chunk
        h.update(np.ascontiguousarray(chunk))
    return h.hexdigest()


def features_sha256(feats: torch.Tensor) -> str:
    """The sha256 of a features tensor's shape, dtype and bytes: what the cache file carries to be checked on read."""
    feats = feats.detach().cpu().contiguous()
    h = hashlib.sha256(f"{feats.dtype}:{tuple(feats.shape)};".encode())
    h.update(feats.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _as_uint8_images(images) -> torch.Tensor:
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)  # a memory-mapped store stays mapped: rows are read per batch
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        got = f"{images.dtype} {tuple(images.shape)}" if hasattr(images, "shape") else type(images).__name__
        raise TypeError(f"expected uint8 images of shape (N, C, H, W), got {got}")
    return images


def preprocessing(model: nn.Module, images: torch.Tensor, mean: Sequence[float] | None,
                  std: Sequence[float] | None, size: Sequence[int] | None, crop_pct: float) -> dict:
    """What the model sees: mean, std, input size (the model's own by default) and crop_pct."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    mean = mean if mean is not None else cfg.get("mean")
    std = std if std is not None else cfg.get("std")
    if mean is None or std is None:
        raise VitlabError(f"{type(model).__name__} carries no mean/std in pretrained_cfg: pass mean= and std=")
    if size is None:
        size = cfg["input_size"][1:] if "input_size" in cfg else images.shape[-2:]
    return {"mean": [float(m) for m in mean], "std": [float(s) for s in std], "size": [int(s) for s in size],
            "crop_pct": float(crop_pct)}


def _read_cache(path: Path, n: int, log: Callable[[str], None]) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        # a copy in memory of torch's own alignment: the file's bytes start anywhere, and CPU kernels sum in
        # another order on unaligned rows, so a probe on read features could flip an image a computed run did not
        with safe_open(str(path), "pt") as f:
            feats, stored = f.get_tensor("features").clone(), (f.metadata() or {}).get("sha256")
    except (SafetensorError, KeyError, OSError, RuntimeError) as e:
        log(f"feature cache {path} is unreadable ({e}); computing the features again")
        return None
    if stored != features_sha256(feats):
        log(f"feature cache {path} does not match its checksum (changed since it was written); computing the "
            "features again")
        return None
    if feats.dim() != 2 or len(feats) != n:
        log(f"feature cache {path} holds {tuple(feats.shape)} features for {n} images; computing them again")
        return None
    return feats


@torch.no_grad()  # not inference_mode: the features stay usable in autograd (a probe trained on them)
def _compute(model: nn.Module, images: torch.Tensor, batch_size: int, device: torch.device, prep: dict,
             precision: str, progress: bool) -> torch.Tensor:
    size = tuple(prep["size"])
    bar = progress_bar(total=len(images), unit="img", desc="features", disable=not progress)
    chunks = []
    for i in range(0, len(images), batch_size):
        batch = to_device(images[i:i + batch_size], device)
        if tuple(batch.shape[-2:]) != size or prep["crop_pct"] < 1:
            batch = eval_view(batch, size, prep["crop_pct"])
        x = normalize(batch, prep["mean"], prep["std"])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            feats = model.forward_head(model.forward_features(x), pre_logits=True)  # (B, D)
        chunks.append(feats.float().cpu())
        bar.update(len(batch))
    bar.close()
    return torch.cat(chunks) if chunks else torch.zeros(0, getattr(model, "num_features", 0))


def extract_features(model: nn.Module, images: torch.Tensor | np.ndarray, batch_size: int = 256,
                     device: str | torch.device | None = None, progress: bool = True, *,
                     mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                     size: Sequence[int] | None = None, crop_pct: float = 1.0, precision: str = "fp32",
                     cache_dir: str | os.PathLike | None = None, data_id: str | None = None,
                     log: Callable[[str], None] = lambda s: None, source: object = "the model") -> torch.Tensor:
    """Pre-logits features (N, D) float32 on the CPU: ``forward_head(forward_features(x), pre_logits=True)``.

    ``images`` are uint8 (N, C, H, W) (a tensor, or a memory-mapped store's array, read a batch at a
    time); each batch is resized and centre-cropped to ``size`` when it differs or ``crop_pct`` < 1
    (``data.views.eval_view``), then normalised. ``mean``, ``std`` and ``size`` default to the model's
    ``pretrained_cfg``. With ``cache_dir`` the features are read from / written to
    ``features-<key>.safetensors`` there; ``data_id`` names the images' content (e.g. a store's
    fingerprint) instead of hashing them. The model runs in eval mode on ``device`` (its own by
    default) and gets its mode and device back. Features that hold a NaN or an Inf are refused (ValueError naming
    ``source``), never cached.
    """
    images = _as_uint8_images(images)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise VitlabError(f"batch_size must be a positive int, got {batch_size!r}")
    if precision not in PRECISIONS:
        raise VitlabError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    prep = preprocessing(model, images, mean, std, size, crop_pct)
    path = None
    if cache_dir is not None:
        key = {"format": CACHE_FORMAT, "model": type(model).__name__, "weights": weights_hash(model),
               "images": data_id or images_hash(images), "n": len(images), "precision": precision, **prep}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"features-{digest}.safetensors"
        cached = _read_cache(path, len(images), log)
        if cached is not None:
            log(f"features of {len(images)} images read from {path}")
            return cached
    first = next(model.parameters(), None)
    home = first.device if first is not None else torch.device("cpu")
    device = torch.device(device) if device is not None else home
    was_training = model.training
    model.to(device).eval()
    try:
        feats = _compute(model, images, batch_size, device, prep, precision, progress)
    finally:
        model.to(home).train(was_training)
    check_finite(feats, len(feats), "features", source)
    if path is not None:
        try:
            make_owned_folder(path.parent, "features")
            with atomic_path(path) as tmp:
                save_file({"features": feats.contiguous()}, str(tmp),
                          metadata={"key": json.dumps(key, sort_keys=True), "sha256": features_sha256(feats)})
        except (OSError, ValueError) as e:  # a cache that takes no writes (read-only, full): computed, not kept
            log(f"features not cached: {path.parent} cannot be written ({getattr(e, 'strerror', None) or e})")
            return feats
        log(f"features of {len(images)} images cached in {path}")
    return feats
