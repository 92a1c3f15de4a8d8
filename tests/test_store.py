"""vitlab.data's store: mapped not copied, resumable after a kill, checked on open; storage vs training size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import quiet_load
from PIL import Image

from vitlab.data import eval_view, load_data
from vitlab.data.augment import AugmentConfig, BatchAugment
from vitlab.data.store import open_store


def make_images(root, classes=("a", "b", "c"), per_class=10, size=(6, 7)):
    """PNG files whose pixel (0, 0) holds a unique id (1, 2, ...) and the rest 40 * (class index + 1)."""
    next_id = 1
    for ci, cls in enumerate(classes):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = np.full((*size, 3), 40 * (ci + 1), np.uint8)
            arr[0, 0] = next_id
            Image.fromarray(arr).save(root / cls / f"{i:03d}.png")
            next_id += 1
    return root


def the_store(cache):
    (path,) = [p for p in cache.iterdir() if not p.name.startswith(".") and not p.name.endswith(".partial")]
    return path


def mapped_files():
    """The files this process has mapped, by their address ranges."""
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6:
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            out.append((lo, hi, parts[5]))
    return out


def test_images_are_mapped_from_the_store_not_copied(tmp_path):
    b, _ = quiet_load(str(make_images(tmp_path / "pets")), cache_dir=tmp_path / "c")
    images_file = str(b.store / "images.u8")
    for split in (b.train, b.test):
        ptr = split.images.data_ptr()
        assert any(lo <= ptr < hi and name == images_file for lo, hi, name in mapped_files())
    assert b.train.images.dtype == torch.uint8 and b.train.images.is_contiguous()
    idx = torch.tensor([3, 0, 7])
    batch = b.train.images[idx]  # a gather is a copy of the rows asked for
    assert torch.equal(batch[1], b.train.images[0]) and batch.data_ptr() != b.train.images.data_ptr()
    assert b.train.images.to("cpu").data_ptr() == b.train.images.data_ptr()
    header = json.loads((b.store / "header.json").read_text())
    assert header["shape"] == [30, 3, 6, 7] and header["n_train"] == len(b.train.labels) == 24
    assert header["format"] == 1 and header["classes"] == ["a", "b", "c"] and len(header["fingerprint"]) == 64


_KILLER = textwrap.dedent("""
    import os, signal, sys
    from vitlab.data import decode, load_data, store
    decode._CHUNK = 4
    decode._POOL_MIN = 1
    where, after = sys.argv[4], int(sys.argv[5])
    if where == "decode":  # die after a few chunks are recorded as done
        real, calls = store.atomic_write_json, []
        def write(path, obj):
            real(path, obj)
            calls.append(1)
            if len(calls) > after:
                os.kill(os.getpid(), signal.SIGKILL)
        store.atomic_write_json = write
    else:  # die half way through putting the rows in split order
        def reorder(src, dest, shape, order):
            with open(dest, "wb") as f:
                f.write(b"x" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
        store._reorder = reorder
    load_data(sys.argv[1], cache_dir=sys.argv[2], workers=int(sys.argv[3]), log=lambda s: None)
""")


@pytest.mark.slow
@pytest.mark.parametrize("workers, where", [(1, "decode"), (2, "decode"), (1, "reorder")])
def test_a_killed_build_resumes_to_the_same_store(tmp_path, workers, where):
    root = make_images(tmp_path / "pets")
    (root / "b" / "bad.png").write_bytes(b"not a png")
    proc = subprocess.run([sys.executable, "-c", _KILLER, str(root), str(tmp_path / "c"), str(workers), where, "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert not [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".") and
                not p.name.endswith(".partial")]  # nothing that looks complete
    resumed, logs = quiet_load(str(root), cache_dir=tmp_path / "c", workers=workers)
    if where == "decode":
        assert any("resuming the unfinished build" in line and "of 31" in line for line in logs)
    whole, _ = quiet_load(str(root), cache_dir=tmp_path / "whole", workers=1)
    for split in ("train", "test"):
        assert torch.equal(getattr(resumed, split).images, getattr(whole, split).images)
        assert torch.equal(getattr(resumed, split).labels, getattr(whole, split).labels)
    assert resumed.skipped == whole.skipped == 1
    a, b = the_store(tmp_path / "c"), the_store(tmp_path / "whole")
    for f in ("images.u8", "labels.npy"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    ha, hb = (json.loads((p / "header.json").read_text()) for p in (a, b))
    assert ha == hb and ha["unreadable"] == ["b/bad.png"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")) == [a.name]


def test_truncated_foreign_and_stale_stores_are_errors_that_name_them(tmp_path):
    b, _ = quiet_load(str(make_images(tmp_path / "pets")), cache_dir=tmp_path / "c")
    store = b.store
    assert open_store(store).images.shape == (30, 3, 6, 7)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        open_store(store, key="0123")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "header.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match=rf"{foreign} is not a usable vitlab image store: .* not a vitlab store"):
        load_data(str(foreign))
    header = json.loads((store / "header.json").read_text())
    (store / "header.json").write_text(json.dumps(dict(header, format=99)))
    with pytest.raises(ValueError, match="store format 99"):
        load_data(str(store))
    (store / "header.json").write_text(json.dumps(header))
    labels = store / "labels.npy"
    labels.write_bytes(labels.read_bytes()[:-8])
    with pytest.raises(ValueError, match=rf"{labels.name} is unreadable"):
        load_data(str(store))


def test_storage_size_apart_from_training_size(tmp_path):
    root = tmp_path / "wide"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            arr = np.zeros((10, 20, 3), np.uint8)  # H=10, W=20: the centre 10x10 is 200, the sides 30 and 60
            arr[:, :5], arr[:, 5:15], arr[:, 15:] = 30, 200, 60
            Image.fromarray(arr).save(root / cls / f"{i}.png")
    b, logs = quiet_load(str(root), cache_dir=tmp_path / "c", store_size=16, img_size=12, val_fraction=0.25)
    assert b.stored_size == (16, 16) and b.img_size == (12, 12)
    assert b.train.images.shape == (6, 3, 16, 16) and b.test.images.shape == (2, 3, 16, 16)
    assert (b.train.images[..., 2:-2] == 200).all()  # shorter side to 16, centre square kept (edges: bicubic)
    assert "3x16x16, training at 12x12" in logs[-1]
    squashed, _ = quiet_load(str(root), cache_dir=tmp_path / "c", img_size=12, val_fraction=0.25)
    assert squashed.stored_size == squashed.img_size == (12, 12) and (squashed.train.images == 30).any()
    # training: random resized crops of the stored images at the training size
    aug = BatchAugment(AugmentConfig(crop="rrc", auto_augment="none", random_erasing=0.0, mixup=0.0,
                                     cutmix=0.0), b.img_size, b.mean, b.std, len(b.classes))
    x, y = aug(b.train.images[torch.arange(4)], b.train.labels[:4])
    assert x.shape == (4, 3, 12, 12) and y.shape == (4, 2)
    # evaluation: resize the shorter side to 12 / 0.875 = 13 and take the centre 12x12
    view = eval_view(b.test.images, b.img_size)
    assert view.shape == (2, 3, 12, 12) and view.dtype == torch.uint8 and (view[..., 3:-3] == 200).all()
    # tensor sources too
    digits, _ = quiet_load("digits", cache_dir=tmp_path / "c", store_size=10, img_size=8)
    assert digits.train.images.shape[1:] == (1, 10, 10) and digits.img_size == (8, 8)


def test_eval_view_is_timms_resize_and_centre_crop():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, 3, 8, 8)
    assert torch.equal(eval_view(x, 8, crop_pct=1.0), x)
    assert torch.equal(eval_view(x, 7), x[:, :, 0:7, 0:7])  # floor(7 / 0.875) = 8: no resize, crop 7 of 8
    assert torch.equal(eval_view(x, 6, crop_pct=0.75), x[:, :, 1:7, 1:7])
    wide = torch.zeros(1, 1, 16, 32, dtype=torch.uint8)
    wide[..., 8:24] = 255
    out = eval_view(wide, 14)  # shorter side to 16 (no resize), centre 14x14 of the middle
    assert out.shape == (1, 1, 14, 14) and (out == 255).all()
    small = eval_view(wide, 7)  # shorter side to 8: 8x16, then the centre 7x7
    assert small.shape == (1, 1, 7, 7) and int(small[..., 3, 3]) == 255
    assert eval_view(wide, (4, 6)).shape == (1, 1, 4, 6)
    with pytest.raises(ValueError, match="crop_pct"):
        eval_view(x, 7, crop_pct=0)
    with pytest.raises(TypeError, match="uint8"):
        eval_view(x.float(), 7)


@pytest.mark.slow
def test_two_processes_building_at_once_share_one_store(tmp_path):
    root = make_images(tmp_path / "pets")
    code = ("import sys; from vitlab.data import load_data; "
            "b = load_data(sys.argv[1], cache_dir=sys.argv[2], workers=1, log=lambda s: None); print(b.store)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), str(tmp_path / "c")], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1]
    assert [p.name for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")] == [os.path.basename(outs[0])]
