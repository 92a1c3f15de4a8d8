"""vitlab.data: built-in digits, image folders and archives, CIFAR python batches, downloads and the store cache."""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
from conftest import quiet_load
from PIL import Image

from vitlab.data import (
    DATASETS,
    DataBundle,
    ImageSet,
    cifar,
    decode,
    default_cache_dir,
    download_url,
    load_data,
    read_image,
    sources,
)

# ----------------------------------------------------------------------------------------------
# helpers


def save(path, arr, **kw):
    """Write an array (or an Image) as an image file, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = arr if isinstance(arr, Image.Image) else Image.fromarray(arr)
    img.save(path, **kw)
    return path


def make_folder(root, layout, size=(6, 7)):
    """Images whose pixel (0, 0) holds a unique id and whose other pixels hold 40 * (class index + 1).

    ``layout`` maps a split folder ('' for none) to {class: count}. Returns {id: (split, class)}.
    """
    ids, next_id = {}, 1
    for split, classes in layout.items():
        for ci, (cls, count) in enumerate(sorted(classes.items())):
            for i in range(count):
                arr = np.full((*size, 3), 40 * (ci + 1), np.uint8)
                arr[0, 0] = next_id
                save(root / split / cls / f"{i:03d}.png", arr)
                ids[next_id] = (split, cls)
                next_id += 1
    return ids


def image_ids(images):
    return [int(v) for v in images[:, 0, 0, 0]]


def assert_same(a: DataBundle, b: DataBundle):
    for split in ("train", "test"):
        assert torch.equal(getattr(a, split).images, getattr(b, split).images)
        assert torch.equal(getattr(a, split).labels, getattr(b, split).labels)
    assert a.classes == b.classes and a.mean == b.mean and a.std == b.std and a.skipped == b.skipped


def copy_bundle(b: DataBundle) -> DataBundle:
    """The bundle with its images copied into memory."""
    return DataBundle(b.name, ImageSet(b.train.images.clone(), b.train.labels.clone()),
                      ImageSet(b.test.images.clone(), b.test.labels.clone()), b.classes, b.mean, b.std, b.skipped,
                      b.source)


def all_files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def shipped_digits():
    """(images 0..16, labels) of the digits file inside the package."""
    with np.load(sources.Path(sources.__file__).with_name("digits.npz")) as z:
        return z["images"], z["labels"]


def tar_folder(folder, dest, arcname=None):
    with tarfile.open(dest, "w:gz") as tf:
        tf.add(folder, arcname=arcname if arcname is not None else folder.name)
    return dest


# ----------------------------------------------------------------------------------------------
# digits


def test_digits_shapes_split_and_determinism(tmp_path):
    b, logs = quiet_load("digits", cache_dir=tmp_path)
    assert b.name == "digits" and DATASETS == ("digits", "cifar10", "cifar100")
    assert b.train.images.shape == (1437, 1, 8, 8) and b.test.images.shape == (360, 1, 8, 8)
    assert b.train.images.dtype == torch.uint8 and b.train.labels.dtype == torch.int64
    assert b.train.images.is_contiguous() and b.test.images.is_contiguous()
    assert b.classes == [str(i) for i in range(10)]
    # 0..16 scaled to 0..255
    allowed = {round(k * 255 / 16) for k in range(17)} | {128}
    assert set(torch.unique(b.train.images).tolist()) <= allowed and int(b.train.images.max()) == 255
    # every image lands in exactly one split, with the same per-class counts as the source
    target = shipped_digits()[1]
    counts = np.bincount(target, minlength=10)
    tr, te = np.bincount(b.train.labels, minlength=10), np.bincount(b.test.labels, minlength=10)
    assert (tr + te == counts).all()
    assert np.abs(te - 0.2 * counts).max() <= 1  # stratified
    # mean/std of the train images in [0, 1]
    x = b.train.images.double() / 255
    assert b.mean[0] == pytest.approx(float(x.mean()), abs=1e-9)
    assert b.std[0] == pytest.approx(float(x.std(unbiased=False)), abs=1e-9)
    assert any("1437 train / 360 test" in line for line in logs)

    same, _ = quiet_load("digits", cache_dir=tmp_path / "other")
    assert_same(b, same)
    other, _ = quiet_load("digits", cache_dir=tmp_path, seed=1)
    assert not torch.equal(other.test.images, b.test.images)
    assert np.array_equal(np.bincount(other.test.labels, minlength=10), te)


def test_shipped_digits_are_scikit_learns():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    images, labels = shipped_digits()
    assert images.dtype == np.uint8 and images.shape == (1797, 8, 8)
    assert np.array_equal(images, d.images) and np.array_equal(labels, d.target)


def test_digits_resize_and_channels(tmp_path):
    b, _ = quiet_load("digits", cache_dir=tmp_path, img_size=16, in_chans=3, val_fraction=0.5)
    assert b.train.images.shape[1:] == (3, 16, 16)
    assert abs(len(b.test.labels) - 1797 / 2) <= 1
    assert torch.equal(b.train.images[:, 0], b.train.images[:, 2])
    assert len(b.mean) == 3


@pytest.mark.parametrize("kw, match", [
    ({"img_size": 0}, "img_size"), ({"img_size": (8, 8, 8)}, "img_size"), ({"in_chans": 2}, "in_chans"),
    ({"val_fraction": 1.0}, "val_fraction"), ({"seed": "x"}, "seed"),
])
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        load_data("digits", cache_dir=tmp_path, log=lambda s: None, **kw)


def test_unknown_source_lists_builtins(tmp_path):
    for source in ("imagenet", str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="digits, cifar10, cifar100"):
            load_data(source, cache_dir=tmp_path)
    not_archive = save(tmp_path / "one.png", np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="not a tar archive"):
        load_data(str(not_archive), cache_dir=tmp_path)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VITLAB_CACHE")
    assert default_cache_dir() == sources.Path.home() / ".cache" / "vitlab"


# ----------------------------------------------------------------------------------------------
# image folders


@pytest.mark.parametrize("test_dir", ["test", "val"])
def test_folder_with_train_and_test(tmp_path, test_dir):
    root = tmp_path / "pets"
    ids = make_folder(root, {"train": {"cat": 3, "dog": 4}, test_dir: {"cat": 2, "dog": 1}})
    b, logs = quiet_load(str(root), cache_dir=tmp_path / "cache")
    assert b.name == "pets" and b.classes == ["cat", "dog"]
    assert b.train.images.shape == (7, 3, 6, 7) and b.test.images.shape == (3, 3, 6, 7)
    for s, split in ((b.train, "train"), (b.test, test_dir)):
        for i, img_id in enumerate(image_ids(s.images)):
            assert ids[img_id] == (split, b.classes[s.labels[i]])
            assert int(s.images[i, 0, 1, 1]) == 40 * (int(s.labels[i]) + 1)
    assert b.source == str(root.resolve())
    assert any("pets: 7 train / 3 test images, 3x6x7, 2 classes" in line for line in logs)


def test_single_folder_is_split_per_class_with_seed(tmp_path):
    root = tmp_path / "flat"
    make_folder(root, {"": {"a": 10, "b": 10, "c": 5}})
    b, _ = quiet_load(str(root), cache_dir=tmp_path / "c1", val_fraction=0.2, seed=3)
    assert b.classes == ["a", "b", "c"]
    assert np.bincount(b.test.labels, minlength=3).tolist() == [2, 2, 1]
    train_ids, test_ids = set(image_ids(b.train.images)), set(image_ids(b.test.images))
    assert not train_ids & test_ids and len(train_ids | test_ids) == 25
    again, _ = quiet_load(str(root), cache_dir=tmp_path / "c2", val_fraction=0.2, seed=3)
    assert_same(b, again)
    other, _ = quiet_load(str(root), cache_dir=tmp_path / "c1", val_fraction=0.2, seed=4)
    assert set(image_ids(other.test.images)) != test_ids


def test_test_class_missing_from_train(tmp_path):
    make_folder(tmp_path / "d", {"train": {"a": 2}, "test": {"a": 1, "zebra": 1}})
    with pytest.raises(ValueError, match="zebra"):
        load_data(str(tmp_path / "d"), cache_dir=tmp_path / "c")


def test_odd_modes_decode_to_the_right_channels(tmp_path):
    root = tmp_path / "modes"
    d = root / "train" / "x"
    save(d / "a_L.png", np.full((4, 4), 100, np.uint8))
    la = np.zeros((4, 4, 2), np.uint8)
    la[..., 0], la[..., 1] = 200, 255
    la[0, 0] = (200, 0)  # fully transparent -> black
    save(d / "b_LA.png", la)
    p = Image.new("P", (4, 4), 1)
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    save(d / "c_P.png", p, transparency=0)  # index 0 (red) is transparent
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[...] = (10, 20, 30, 255)
    rgba[0, 0] = (250, 250, 250, 0)
    save(d / "d_RGBA.png", rgba)
    i16 = np.full((4, 4), 257 * 100, np.uint16)
    i16[0, 0] = 65535
    save(d / "e_I16.png", i16)
    assert Image.open(d / "e_I16.png").mode == "I;16"
    one = Image.new("1", (4, 4), 1)
    one.putpixel((0, 0), 0)
    save(d / "f_1.png", one)
    save(d / "g_CMYK.tif", Image.new("CMYK", (4, 4), (0, 0, 0, 0)))
    save(d / "h_F.tif", np.full((4, 4), 0.5, np.float32))
    save(root / "test" / "x" / "t.png", np.full((4, 4), 7, np.uint8))

    b, _ = quiet_load(str(root), cache_dir=tmp_path / "c")
    x = b.train.images
    assert x.shape == (8, 3, 4, 4) and b.skipped == 0

    def px(i, row=1, col=1):
        return tuple(int(v) for v in x[i, :, row, col])

    assert px(0) == (100, 100, 100)  # L
    assert px(1) == (200, 200, 200) and px(1, 0, 0) == (0, 0, 0)  # LA
    assert px(2) == (0, 255, 0) and px(2, 0, 0) == (0, 0, 0)  # P + transparency
    assert px(3) == (10, 20, 30) and px(3, 0, 0) == (0, 0, 0)  # RGBA
    assert px(4, 0, 0) == (255, 255, 255) and px(4) == (100, 100, 100)  # 16-bit scaled, not clipped
    assert px(5) == (255, 255, 255) and px(5, 0, 0) == (0, 0, 0)  # 1-bit
    assert px(6) == (255, 255, 255)  # CMYK white
    assert px(7) == (128, 128, 128)  # float in [0, 1]

    gray, _ = quiet_load(str(root), cache_dir=tmp_path / "c", in_chans=1)
    assert gray.train.images.shape == (8, 1, 4, 4)
    assert int(gray.train.images[4, 0, 0, 0]) == 255 and int(gray.train.images[0, 0, 1, 1]) == 100
    assert int(gray.train.images[3, 0, 1, 1]) == round(0.299 * 10 + 0.587 * 20 + 0.114 * 30)


def test_read_image_matches_the_folder_pipeline(tmp_path):
    rgba = np.zeros((6, 8, 4), np.uint8)
    rgba[...] = (10, 20, 30, 255)
    rgba[0, 0, 3] = 0
    path = save(tmp_path / "d" / "a" / "x.png", rgba)
    save(tmp_path / "d" / "b" / "y.png", rgba)
    x = read_image(path)
    assert x.dtype == torch.uint8 and x.shape == (3, 6, 8) and x[:, 0, 0].tolist() == [0, 0, 0]
    b, _ = quiet_load(str(tmp_path / "d"), cache_dir=tmp_path / "c", val_fraction=0, img_size=(3, 4), in_chans=1)
    assert torch.equal(read_image(path, (3, 4), 1), b.train.images[0])
    assert read_image(path, 5).shape == (3, 5, 5)
    (tmp_path / "bad.png").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not an image Pillow can read"):
        read_image(tmp_path / "bad.png")
    with pytest.raises(ValueError, match="does not exist"):
        read_image(tmp_path / "missing.png")


def test_sizes_most_common_or_img_size(tmp_path):
    root = tmp_path / "sizes"
    for i in range(3):
        save(root / "a" / f"{i}.png", np.full((8, 10, 3), 50, np.uint8))
    save(root / "b" / "0.png", np.full((8, 10, 3), 90, np.uint8))
    save(root / "b" / "1.png", np.full((16, 20, 3), 90, np.uint8))
    b, logs = quiet_load(str(root), cache_dir=tmp_path / "c", val_fraction=0)
    assert b.train.images.shape == (5, 3, 8, 10)
    assert (b.train.images[b.train.labels == 1] == 90).all()
    assert any("resized 1 of them to the most common, 8x10" in line for line in logs)
    c, _ = quiet_load(str(root), cache_dir=tmp_path / "c", val_fraction=0, img_size=(4, 6))
    assert c.train.images.shape == (5, 3, 4, 6)


def test_corrupt_files_are_skipped_counted_and_named(tmp_path):
    root = tmp_path / "dirty"
    make_folder(root, {"train": {"a": 3}, "test": {"a": 1}})
    (root / "train" / "a" / "bad.jpg").write_bytes(os.urandom(300))
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    (root / "train" / "a" / "cut.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    b, logs = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert b.skipped == 2 and len(b.train.labels) == 3
    line = next(line for line in logs if line.startswith("skipped"))
    assert "skipped 2 unreadable files" in line and "bad.jpg" in line and "cut.png" in line
    cached, logs = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert cached.skipped == 2 and "from cache" in logs[-1]


def test_empty_class_folder_and_no_images(tmp_path):
    root = tmp_path / "holes"
    make_folder(root, {"": {"a": 2}})
    (root / "b").mkdir()
    with pytest.raises(ValueError, match=r"class folder .*holes/b holds no images"):
        load_data(str(root), cache_dir=tmp_path / "c")
    empty = tmp_path / "notes"
    (empty / "a").mkdir(parents=True)
    (empty / "a" / "readme.txt").write_text("no pictures here")
    with pytest.raises(ValueError, match=r"no images found in .*notes.*\.jpg .*\.webp"):
        load_data(str(empty), cache_dir=tmp_path / "c")
    loose = tmp_path / "loose"  # images without class folders: unlabelled, for pre-training
    save(loose / "x.png", np.zeros((3, 3), np.uint8))
    assert load_data(str(loose), cache_dir=tmp_path / "c", log=lambda s: None).unlabelled


def test_worker_processes_decode_like_the_main_process(tmp_path, monkeypatch):
    root = tmp_path / "many"
    make_folder(root, {"train": {"a": 7, "b": 6}, "test": {"a": 2, "b": 2}})
    (root / "train" / "b" / "zz_bad.png").write_bytes(b"not a png")
    serial, _ = quiet_load(str(root), cache_dir=tmp_path / "c1", workers=1)
    monkeypatch.setattr(decode, "_POOL_MIN", 1)
    monkeypatch.setattr(decode, "_CHUNK", 3)
    pooled, _ = quiet_load(str(root), cache_dir=tmp_path / "c2", workers=2)
    assert_same(serial, pooled)
    assert pooled.skipped == 1


# ----------------------------------------------------------------------------------------------
# archives


def test_tar_gz_of_a_folder_loads_like_the_folder(tmp_path):
    root = tmp_path / "src" / "pets"
    make_folder(root, {"train": {"cat": 3, "dog": 2}, "test": {"cat": 1, "dog": 2}})
    folder, _ = quiet_load(str(root), cache_dir=tmp_path / "c")
    archive = tar_folder(root, tmp_path / "pets-v1.tar.gz")  # one top-level folder holding train/ and test/
    packed, logs = quiet_load(str(archive), cache_dir=tmp_path / "c")
    assert packed.name == "pets-v1" and "decoded" in logs[-1]
    assert_same(folder, packed)
    flat = tmp_path / "flat.tar"
    with tarfile.open(flat, "w") as tf:  # train/ and test/ at the top, uncompressed
        for split in ("train", "test"):
            tf.add(root / split, arcname=split)
    assert_same(folder, quiet_load(str(flat), cache_dir=tmp_path / "c")[0])


def _add_bytes(tf, name, data, **attrs):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device"])
def test_unsafe_archive_members_are_refused(tmp_path, kind):
    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(buf, format="PNG")
    png = buf.getvalue()
    archive = tmp_path / "bad.tar.gz"
    outside = tmp_path / "evil.png"
    with tarfile.open(archive, "w:gz") as tf:
        _add_bytes(tf, "data/a/ok.png", png)
        _add_bytes(tf, "data/b/ok.png", png)
        if kind == "dotdot":
            bad = "data/a/../../evil.png"
            _add_bytes(tf, bad, png)
        elif kind == "absolute":
            bad = str(outside)
            _add_bytes(tf, bad, png)
        elif kind == "symlink":
            bad = "data/a/link.png"
            _add_bytes(tf, bad, b"", type=tarfile.SYMTYPE, linkname=str(outside))
        elif kind == "hardlink":
            bad = "data/a/hard.png"
            _add_bytes(tf, bad, b"", type=tarfile.LNKTYPE, linkname="data/b/ok.png")
        else:
            bad = "data/a/dev.png"
            _add_bytes(tf, bad, b"", type=tarfile.CHRTYPE)
    before = all_files(tmp_path)
    with pytest.raises(ValueError, match="refusing to read") as err:
        load_data(str(archive), cache_dir=tmp_path / "cache")
    why = {"dotdot": "'..' component", "absolute": "absolute path", "symlink": "symbolic link",
           "hardlink": "hard link", "device": "special file"}[kind]
    assert repr(bad) in str(err.value) and why in str(err.value)
    assert not outside.exists()
    assert all_files(tmp_path) == before  # nothing written anywhere, no cache


def test_unreadable_archive(tmp_path):
    archive = tmp_path / "junk.tar.gz"
    archive.write_bytes(os.urandom(200))
    with pytest.raises(ValueError, match="not a readable tar archive"):
        load_data(str(archive), cache_dir=tmp_path / "c")


# ----------------------------------------------------------------------------------------------
# the cache


def test_second_load_comes_from_the_cache(tmp_path, monkeypatch):
    root = tmp_path / "pets"
    make_folder(root, {"train": {"cat": 3, "dog": 2}, "test": {"cat": 1, "dog": 1}})
    first, logs1 = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert "decoded" in logs1[-1]
    stores = list((tmp_path / "c").glob("pets-*"))
    assert len(stores) == 1 and sorted(p.name for p in stores[0].iterdir()) == [".vitlab-cache.json", "header.json",
                                                                               "images.u8", "labels.npy"]

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again instead of using the cache")

    with monkeypatch.context() as m:
        m.setattr(sources, "scan_folder", no_decoding)
        m.setattr(decode, "decode_image", no_decoding)
        second, logs2 = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert "from cache" in logs2[-1]
    assert_same(first, second)
    assert second.name == "pets" and second.source == first.source
    # a changed file is a different source
    save(root / "train" / "dog" / "new.png", np.zeros((6, 7, 3), np.uint8))
    third, logs3 = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert "decoded" in logs3[-1] and len(third.train.labels) == 6


def test_too_little_disk_space_is_said_before_decoding(tmp_path, monkeypatch):
    root = tmp_path / "pets"
    make_folder(root, {"": {"cat": 3, "dog": 3}})
    monkeypatch.setattr(sources, "free_bytes", lambda folder: 100)
    with pytest.raises(ValueError, match=r"not enough disk space: .* needs [0-9.]+ MiB .* has 100 bytes free"):
        load_data(str(root), cache_dir=tmp_path / "c", log=lambda s: None)
    assert not list((tmp_path / "c").glob("pets-*"))


def test_own_test_split_shares_the_cache_across_seeds(tmp_path):
    root = tmp_path / "pets"
    make_folder(root, {"train": {"cat": 2, "dog": 2}, "test": {"cat": 1, "dog": 1}})
    quiet_load(str(root), cache_dir=tmp_path / "c", seed=0)
    _, logs = quiet_load(str(root), cache_dir=tmp_path / "c", seed=5, val_fraction=0.3)
    assert "from cache" in logs[-1]
    _, logs = quiet_load(str(root), cache_dir=tmp_path / "c", in_chans=1)
    assert "decoded" in logs[-1]


def test_truncated_store_in_the_cache_is_reported_and_rebuilt(tmp_path):
    root = tmp_path / "pets"
    make_folder(root, {"": {"cat": 4, "dog": 4}})
    first, _ = quiet_load(str(root), cache_dir=tmp_path / "c")
    first = copy_bundle(first)  # its images map the file truncated below
    (store,) = (tmp_path / "c").glob("pets-*")
    images = store / "images.u8"
    images.write_bytes(images.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{images} holds 100 bytes.*truncated"):
        load_data(str(store))  # a store given by name is not rebuilt
    rebuilt, logs = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert any(str(images) in line and "truncated" in line and "rebuilding" in line for line in logs)
    assert "decoded" in logs[-1]
    assert_same(first, rebuilt)
    _, logs = quiet_load(str(root), cache_dir=tmp_path / "c")
    assert "from cache" in logs[-1]


# ----------------------------------------------------------------------------------------------
# CIFAR python batches and downloads


def _batch_pickle(obj, protocol):
    """Pickle like the official files: protocol 2/3 GLOBALs name numpy.core.multiarray._reconstruct."""
    if protocol == "legacy":
        return pickle.dumps(obj, protocol=3).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    return pickle.dumps(obj, protocol=protocol)


def make_cifar(folder, variant="cifar10", per_batch=3, n_test=4, protocol="legacy", seed=0):
    """Small fake CIFAR batches; returns {file: (data, labels)}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    n_classes = 10 if variant == "cifar10" else 100
    if variant == "cifar10":
        files = {f"data_batch_{i}": per_batch for i in range(1, 6)} | {"test_batch": n_test}
        labels_key, meta_file, meta = b"labels", "batches.meta", {b"label_names": [f"c{i}".encode() for i in
                                                                                    range(10)]}
    else:
        files = {"train": per_batch * 5, "test": n_test}
        labels_key, meta_file = b"fine_labels", "meta"
        meta = {b"fine_label_names": [f"f{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"g{i}".encode() for i in range(20)]}
    out = {}
    for name, n in files.items():
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, n_classes, n).tolist()
        batch = {b"batch_label": name.encode(), b"data": data, labels_key: labels,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(n)]}
        if variant == "cifar100":
            batch[b"coarse_labels"] = [y // 5 for y in labels]
        (folder / name).write_bytes(_batch_pickle(batch, protocol))
        out[name] = (data, labels)
    (folder / meta_file).write_bytes(_batch_pickle(meta, protocol))
    return out


def check_cifar(b, written, variant="cifar10"):
    train_files = [f"data_batch_{i}" for i in range(1, 6)] if variant == "cifar10" else ["train"]
    test_file = "test_batch" if variant == "cifar10" else "test"
    data = np.concatenate([written[f][0] for f in train_files]).reshape(-1, 3, 32, 32)
    labels = sum((written[f][1] for f in train_files), [])
    assert b.name == variant and b.skipped == 0
    assert torch.equal(b.train.images, torch.from_numpy(data))
    assert b.train.labels.tolist() == labels
    assert torch.equal(b.test.images, torch.from_numpy(written[test_file][0].reshape(-1, 3, 32, 32)))
    assert b.test.labels.tolist() == written[test_file][1]
    assert len(b.classes) == (10 if variant == "cifar10" else 100)


@pytest.mark.parametrize("protocol", ["legacy", 4, 5])
def test_cifar_batches_folder_and_archive_paths(tmp_path, protocol):
    folder = tmp_path / "cifar-10-batches-py"
    written = make_cifar(folder, protocol=protocol)
    b, _ = quiet_load(str(folder), cache_dir=tmp_path / "c")
    check_cifar(b, written)
    assert b.classes[:2] == ["c0", "c1"] and b.train.images.shape == (15, 3, 32, 32)
    archive = tar_folder(folder, tmp_path / "cifar-10-python.tar.gz")
    check_cifar(quiet_load(str(archive), cache_dir=tmp_path / "c")[0], written)
    small, _ = quiet_load(str(folder), cache_dir=tmp_path / "c", img_size=16, in_chans=1)
    assert small.train.images.shape == (15, 1, 16, 16) and small.test.images.shape == (4, 1, 16, 16)


def test_cifar100_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    written = make_cifar(folder, variant="cifar100")
    b, _ = quiet_load(str(tmp_path), cache_dir=tmp_path / "c")  # the folder that holds cifar-100-python/
    check_cifar(b, written, variant="cifar100")
    assert b.classes[99] == "f99"


def _serve_cifar(tmp_path, monkeypatch, md5=None, folder_name="cifar-10-batches-py"):
    src = tmp_path / "server"
    written = make_cifar(src / folder_name)
    archive = tar_folder(src / folder_name, src / "cifar-10-python.tar.gz")
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    remote = cifar._Remote(archive.as_uri(), md5 or digest, "cifar-10-python.tar.gz", "cifar-10-batches-py")
    monkeypatch.setitem(cifar.CIFAR_REMOTES, "cifar10", remote)
    return written


def test_cifar_download_via_file_url(tmp_path, monkeypatch):
    written = _serve_cifar(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"download=True .*--download") as err:
        load_data("cifar10", cache_dir=cache)
    assert str(cache / "cifar-10-batches-py") in str(err.value)
    b, logs = quiet_load("cifar10", cache_dir=cache, download=True)
    check_cifar(b, written)
    assert any(line.startswith("downloaded file://") for line in logs)
    assert (cache / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert not (cache / "cifar-10-python.tar.gz").exists()
    again, logs = quiet_load("cifar10", cache_dir=cache)
    assert "from cache" in logs[-1]
    assert_same(b, again)


def test_cifar_download_with_wrong_md5_leaves_nothing(tmp_path, monkeypatch):
    _serve_cifar(tmp_path, monkeypatch, md5="0" * 32)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="checksum mismatch.*md5"):
        load_data("cifar10", cache_dir=cache, download=True, log=lambda s: None)
    assert all_files(cache) == []


def test_cifar_download_refuses_unsafe_archive(tmp_path, monkeypatch):
    src = tmp_path / "server"
    make_cifar(src / "cifar-10-batches-py")
    archive = src / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
        _add_bytes(tf, "cifar-10-batches-py/../../evil.txt", b"gotcha")
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    remote = cifar._Remote(archive.as_uri(), digest, archive.name, "cifar-10-batches-py")
    monkeypatch.setitem(cifar.CIFAR_REMOTES, "cifar10", remote)
    cache = tmp_path / "a" / "cache"
    with pytest.raises(ValueError, match="refusing to read .*evil.txt"):
        load_data("cifar10", cache_dir=cache, download=True, log=lambda s: None)
    assert not list(tmp_path.rglob("evil.txt")) and all_files(cache) == []


def test_download_url_checks_sha256(tmp_path):
    payload = os.urandom(5000)
    src = tmp_path / "file.bin"
    src.write_bytes(payload)
    dest = tmp_path / "out" / "copy.bin"
    got = download_url(src.as_uri(), dest, sha256=hashlib.sha256(payload).hexdigest(), log=lambda s: None)
    assert got == dest and dest.read_bytes() == payload
    dest2 = tmp_path / "out" / "copy2.bin"
    with pytest.raises(ValueError, match="checksum mismatch.*sha256"):
        download_url(src.as_uri(), dest2, sha256="f" * 64, log=lambda s: None)
    assert all_files(tmp_path / "out") == ["copy.bin"]
    with pytest.raises(OSError, match="could not download"):
        download_url((tmp_path / "nothing").as_uri(), tmp_path / "out" / "x", log=lambda s: None)
    assert all_files(tmp_path / "out") == ["copy.bin"]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cifar_pickle_with_other_globals_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    make_cifar(folder)
    marker = tmp_path / "pwned"
    batch = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [0], b"x": _Exploit(marker)}
    (folder / "data_batch_3").write_bytes(pickle.dumps(batch))
    with pytest.raises(ValueError, match=r"data_batch_3: refusing to unpickle (posix|os|nt)\.system"):
        load_data(str(folder), cache_dir=tmp_path / "c")
    assert not marker.exists()
    (folder / "data_batch_3").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match="data_batch_3 is not a readable CIFAR batch file"):
        load_data(str(folder), cache_dir=tmp_path / "c")


def test_cifar_batch_with_wrong_shape(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    make_cifar(folder)
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"test_batch: 'data' must be a uint8 array of shape \(N, 3072\)"):
        load_data(str(folder), cache_dir=tmp_path / "c")
