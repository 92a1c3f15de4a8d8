"""vitlab data pack and unpack: any source written as shards (whole shards only, even when killed), read back as the
same files, and training from them as good as from the folder."""
import tarfile
from pathlib import Path

import pytest
from PIL import Image
from test_shards import TINY, _images

from vitlab.data import pack as pack_module
from vitlab.data.pack import pack, parse_size, unpack
from vitlab.train import load_recipe, train
from vitlab.train import setup as run_setup

pytest.importorskip("webdataset")


def _folder(root: Path, per_class_train: int, per_class_test: int, signal: int = 150) -> Path:
    """root/{train,test}/<class>/<n>.png of the images above."""
    for split, n, seed in (("train", per_class_train, 2), ("test", per_class_test, 3)):
        x, y = _images(3 * n, 3, seed, signal)
        for i, (image, label) in enumerate(zip(x, y)):
            (root / split / f"c{label}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(root / split / f"c{label}" / f"{i}.png")
    return root


def test_pack_then_unpack_gives_the_folder_back(tmp_path, cache_dir):
    root = _folder(tmp_path / "folder", 12, 4)
    info = pack(root, tmp_path / "wds", shard_size=parse_size("2KB"), log=lambda m: None)
    assert info["classes"] == ["c0", "c1", "c2"] and info["splits"]["train"]["num_samples"] == 36
    assert len(info["splits"]["train"]["filenames"]) > 1  # shards of about 2 KB
    assert not list((tmp_path / "wds").glob(".*"))  # no temporary file left
    unpack(f"wds:{tmp_path / 'wds'}", tmp_path / "back", log=lambda m: None)
    original = sorted(p.read_bytes() for p in root.rglob("*.png"))
    back = sorted(p.read_bytes() for p in (tmp_path / "back").rglob("*.png"))
    assert original == back  # the files as they were
    assert sorted(p.parent.name for p in (tmp_path / "back" / "test").rglob("*.png")) == ["c0"] * 4 + ["c1"] * 4 + \
        ["c2"] * 4
    with pytest.raises(ValueError, match="not empty"):
        pack(root, tmp_path / "wds", log=lambda m: None)


def test_a_killed_pack_leaves_no_shard_that_looks_finished(tmp_path, cache_dir, monkeypatch):
    root = _folder(tmp_path / "folder", 12, 4)
    real, written = pack_module._Shards.write, []

    def write_then_die(self, *args):
        real(self, *args)
        written.append(1)
        if len(written) == 20:
            raise KeyboardInterrupt
    monkeypatch.setattr(pack_module._Shards, "write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        pack(root, tmp_path / "wds", shard_size=parse_size("4KB"), log=lambda m: None)
    left = sorted(p.name for p in (tmp_path / "wds").iterdir())
    assert left and all(p.endswith(".tar") and not p.startswith(".") for p in left)  # whole shards only
    assert "_info.json" not in left  # the pack is not finished
    for name in left:
        with tarfile.open(tmp_path / "wds" / name) as tar:
            assert len(tar.getnames()) % 2 == 0  # image + label pairs, the last one complete


def test_training_from_packed_shards_matches_training_from_the_folder(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(run_setup, "SHARD_WORKERS", 0)  # the shards read in this process
    root = _folder(tmp_path / "folder", 40, 20, signal=15)  # a channel 15 grey levels brighter, under noise of 90
    pack(root, tmp_path / "wds", shard_size=parse_size("8KB"), log=lambda m: None)
    common = dict(TINY, epochs=6, lr=2e-3, seed=1)
    a = train(load_recipe(None, **common, data=str(root), out=str(tmp_path / "folder-run")), log=lambda m: None)
    b = train(load_recipe(None, **common, data=f"wds:{tmp_path / 'wds'}", out=str(tmp_path / "shard-run")),
              log=lambda m: None)
    assert a["num_train"] == b["num_train"] == 120 and a["num_test"] == b["num_test"] == 60
    assert abs(a["top1"] - b["top1"]) <= 1 / 60 + 1e-9  # within one test image
    assert a["top1"] > 0.9  # learnt (labels out of step with the images would leave it near 1/3)
