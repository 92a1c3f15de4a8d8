"""Table sources: Hugging Face image-classification Parquet files and CSV/TSV lists of ``path,label``."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import load_data

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def png(value: int, ident: int, size=(5, 6)) -> bytes:
    arr = np.full((*size, 3), value, np.uint8)
    arr[0, 0] = ident
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path, rows, names=None):
    """rows: [(image bytes, label)] as the hub writes them: image a struct of bytes and path, label an int."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": b, "path": f"{i}.png"} for i, (b, _) in enumerate(rows)],
                                        type=image_type),
                      "label": pa.array([y for _, y in rows], type=pa.int64())})
    if names is not None:
        features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
        table = table.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def test_hub_parquet_layout_with_class_names_and_a_corrupt_image(tmp_path):
    root = tmp_path / "beans"
    names = ["healthy", "rust", "spot"]
    train = [(png(40 * (i % 3 + 1), i + 1), i % 3) for i in range(9)]
    train[4] = (b"\x89PNG broken", 1)
    write_parquet(root / "data" / "train-00000-of-00002.parquet", train[:5], names)
    write_parquet(root / "data" / "train-00001-of-00002.parquet", train[5:], names)
    write_parquet(root / "data" / "validation-00000-of-00001.parquet", [(png(80, 50), 1), (png(120, 51), 2)], names)
    logs = []
    b = load_data(str(root), cache_dir=tmp_path / "c", log=logs.append)
    assert b.classes == names and b.name == "beans"
    assert b.train.images.shape == (8, 3, 5, 6) and b.skipped == 1
    assert [int(v) for v in b.train.images[:, 0, 0, 0]] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert b.train.labels.tolist() == [0, 1, 2, 0, 2, 0, 1, 2]
    assert (b.train.images[:, :, 1:] == 40 * (b.train.labels + 1).view(-1, 1, 1, 1).to(torch.uint8)).all()
    assert [int(v) for v in b.test.images[:, 0, 0, 0]] == [50, 51] and b.test.labels.tolist() == [1, 2]
    line = next(line for line in logs if line.startswith("skipped"))
    assert "skipped 1 unreadable files" in line and "data/train-00000-of-00002.parquet row 4" in line
    assert any("validation as the test split" in line for line in logs)
    again = load_data(str(root), cache_dir=tmp_path / "c", log=logs.append)
    assert "from cache" in logs[-1] and torch.equal(again.train.images, b.train.images)


def test_single_parquet_file_without_metadata_is_split(tmp_path):
    path = tmp_path / "tiny.parquet"
    write_parquet(path, [(png(10 * (i % 2 + 1), i + 1), i % 2) for i in range(10)])
    b = load_data(str(path), cache_dir=tmp_path / "c", val_fraction=0.2, log=lambda s: None)
    assert b.classes == ["0", "1"] and len(b.train.labels) == 8 and len(b.test.labels) == 2
    assert sorted(b.test.labels.tolist()) == [0, 1]


def test_parquet_without_an_image_column(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"pixels": [b"a"], "label": [0]}), path)
    with pytest.raises(ValueError, match="no image column .*columns: pixels, label"):
        load_data(str(path), cache_dir=tmp_path / "c", log=lambda s: None)


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_csv_list_with_a_corrupt_and_a_missing_image(tmp_path, suffix):
    root = tmp_path / "photos"
    root.mkdir()
    sep = "\t" if suffix == ".tsv" else ","
    lines = ["path" + sep + "label"]
    for i in range(8):
        cls = ("cat", "dog")[i % 2]
        (root / f"{i}.png").write_bytes(png(60 if cls == "cat" else 120, i + 1))
        lines.append(f"photos/{i}.png{sep}{cls}")
    (root / "broken.png").write_bytes(b"nope")
    lines += [f"photos/broken.png{sep}cat", f"photos/missing.png{sep}dog"]
    listing = tmp_path / f"list{suffix}"
    listing.write_text("\n".join(lines) + "\n")
    logs = []
    b = load_data(str(listing), cache_dir=tmp_path / "c", val_fraction=0.25, log=logs.append)
    assert b.classes == ["cat", "dog"] and b.skipped == 2
    assert len(b.train.labels) + len(b.test.labels) == 8
    ids = sorted(int(v) for v in torch.cat([b.train.images, b.test.images])[:, 0, 0, 0])
    assert ids == list(range(1, 9))
    line = next(line for line in logs if line.startswith("skipped"))
    assert f"list{suffix} line 10: photos/broken.png" in line and f"list{suffix} line 11: photos/missing.png" in line


def test_csv_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a.png,cat\nb.png\n")
    with pytest.raises(ValueError, match=r"bad.csv line 2: expected 'path,label', got 'b.png'"):
        load_data(str(bad), cache_dir=tmp_path / "c", log=lambda s: None)
    empty = tmp_path / "empty.csv"
    empty.write_text("path,label\n")
    with pytest.raises(ValueError, match="lists no images"):
        load_data(str(empty), cache_dir=tmp_path / "c", log=lambda s: None)
