"""Image files (paths or bytes) decoded to uint8 arrays, one at a time or in worker processes straight into a store.

An image is converted to "L" or "RGB" and brought to the stored size by a ``fit``: ``squash`` resizes the
whole image to (H, W) (the model's size, as for CIFAR-like sets), ``crop`` resizes its shorter side to the
size and keeps the centre square (photos stored at e.g. 256x256 and cropped later), and any other
``views.Preprocess.fit`` applies that rule (``fit_image``: a model's own resize, crop and interpolation).
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps

from ..errors import VitlabError, not_a_file
from ..progress import progress_bar
from .views import INTERPOLATIONS, crop_offsets, parse_fit, resized_size

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
FITS = ("squash", "crop")  # and views.Preprocess.fit strings
RESAMPLE = {name: getattr(Image.Resampling, name.upper()) for name in INTERPOLATIONS}
MAX_WORKERS = 8
_PROGRESS_MIN = 2000  # images: show a progress bar from this many on
_POOL_MIN = 2000  # images: decode in worker processes from this many on
_CHUNK_BYTES = 16 << 20  # decoded bytes per worker task (at most _CHUNK images)
_CHUNK = 500

Payload = str | bytes


def default_workers() -> int:
    """Worker processes for decoding: the CPU count, at most MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def _as_image_mode(img: Image.Image, chans: int) -> Image.Image:
    """``img`` as 8-bit "L" (chans 1) or "RGB" (chans 3): 16-bit and float scaled, alpha composited on black."""
    mode = img.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        a = np.asarray(img).astype(np.float64)
        a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if mode == "F" and lo >= 0 and hi <= 1:
            scale, offset = 255.0, 0.0
        elif mode == "F" and lo >= 0 and hi <= 255:
            scale, offset = 1.0, 0.0
        elif lo >= 0 and hi <= 65535 and mode != "F":
            scale, offset = 255.0 / 65535.0, 0.0  # 16-bit range -> 8-bit
        else:  # values outside any standard range: stretch min..max
            scale, offset = (255.0 / (hi - lo) if hi > lo else 0.0), lo
        img = Image.fromarray(np.clip(np.rint((a - offset) * scale), 0, 255).astype(np.uint8), "L")
    elif mode == "P" or mode == "PA":
        img = img.convert("RGBA" if mode == "PA" or "transparency" in img.info else "RGB")
    elif mode == "1":
        img = img.convert("L")
    if img.mode in ("RGBA", "RGBa", "LA", "La"):
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba).convert("RGB")
    if img.mode not in ("L", "RGB"):  # CMYK, YCbCr, RGBX, HSV, ...
        img = img.convert("RGB")
    target = "L" if chans == 1 else "RGB"
    return img if img.mode == target else img.convert(target)


def _open(payload: Payload) -> Image.Image:
    return Image.open(payload if isinstance(payload, str) else io.BytesIO(payload))


def _swaps_sides(img: Image.Image) -> bool:
    """Whether the EXIF orientation turns the image by 90 degrees."""
    return img.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)


