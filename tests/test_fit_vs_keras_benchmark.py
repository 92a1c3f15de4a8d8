"""benchmarks/fit_vs_keras.py: the archive becomes Keras's arrays, and its quick path runs both arms side by side
into a table, results.json and a figure (keras from the bench extra; skipped without it)."""
from __future__ import annotations

import importlib.util
import io
import json
import tarfile

import numpy as np
import pytest
from conftest import benchmark
from PIL import Image


@pytest.fixture
def bench():
    return benchmark("fit_vs_keras")


def archive(path, train: int, test: int):
    """A CIFAR-10-like archive of JPEGs (train/<class>/*.jpg, test/<class>/*.jpg), each class a flat colour of its
    own."""
    with tarfile.open(path, "w:gz") as tar:
        for split, n in (("train", train), ("test", test)):
            for c, name in enumerate(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                                      "truck"]):
                for i in range(n):
                    buf = io.BytesIO()
                    Image.new("RGB", (32, 32), (25 * c, 255 - 25 * c, 10 * i)).save(buf, "JPEG", quality=95)
                    info = tarfile.TarInfo(f"{split}/{name}/{i:04d}.jpg")
                    info.size = len(buf.getvalue())
                    tar.addfile(info, io.BytesIO(buf.getvalue()))
    return path


def test_the_archive_becomes_keras_arrays_cached_once(bench, tmp_path):
    path = archive(tmp_path / "c.tar.gz", 3, 2)
    arrays = bench.cached_arrays(path, tmp_path / "cache")
    assert arrays["x_train"].shape == (30, 32, 32, 3) and arrays["x_train"].dtype == np.uint8
    assert arrays["y_train"].shape == (30, 1)
    assert arrays["y_train"][:, 0].tolist() == [c for c in range(10) for _ in range(3)]
    assert arrays["y_test"][:, 0].tolist() == [c for c in range(10) for _ in range(2)]
    assert abs(int(arrays["x_train"][3, 0, 0, 0]) - 25) <= 3  # class 1's colour, decoded
    again = bench.cached_arrays(path, tmp_path / "cache")
    assert all(np.array_equal(arrays[k], again[k]) for k in arrays) and len(list((tmp_path / "cache").iterdir())) == 1
    x, y = bench.per_class(arrays["x_train"], arrays["y_train"], 20)
    assert len(y) == 20 and np.bincount(y[:, 0]).tolist() == [2] * 10


@pytest.mark.slow
def test_the_quick_path_runs_both_arms_into_a_table_and_a_figure(bench, tmp_path, capsys):
    if importlib.util.find_spec("keras") is None:  # not imported here: the arms import it on the torch backend
        pytest.skip("keras is not installed: pip install 'vitlab[bench]'")
    path = archive(tmp_path / "c.tar.gz", 4, 2)
    out = tmp_path / "out"
    assert bench.main(["--archive", str(path), "--cache", str(tmp_path / "cache"), "--out", str(out), "--minutes",
                       "0.05", "--points", "2", "--curve-images", "10"]) == 0
    printed = capsys.readouterr().out
    assert "| keras |" in printed and "| vitlab |" in printed and "40 training / 20 test images" in printed
    found = json.loads((out / "results.json").read_text())
    assert [a["arm"] for a in found["arms"]] == ["keras", "vitlab"]
    for arm in found["arms"]:
        assert 0 <= arm["top1"] <= 1 and arm["curve"][-1]["on"] == "20 test images" and arm["threads"] == 1
    assert found["arms"][0]["images"] >= 40  # at least one batch of the tutorial's 256 (an epoch of 40 here)
    assert (out / "fit_vs_keras.png").read_bytes().startswith(b"\x89PNG")