def _decode(payload: Payload, size: tuple[int, int] | None, chans: int, fit: str = "squash") -> np.ndarray:
    """One image file (path or bytes) as a uint8 (H, W, C) array; raises whatever Pillow raises."""
    with _open(payload) as img:
        img.load()
        if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            img = ImageOps.exif_transpose(img)
        img = _as_image_mode(img, chans)
        if size is not None:
            img = fit_image(img, tuple(size), fit)
        arr = np.asarray(img, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


def fit_image(img: Image.Image, size: tuple[int, int], fit: str = "squash") -> Image.Image:
    """A Pillow image brought to (H, W) = ``size`` by ``fit`` (see the module's docstring): resized whole, then
    the centre kept, as torchvision's Resize and CenterCrop do it on Pillow images (timm's and transformers' way)."""
    if fit == "crop":
        w, h = img.size
        side = min(w, h)
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        return img.resize((size[1], size[0]), Image.Resampling.BICUBIC, box=box)
    crop_mode, crop_pct, interpolation, offset = parse_fit(fit)
    rh, rw = resized_size((img.size[1], img.size[0]), size, crop_mode, crop_pct)
    if (rw, rh) != img.size:
        img = img.resize((rw, rh), RESAMPLE[interpolation])
    if (rh, rw) != tuple(size):
        top, left = crop_offsets((rh, rw), size, offset)
        img = img.crop((left, top, left + size[1], top + size[0]))
    return img


def decode_image(payload: Payload, size: tuple[int, int] | None, chans: int, fit: str = "squash") -> np.ndarray | None:
    """One image file as a uint8 (H, W, C) array, or None when it cannot be read."""
    try:
        return _decode(payload, size, chans, fit)
    except Exception:  # noqa: BLE001 - any decoder failure means an unreadable file, which is skipped
        return None


def image_size(payload: Payload) -> tuple[int, int] | None:
    """(height, width) of an image file as decoded (EXIF orientation applied) from its header, or None."""
    try:
        with _open(payload) as img:
            w, h = img.size
            return (w, h) if _swaps_sides(img) else (h, w)
    except Exception:  # noqa: BLE001 - an unreadable header means an unreadable file
        return None


def too_large(payload: Payload) -> str | None:
    """Why an image file is refused for its size (its sides and Pillow's decompression-bomb limit, read from its
    header alone: nothing is decoded), or None when its size is not the reason."""
    limit = Image.MAX_IMAGE_PIXELS
    if not limit:
        return None
    try:
        Image.MAX_IMAGE_PIXELS = None  # the header only: the size is read, no pixel
        with _open(payload) as img:
            w, h = img.size
    except Exception:  # noqa: BLE001 - a header Pillow cannot read: unreadable for another reason
        return None
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    if w * h <= 2 * limit:  # Pillow refuses above twice its MAX_IMAGE_PIXELS (and warns above it)
        return None
    return f"{w}x{h} pixels ({w * h / 1e6:.0f} M), over Pillow's decompression-bomb limit of {2 * limit / 1e6:.0f} M " \
        "pixels"


def read_image(path: str | os.PathLike, img_size: int | tuple[int, int] | None = None,
               in_chans: int = 3, fit: str = "squash") -> torch.Tensor:
    """One image file as uint8 (C, H, W), converted and resized exactly as load_data does for image folders
    (``fit``: squash, or a ``views.Preprocess.fit``: a model's own rule)."""
    if isinstance(img_size, int) and not isinstance(img_size, bool):
        img_size = (img_size, img_size)
    if img_size is not None and not (isinstance(img_size, (tuple, list)) and len(img_size) == 2
                                     and all(isinstance(s, int) and s > 0 for s in img_size)):
        raise VitlabError(f"img_size must be a positive int or a (height, width) pair of them, got {img_size!r}")
    if in_chans not in (1, 3) or isinstance(in_chans, bool):
        raise VitlabError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {in_chans!r}")
    path = Path(path)
    if not path.is_file():
        raise not_a_file(path, "image", f"an image file ({' '.join(IMAGE_EXTENSIONS)})")
    try:
        arr = _decode(str(path), tuple(img_size) if img_size else None, in_chans, fit)
    except Exception as e:  # noqa: BLE001 - report any decoder failure as an unreadable file
        big = too_large(str(path)) if isinstance(e, Image.DecompressionBombError) else None
        if big:
            raise VitlabError(f"{path} is {big}; accepted: images of at most {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} M "
                              "pixels") from None
        raise VitlabError(f"{path} is not an image Pillow can read ({type(e).__name__}: {e}); accepted: "
                          f"{' '.join(IMAGE_EXTENSIONS)}") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def _die_with_parent() -> None:
    """Make this worker process end when the process that started it does (Linux), e.g. on SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _decode_rows(job: tuple) -> list[int]:
    """Decode payloads into rows ``start...`` of a (N, C, H, W) uint8 array file; returns the unreadable rows."""
    path, shape, start, payloads, chans, fit = job
    rows = np.memmap(path, np.uint8, "r+", shape=shape)
    size = shape[2:]
    bad = []
    for i, p in enumerate(payloads):
        a = decode_image(p, size, chans, fit)
        if a is None or a.shape[:2] != size:
            bad.append(start + i)
            rows[start + i] = 0
        else:
            rows[start + i] = a.transpose(2, 0, 1)
    rows.flush()
    del rows
    return bad


def decode_into(path: Path, shape: tuple[int, int, int, int], payloads: Iterable[Payload], start: int, fit: str,
                workers: int, desc: str, done: Callable[[int, list[int]], None]) -> None:
    """Decode the images of rows ``start``..N-1 into the array file at ``path`` (N, C, H, W), in order.

    Chunks go to ``workers`` processes (fewer than 2, or few images: this process) that write their
    rows into the file themselves; ``done(rows, bad)`` is called as each chunk completes, in row
    order, with the number of rows now complete and the unreadable ones among the chunk's.
    """
    n, chans = shape[0], shape[1]
    row_bytes = int(np.prod(shape[1:]))
    chunk = max(1, min(_CHUNK, _CHUNK_BYTES // max(row_bytes, 1)))
    pool = None
    if workers > 1 and n - start >= _POOL_MIN:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(method), initializer=_die_with_parent)
    jobs: list[tuple[int, Future | tuple]] = []

    def finish(job: tuple[int, Future | tuple]) -> None:
        end, j = job
        bad = j.result() if isinstance(j, Future) else _decode_rows(j)
        bar.update(end - bar.n)
        done(end, bad)

    it = iter(payloads)
    try:
        with progress_bar(total=n, initial=start, desc=desc, unit="img", disable=n - start < _PROGRESS_MIN) as bar:
            for lo in range(start, n, chunk):
                hi = min(lo + chunk, n)
                batch = [next(it) for _ in range(hi - lo)]
                job = (str(path), shape, lo, batch, chans, fit)
                jobs.append((hi, pool.submit(_decode_rows, job) if pool is not None else job))
                while jobs and (pool is None or len(jobs) > 2 * workers or jobs[0][1].done()):
                    finish(jobs.pop(0))
            while jobs:
                finish(jobs.pop(0))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
