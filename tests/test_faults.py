"""The data layer under bad input and faults: stale caches, ambiguous lists, constant channels, full and read-only
disks, links, damaged files, debris of killed writers, and a precision default that never depends on the load."""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from decimal import Decimal

import numpy as np
import pytest
import torch
from conftest import checksums, error_line, quiet_load
from PIL import Image

from vitlab import devices
from vitlab.atomic import atomic_path, atomic_write_bytes, atomic_write_json, remove_stale_temps
from vitlab.data import cache as vcache
from vitlab.data import decode, load_data, sources
from vitlab.data.tables import class_index


def img(path, value, ident, size=(6, 6), blue=None):
    """An image file whose pixel (0, 0) is ``ident`` and the rest ``value`` (blue channel ``blue`` when given);
    BMP by default, so that two images of one size are files of one size."""
    arr = np.full((*size, 3), value, np.uint8)
    if blue is not None:
        arr[..., 2] = blue
    arr[0, 0, :2] = ident
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def make_folder(root, classes=("a", "b"), per_class=4, **kw):
    n = 1
    for ci, c in enumerate(classes):
        for i in range(per_class):
            img(root / c / f"{i}.bmp", 40 * (ci + 1), n, **kw)
            n += 1
    return root


def ids(bundle):
    return sorted(int(v) for v in torch.cat([bundle.train.images, bundle.test.images])[:, 0, 0, 0])


@contextlib.contextmanager
def tmpfs(path, size):
    """A tmpfs of ``size`` mounted at ``path`` (the test skips where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not root'}): a full or read-only disk "
                    "needs one")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path, options):
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


# ----------------------------------------------------------------------------------------------
# a store is never reused after its source changed


def keep_size_and_mtime(path, write):
    """Apply ``write(path)`` and put back the file's size-preserving mtime (as cp -p, rsync -a or tar do)."""
    st = os.stat(path)
    write(path)
    assert os.stat(path).st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def rewrite_in_place(path):
    img(path, 200, 99)


def replace_by_rename(path):
    new = path.with_name("incoming.bmp")
    img(new, 200, 99)
    os.replace(new, path)


@pytest.mark.parametrize("edit", [rewrite_in_place, replace_by_rename])
@pytest.mark.parametrize("kind", ["folder", "csv", "tsv"])
def test_an_edit_that_keeps_size_and_mtime_is_seen(tmp_path, edit, kind):
    root = make_folder(tmp_path / "pets")
    source = root
    if kind != "folder":
        sep = "," if kind == "csv" else "\t"
        source = tmp_path / f"list.{kind}"
        source.write_text("".join(f"pets/{p.relative_to(root).as_posix()}{sep}{p.parent.name}\n"
                                  for p in sorted(root.rglob("*.bmp"))))
    listed = source.read_bytes() if kind != "folder" else b""
    b, _ = quiet_load(source, cache_dir=tmp_path / "c")
    assert ids(b) == list(range(1, 9))
    keep_size_and_mtime(root / "a" / "0.bmp", edit)
    b2, logs = quiet_load(source, cache_dir=tmp_path / "c")
    assert "decoded" in logs[-1] and 99 in ids(b2) and 1 not in ids(b2)
    if kind != "folder":
        assert source.read_bytes() == listed  # the list itself never changed: its images did
    _, logs = quiet_load(source, cache_dir=tmp_path / "c")
    assert "from cache" in logs[-1]  # and the new store is found again


def test_a_csv_sees_its_images_appear_and_vanish(tmp_path):
    root = make_folder(tmp_path / "pets")
    listing = tmp_path / "list.csv"
    listing.write_text("".join(f"pets/a/{i}.bmp,a\npets/b/{i}.bmp,b\n" for i in range(5)))  # 4.bmp is missing
    b, _ = quiet_load(listing, cache_dir=tmp_path / "c")
    assert b.skipped == 2
    img(root / "a" / "4.bmp", 40, 50)
    img(root / "b" / "4.bmp", 80, 51)
    b, _ = quiet_load(listing, cache_dir=tmp_path / "c")
    assert b.skipped == 0 and {50, 51} <= set(ids(b))
    (root / "b" / "4.bmp").unlink()
    b, _ = quiet_load(listing, cache_dir=tmp_path / "c")
    assert b.skipped == 1 and 51 not in ids(b)


@pytest.mark.parametrize("ctime_ns, now, waited", [
    (1_700_000_000_123_000_000, 1_700_000_000.130, pytest.approx(0.043)),  # fine timestamps: a short tick
    (1_700_000_000_000_000_000, 1_700_000_000.5, pytest.approx(1.5)),  # whole seconds: up to two seconds
    (1_700_000_000_123_000_000, 1_700_000_100.0, 0.0),  # long past
    (1_700_000_000_123_000_000, 1_600_000_000.0, pytest.approx(vcache.FINE_TICK_S)),  # in the future: one tick
])
def test_a_build_waits_until_the_newest_change_is_a_tick_old(ctime_ns, now, waited):
    slept = []
    ident = ["root", [["a.png", 10, ctime_ns, ctime_ns, 7], ["b.png", 10, 1, 1_000_000_000, 8]]]
    assert vcache.settle(ident, clock=lambda: now, sleep=slept.append) == waited
    assert slept == ([] if waited == 0.0 else [waited])


# ----------------------------------------------------------------------------------------------
# CSV headers and labels


@pytest.mark.parametrize("header", ["filename,class", "path,label", "image_path,category", "File Name,Species",
                                    "class,filename", None])
@pytest.mark.parametrize("swapped", [False, True])
def test_a_csv_header_is_never_a_class_and_columns_may_come_either_way(tmp_path, header, swapped):
    make_folder(tmp_path / "pets")
    rows = [(f"pets/{c}/{i}.bmp", c) for c in "ab" for i in range(4)]
    lines = [f"{y},{p}" if swapped else f"{p},{y}" for p, y in rows]
    listing = tmp_path / "list.csv"
    listing.write_text("\n".join(([header] if header else []) + lines) + "\n")
    b, logs = quiet_load(listing, cache_dir=tmp_path / "c", val_fraction=0.25)
    assert b.classes == ["a", "b"] and b.skipped == 0 and ids(b) == list(range(1, 9))
    assert any("as the header" in line for line in logs) == (header is not None)


@pytest.mark.parametrize("spellings, classes", [
    (["1", "01", "1.0", "1e0", "+1", "001.000"], ["1"]),
    (["2", "10", "02", "10.0", "1"], ["1", "2", "10"]),  # sorted by value
    (["0.5", "0.50", "1.5", "-3"], ["-3", "0.5", "1.5"]),
    (["12345678901234567890", "12345678901234567891"], ["12345678901234567890", "12345678901234567891"]),
    (["cat", "dog", "Cat"], ["Cat", "cat", "dog"]),  # names stay names
])
def test_numbers_written_differently_are_one_class(spellings, classes):
    names, index = class_index(spellings, "x.csv")
    assert names == classes
    numeric = all(s[0].isdigit() or s[0] in "+-." for s in spellings)
    for s in spellings:
        for t in spellings:
            same = Decimal(s) == Decimal(t) if numeric else s == t
            assert (index[s] == index[t]) == same, (s, t)


@pytest.mark.parametrize("labels", [["cat", "1", "01"], ["1.0", "1", "dog"], ["x", "2", "2.00"]])
def test_ambiguous_labels_are_refused_in_one_line(tmp_path, capsys, labels):
    root = make_folder(tmp_path / "pets", classes=("a",), per_class=3)
    listing = tmp_path / "list.csv"
    listing.write_text("".join(f"pets/a/{i}.bmp,{y}\n" for i, y in enumerate(labels)))
    before = checksums(tmp_path)
    with pytest.raises(ValueError, match=r"one number written two ways.*write each class one way"):
        quiet_load(listing, cache_dir=tmp_path / "c")
    err = error_line(capsys, ["train", "--data", str(listing), "--out", str(tmp_path / "run"),
                              "--cache-dir", str(tmp_path / "c"), "--epochs", "1"], after_log=True)
    assert "one number written two ways" in err
    assert checksums(root) == {k[len("pets/"):]: v for k, v in before.items() if k.startswith("pets/")}
    assert listing.read_text().count("\n") == 3


def test_the_same_numbers_in_a_csv_make_one_class_each(tmp_path):
    make_folder(tmp_path / "pets", classes=("a", "b"), per_class=4)
    spell = {"a": ["1", "01", "1.0", " 1 "], "b": ["2", "2.0", "02", "2"]}
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\n" + "".join(f"pets/{c}/{i}.bmp,{spell[c][i]}\n" for c in "ab" for i in range(4)))
    b, _ = quiet_load(listing, cache_dir=tmp_path / "c", val_fraction=0.25)
    assert b.classes == ["1", "2"]
    for split in (b.train, b.test):
        assert ((split.images[:, 0, 1, 1] == 40) == (split.labels == 0)).all()


# ----------------------------------------------------------------------------------------------
# constant channels


@pytest.mark.parametrize("constant", [{"blue": 0}, {"blue": 255}, {"blue": 7}])
def test_a_constant_channel_is_normalised_by_one_and_said(tmp_path, constant):
    make_folder(tmp_path / "pets", **constant)
    b, logs = quiet_load(tmp_path / "pets", cache_dir=tmp_path / "c")
    assert b.std[2] == 1.0 and 0 < b.std[0] < 1 and 0 < b.std[1] < 1
    assert any("channel 2" in line and "constant" in line for line in logs)
    x = (b.train.images.float() / 255 - torch.tensor(b.mean).view(1, 3, 1, 1)) / torch.tensor(b.std).view(1, 3, 1, 1)
    assert torch.isfinite(x).all() and x.abs().max() < 10


@pytest.mark.slow
def test_training_on_a_constant_channel_has_a_finite_loss(tmp_path):
    make_folder(tmp_path / "pets", per_class=6, size=(8, 8), blue=0)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "vitlab", "train", "--data", str(tmp_path / "pets"), "--out", str(out),
                        "--cache-dir", str(tmp_path / "c"), "--epochs", "1", "--img-size", "8", "--batch-size", "4",
                        "--model", "vit_nano_patch4_32", "--device", "cpu"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "not finite" not in r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------
# full and read-only disks


@pytest.mark.parametrize("kind", ["folder", "digits"])
def test_a_disk_filling_during_a_build_is_one_line_and_the_build_resumes(tmp_path, monkeypatch, kind):
    source = str(make_folder(tmp_path / "pets", per_class=40, size=(48, 48))) if kind == "folder" else "digits"
    expected, _ = quiet_load(source, cache_dir=tmp_path / "ref", img_size=48)
    before = checksums(tmp_path / "pets") if kind == "folder" else {}
    with tmpfs(tmp_path / "small", "128k") as cache:
        monkeypatch.setattr(sources, "free_bytes", lambda folder: 1 << 40)  # the estimate passes; the disk fills
        with pytest.raises(ValueError, match=r"^disk full: the store for .* needs .* which has .* free; .*"
                                             r"resumes when run again$") as err:
            quiet_load(source, cache_dir=cache, img_size=48)
        assert "\n" not in str(err.value)
        assert [p.name for p in cache.iterdir() if p.name.endswith(".partial")]
        remount(cache, "size=16m")
        monkeypatch.undo()
        b, logs = quiet_load(source, cache_dir=cache, img_size=48)
        assert torch.equal(b.train.images, expected.train.images) and torch.equal(b.test.labels, expected.test.labels)
        del b
    if kind == "folder":
        assert checksums(tmp_path / "pets") == before


def test_too_little_space_is_said_before_decoding_with_sizes_that_differ(tmp_path, capsys):
    root = make_folder(tmp_path / "pets", per_class=40, size=(48, 48))
    with tmpfs(tmp_path / "small", "1m") as cache:
        with pytest.raises(ValueError, match=r"^not enough disk space: .* needs (\S+ \S+) in .* which has (\S+ \S+) "
                                             "free") as err:
            quiet_load(root, cache_dir=cache, img_size=96)
        need, free = err.value.args[0].split(" needs ")[1].split(" in ")[0], \
            err.value.args[0].split("which has ")[1].split(" free")[0]
        assert need != free
        assert not [p for p in cache.iterdir() if not p.name.startswith(".")]
        line = error_line(capsys, ["train", "--data", str(root), "--out", str(tmp_path / "run"),
                                   "--cache-dir", str(cache), "--img-size", "96", "--epochs", "1"], after_log=True)
        assert "not enough disk space" in line


@pytest.mark.parametrize("need, free", [(21474836, 21474835), (21_000_000, 20_990_000), (1 << 30, (1 << 30) - 1),
                                        (5 * 2**30 + 1, 5 * 2**30), (1023, 1022), (2048, 2047)])
def test_two_different_sizes_never_read_the_same(need, free):
    a, b = vcache.format_sizes(need, free)
    assert a != b
    rng = np.random.default_rng(need)
    for x in rng.integers(1, 1 << 40, 200):
        for d in (1, 7, 1 << 10, 1 << 20):
            s1, s2 = vcache.format_sizes(int(x) + d, int(x))
            assert s1 != s2


def test_a_dying_decoder_is_one_line_and_the_build_resumes(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "pets", per_class=30)
    expected, _ = quiet_load(root, cache_dir=tmp_path / "ref", workers=1)
    monkeypatch.setattr(decode, "_POOL_MIN", 1)
    monkeypatch.setattr(decode, "_CHUNK", 4)
    real = decode.decode_image
    parent = os.getpid()

    def dies_in_a_worker(payload, *a):
        if os.getpid() != parent and payload.endswith("b/20.bmp"):
            os._exit(1)
        return real(payload, *a)

    monkeypatch.setattr(decode, "decode_image", dies_in_a_worker)
    with pytest.raises(ValueError, match=r"^a process decoding .* died .*resumes when run again$"):
        quiet_load(root, cache_dir=tmp_path / "c", workers=2)
    monkeypatch.undo()
    b, logs = quiet_load(root, cache_dir=tmp_path / "c", workers=2)
    assert any("resuming" in line for line in logs)
    assert torch.equal(b.train.images, expected.train.images)


def test_a_read_only_cache_is_one_line_and_a_built_store_still_loads(tmp_path, capsys):
    root = make_folder(tmp_path / "pets")
    with tmpfs(tmp_path / "ro", "4m") as cache:
        quiet_load(root, cache_dir=cache / "built")
        remount(cache, "ro")
        b, logs = quiet_load(root, cache_dir=cache / "built")  # a store already there is only read
        assert "from cache" in logs[-1] and ids(b) == list(range(1, 9))
        with pytest.raises(ValueError, match=r"cannot write the data cache .*new \(a read-only file system\); set "
                                             "VITLAB_CACHE or --cache-dir to a writable folder"):
            quiet_load(root, cache_dir=cache / "new")
        line = error_line(capsys, ["train", "--data", str(root), "--out", str(tmp_path / "run"),
                                   "--cache-dir", str(cache / "new"), "--epochs", "1"], after_log=True)
        assert "read-only" in line


@pytest.mark.parametrize("fault", ["unreachable", "read-only", "too small", "fills up"])
def test_fetching_cifar_into_a_bad_cache_is_one_line(tmp_path, monkeypatch, capsys, fault):
    from vitlab.data import cifar
    served = tmp_path / "server" / "cifar-10-python.tar.gz"
    served.parent.mkdir()
    served.write_bytes(np.random.default_rng(0).bytes(400_000))  # what a download would fetch (never valid)
    url = served.as_uri() if fault != "unreachable" else (tmp_path / "nowhere.tar.gz").as_uri()
    remote = cifar._Remote(url, hashlib.md5(served.read_bytes()).hexdigest(), served.name, "cifar-10-batches-py")
    monkeypatch.setitem(cifar.CIFAR_REMOTES, "cifar10", remote)
    expected = {"unreachable": r"^could not download .*nowhere\.tar\.gz",
                "read-only": r"^cannot write the data cache .* \(a read-only file system\)",
                "too small": r"^not enough disk space: cifar10 needs 360\.00 MiB in .* which has \S+ \S+ free",
                "fills up": r"^disk full: cifar10 needs .* free; free some space"}[fault]
    with contextlib.ExitStack() as stack:
        cache = tmp_path / "cache"
        if fault != "unreachable":
            cache = stack.enter_context(tmpfs(tmp_path / "mnt", "128k"))
        if fault == "read-only":
            remount(cache, "ro")
        if fault == "fills up":
            monkeypatch.setattr(cifar, "_NEEDS_BYTES", 1)  # the estimate passes; the download fills the disk
        with pytest.raises(ValueError, match=expected):
            load_data("cifar10", cache_dir=cache, download=True, log=lambda s: None)
        line = error_line(capsys, ["train", "--data", "cifar10", "--download", "--out",
                                   str(tmp_path / "run"), "--cache-dir", str(cache), "--epochs", "1"], after_log=True)
        assert line.startswith("vitlab train: error: ")
        assert not [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else True


# ----------------------------------------------------------------------------------------------
# links and damaged files


def test_symlinked_class_folders_are_followed_and_a_loop_is_named(tmp_path):
    make_folder(tmp_path / "elsewhere", classes=("b",))
    root = make_folder(tmp_path / "pets", classes=("a",))
    (root / "b").symlink_to(tmp_path / "elsewhere" / "b")  # a class kept elsewhere
    (root / "c").symlink_to(root / "a")  # a class that is another's folder
    b, _ = quiet_load(root, cache_dir=tmp_path / "c", val_fraction=0.25)
    assert b.classes == ["a", "b", "c"]
    assert torch.bincount(torch.cat([b.train.labels, b.test.labels])).tolist() == [4, 4, 4]
    (root / "d").symlink_to(root)
    with pytest.raises(ValueError, match=r"class folder .*pets/d holds no images \(it is a link to .*pets, a folder "
                                         r"above it: a loop\)"):
        quiet_load(root, cache_dir=tmp_path / "c")


@pytest.mark.parametrize("cut", [0.5, 0.9, -1, 12])
def test_a_truncated_parquet_file_is_named(tmp_path, capsys, cut):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import io
    images = []
    for i in range(6):
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), i * 20, np.uint8)).save(buf, format="PNG")
        images.append(buf.getvalue())
    path = tmp_path / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"image": images, "label": [i % 2 for i in range(6)]}), path)
    data = path.read_bytes()
    size = int(len(data) * cut) if isinstance(cut, float) else len(data) + cut if cut < 0 else cut
    path.write_bytes(data[:size])
    with pytest.raises(ValueError, match=rf"{path} is not a readable Parquet file \(truncated or damaged\?"):
        quiet_load(tmp_path / "data", cache_dir=tmp_path / "c")
    line = error_line(capsys, ["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
                               "--cache-dir", str(tmp_path / "c"), "--epochs", "1"], after_log=True)
    assert str(path) in line
    assert len(path.read_bytes()) == size


# ----------------------------------------------------------------------------------------------
# atomic writes: their mode, and the debris of killed writers


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_atomic_writes_get_the_mode_any_new_file_gets(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        with atomic_path(tmp_path / "b.bin") as tmp:
            tmp.write_bytes(b"1")
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    assert {os.stat(tmp_path / n).st_mode & 0o777 for n in ("a.json", "b.bin", "plain")} == {expected}


def _age(path, seconds):
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_debris_of_dead_writers_is_removed_and_nothing_else(tmp_path):
    target = tmp_path / "summary.json"
    stale = [tmp_path / f".summary.json.{s}.tmp" for s in ("ab12cd34", "x_9k2m3q")]  # ours and mkstemp's names
    young = tmp_path / ".summary.json.0000beef.tmp"
    mine = [tmp_path / n for n in (".summary.json.tmp", "summary.json.ab12cd34.tmp", ".notes.txt.swp", "data.tmp",
                                   ".summary.json.ab12cd34.tmp.bak")]
    for p in [*stale, young, *mine]:
        p.write_bytes(b"partial")
    for p in [*stale, *mine]:
        _age(p, 3600)
    atomic_write_json(target, {"ok": True})
    assert not any(p.exists() for p in stale)
    assert young.exists() and all(p.read_bytes() == b"partial" for p in mine)
    assert remove_stale_temps(tmp_path, now=time.time() + 3600) == [young]


def test_a_live_writers_temporary_file_is_never_removed(tmp_path):
    target = tmp_path / "checkpoint.pt"
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"half written")
        assert remove_stale_temps(tmp_path, now=time.time() + 86400) == []
        atomic_write_bytes(tmp_path / "other.bin", b"x")
        assert tmp.exists()
    assert target.read_bytes() == b"half written"


def test_claiming_a_run_folder_removes_a_killed_writers_debris_at_once(tmp_path):
    """A run killed during a write and resumed at once: its half-written temporary file is gone when the folder is
    claimed, however young; one a live writer holds stays."""
    from vitlab.runs.folder import LOCK, claim_folder
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text("train 99999\n")  # what a killed run leaves: its lock file, unheld
    debris = out / ".curves.png.7a36debf.tmp"
    debris.write_bytes(b"\x89PNG half")
    with atomic_path(out / "summary.json") as live:
        live.write_bytes(b"half")
        with claim_folder(out, "train", resume=True):
            assert not debris.exists() and live.exists()


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_debris_the_next_write_removes(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from vitlab.atomic import atomic_path
        with atomic_path({str(tmp_path / 'metrics.json')!r}) as tmp:
            tmp.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert r.returncode == -9
    (debris,) = tmp_path.glob(".metrics.json.*.tmp")
    _age(debris, 3600)
    atomic_write_json(tmp_path / "metrics.json", [])
    assert not debris.exists() and (tmp_path / "metrics.json").read_text() == "[]\n"


# ----------------------------------------------------------------------------------------------
# the cache: what it holds, and removing what is superseded


def test_cache_list_and_clean_remove_only_superseded_stores(tmp_path):
    root = make_folder(tmp_path / "pets")
    cache = tmp_path / "c"
    quiet_load(root, cache_dir=cache)
    quiet_load("digits", cache_dir=cache)
    before = checksums(root)
    keep_size_and_mtime(root / "a" / "1.bmp", rewrite_in_place)
    quiet_load(root, cache_dir=cache)
    quiet_load(root, cache_dir=cache, img_size=4)  # another size of the same source: current too
    gone = make_folder(tmp_path / "gone")
    quiet_load(gone, cache_dir=cache)
    import shutil
    shutil.rmtree(gone)
    (cache / "notes.txt").write_text("mine")
    from vitlab.data.owned import make_owned_folder
    make_owned_folder(cache / "features", "features")  # as vitlab probe makes it
    (cache / "features" / "features-ab12ab12.safetensors").write_bytes(b"0" * 64)
    debris = cache / ".x.json.ab12cd34.tmp"  # named like a killed write's debris, but not provably vitlab's
    debris.write_text("{")
    _age(debris, 3600)
    entries = vcache.cache_entries(cache)
    stores = {e.path.name: e.status for e in entries if e.kind == "store"}
    assert sorted(stores.values()) == ["current", "current", "current", "source gone", "superseded (source changed)"]
    assert all(e.bytes > 0 for e in entries if e.kind == "store")
    kinds = {e.path.name: e.kind for e in entries}
    assert kinds["notes.txt"] == kinds[debris.name] == "other" and kinds["features"] == "features"
    dry = vcache.clean_cache(cache, dry_run=True)
    assert len(dry) == 2 and all(e.path.exists() for e in dry)
    removed = vcache.clean_cache(cache)
    assert {e.status for e in removed} == {"source gone", "superseded (source changed)"} and debris.exists()
    assert sorted(e.status for e in vcache.cache_entries(cache) if e.kind == "store") == ["current"] * 3
    assert (cache / "notes.txt").read_text() == "mine" and (cache / "features").is_dir()  # features: only everything
    assert "features" in {e.path.name for e in vcache.clean_cache(cache, everything=True, dry_run=True)}
    _, logs = quiet_load(root, cache_dir=cache)
    assert "from cache" in logs[-1]
    assert checksums(root) != before and set(checksums(root)) == set(before)  # only the user's own edit


def test_every_kind_of_source_has_a_current_store_until_it_changes(tmp_path):
    from test_data import make_cifar
    pytest.importorskip("pyarrow")
    make_cifar(tmp_path / "wrapped" / "cifar-10-batches-py")  # found inside the folder given
    root = make_folder(tmp_path / "pets")
    (tmp_path / "list.csv").write_text("".join(f"pets/a/{i}.bmp,a\npets/b/{i}.bmp,b\n" for i in range(4)))
    archive = tmp_path / "pets.tar"
    subprocess.run(["tar", "cf", str(archive), "-C", str(tmp_path), "pets"], check=True)
    cache = tmp_path / "c"
    for source in ("digits", tmp_path / "wrapped", root, tmp_path / "list.csv", archive):
        quiet_load(source, cache_dir=cache)
    assert [e.status for e in vcache.cache_entries(cache)] == ["current"] * 5
    keep_size_and_mtime(root / "b" / "3.bmp", rewrite_in_place)  # seen by the folder and the list, not the tar
    status = {e.source: e.status for e in vcache.cache_entries(cache)}
    changed = "superseded (source changed)"
    assert status == {"the embedded UCI digits (digits.npz)": "current", str(tmp_path / "wrapped"): "current",
                      str(root): changed, str(tmp_path / "list.csv"): changed, str(archive): "current"}


def _users_files_in(cache, store):
    """The user's own things in a cache folder: a copy of a store (header and all), a folder with a file named like
    a store header, an archive, notes, a file named like a killed write's debris, a file put into vitlab's store."""
    import shutil
    shutil.copytree(store, cache / "my-copy-of-a-store", ignore=shutil.ignore_patterns(".vitlab-cache.json"))
    (cache / "notes").mkdir()
    (cache / "notes" / "header.json").write_text('{"magic": "vitlab-image-store", "cache_version": 0}')
    (cache / "cifar-10-python.tar.gz").write_bytes(b"my archive")
    (cache / "cifar-10-batches-py").mkdir()
    (cache / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"my batch")
    (cache / "features").mkdir()
    (cache / "features" / "features-0123456789abcdef01234567.safetensors").write_bytes(b"mine")
    (cache / ".plan.json.ab12cd34.tmp").write_text("{")
    _age(cache / ".plan.json.ab12cd34.tmp", 3600)
    (store / "my-notes.txt").write_text("kept with the store")


@pytest.mark.parametrize("everything", [False, True])
def test_clean_removes_only_what_vitlab_wrote_and_lists_what_it_leaves(tmp_path, capsys, everything):
    """A cache folder that also holds the user's files: `vitlab cache clean` (and --all) removes only files in
    folders that hold vitlab's marker, whose names vitlab writes there, and names everything it leaves."""
    from vitlab.cli import main
    root = make_folder(tmp_path / "pets")
    cache = tmp_path / "c"
    b, _ = quiet_load(root, cache_dir=cache)
    store = b.store
    del b
    keep_size_and_mtime(root / "a" / "0.bmp", rewrite_in_place)  # the store is superseded
    _users_files_in(cache, store)
    mine = {p: d for p, d in checksums(cache).items() if "my-notes" in p or not p.startswith(store.name)}
    argv = ["cache", "clean", "--cache-dir", str(cache)] + (["--all"] if everything else [])
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    after = checksums(cache)
    assert {p: after.get(p) for p in mine} == mine  # every file of the user's is there, unchanged
    assert not (store / "images.u8").exists() and (store / "my-notes.txt").is_file()
    assert f"  left {store / 'my-notes.txt'} (not written by vitlab)" in out
    for name in ("my-copy-of-a-store", "notes", "cifar-10-python.tar.gz", "cifar-10-batches-py", "features"):
        assert any(line.startswith(f"left {cache / name} (other, not vitlab's") for line in out), (name, out)
    assert out[-1].startswith("removed 1 entries") and "that vitlab did not write" in out[-1]


def test_clean_of_a_cache_that_takes_no_writes_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    from vitlab.cli import main
    root = make_folder(tmp_path / "pets")
    cache = tmp_path / "c"
    quiet_load(root, cache_dir=cache)
    keep_size_and_mtime(root / "a" / "0.bmp", rewrite_in_place)
    before = checksums(cache)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(vcache.Path, "touch", read_only)
    assert main(["cache", "clean", "--all", "--cache-dir", str(cache)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vitlab cache: error: cannot clean the data cache") and "read-only" in line
    assert "Errno" not in line and checksums(cache) == before


def test_clean_keeps_a_store_being_built(tmp_path):
    import fcntl
    root = make_folder(tmp_path / "pets")
    cache = tmp_path / "c"
    b, _ = quiet_load(root, cache_dir=cache)
    store = b.store
    del b
    keep_size_and_mtime(root / "a" / "0.bmp", rewrite_in_place)  # the store is now superseded
    with open(store.with_name(f".{store.name}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert vcache.clean_cache(cache) == [] and store.exists()
    assert [e.path for e in vcache.clean_cache(cache)] == [store] and not store.exists()


def test_a_build_says_how_big_the_cache_is(tmp_path):
    _, logs = quiet_load(make_folder(tmp_path / "pets"), cache_dir=tmp_path / "c")
    assert any("the data cache" in line and "now takes" in line and "vitlab cache clean" in line for line in logs)


# ----------------------------------------------------------------------------------------------
# precision 'auto': from what the hardware supports, never from a timing


@pytest.mark.parametrize("flags, capability, expected, because", [
    ({"avx2", "fma"}, "AVX2", "fp32", "neither AMX nor AVX512-BF16 (PyTorch's CPU kernels: AVX2)"),
    ({"avx512f", "avx512bw"}, "AVX512", "fp32", "neither AMX nor AVX512-BF16"),
    ({"avx512f", "avx512_bf16"}, "AVX512", "fp32", "AVX512-BF16 but no AMX"),
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, "AVX512", "bf16", "AMX present, and bf16 training pays"),
    (set(), "DEFAULT", "fp32", "neither AMX nor AVX512-BF16"),
])
def test_auto_precision_on_a_cpu_follows_its_capabilities(monkeypatch, flags, capability, expected, because):
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    big = 100 * devices.BF16_CPU_MIN_MACS  # a model for which bf16 pays where the CPU has AMX
    assert [devices.auto_precision(torch.device("cpu"), big) for _ in range(2)] == [
        (expected, devices.auto_precision(torch.device("cpu"), big)[1])] * 2
    precision, why = devices.auto_precision(torch.device("cpu"), big)
    assert precision == expected and because in why


def test_choose_precision_is_decided_without_timing(monkeypatch):
    from types import SimpleNamespace

    from vitlab.models import create_model
    from vitlab.train import setup
    from vitlab.train.distributed import Dist
    from vitlab.train.recipe import Recipe
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("precision auto timed something"))
    logs = []
    r = Recipe(precision="auto")
    model, augment = create_model("vit_micro_patch2_8"), SimpleNamespace(img_size=(8, 8))
    got = [setup.choose_precision(r, model, augment, torch.zeros(2, 1, 8, 8), None, Dist(), logs.append)
           for _ in range(3)]
    assert got == ["fp32"] * 3
    assert logs[0].startswith("precision auto: float32 (the CPU has neither AMX nor AVX512-BF16")
    assert len(set(logs)) == 1


def test_cpu_flags_are_read_from_cpuinfo():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo on this system")
    flags = devices.cpu_flags()
    assert flags and all(f == f.strip() and f for f in flags)
    assert str(uuid.uuid4()) not in flags


# ----------------------------------------------------------------------------------------------
# generated bad input: one-line errors or a result, never a traceback, never a changed input


def _random_case(rng, root):
    """A generated data source under ``root`` of one of several kinds, most of them damaged; returns its path."""
    kind = rng.choice(["images", "csv", "tsv", "parquet", "archive", "store"])
    blob = lambda n: rng.bytes(int(n))  # noqa: E731
    if kind == "images":
        for i in range(int(rng.integers(1, 6))):
            f = root / "src" / f"c{rng.integers(0, 3)}" / f"{i}.{rng.choice(['png', 'jpg', 'bmp', 'gif'])}"
            f.parent.mkdir(parents=True, exist_ok=True)
            if rng.random() < 0.4:
                img(f.with_suffix(".png"), int(rng.integers(0, 256)), 1)
                good = f.with_suffix(".png").read_bytes()
                f.with_suffix(".png").unlink()
                f.write_bytes(good[: int(rng.integers(0, len(good) + 1))])  # whole or truncated
            else:
                f.write_bytes(blob(rng.integers(0, 300)))
        return root / "src"
    if kind in ("csv", "tsv"):
        alphabet = list(",\t\"'\n\r;:/\\.  ab01é\x00") + ["a.png", "../x.png", "1.0", "01", "label", "path"]
        text = "".join(rng.choice(alphabet) for _ in range(int(rng.integers(0, 80))))
        f = root / f"list.{kind}"
        f.write_bytes(text.encode("utf-8", "surrogatepass") if rng.random() < 0.8 else blob(50))
        return f
    if kind == "store":
        f = root / "store"
        f.mkdir()
        (f / "header.json").write_bytes(blob(40) if rng.random() < 0.5 else
                                        b'{"magic": "vitlab-image-store", "format": 1, "shape": [2, 1, 2, 2]}')
        (f / "images.u8").write_bytes(blob(rng.integers(0, 10)))
        return f
    f = root / ("x.parquet" if kind == "parquet" else "x.tar.gz")
    f.write_bytes(blob(rng.integers(0, 400)))
    return f


def test_generated_bad_sources_give_a_result_or_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    rng = np.random.default_rng(21)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(120):
        root = tmp_path / f"case{case}"
        root.mkdir()
        source = _random_case(rng, root)
        before = checksums(root)
        try:
            quiet_load(source, cache_dir=tmp_path / "cache", val_fraction=0.5)
            outcomes["loaded"] += 1
        except (ValueError, FileNotFoundError) as e:
            assert "\n" not in str(e) and str(e), (case, source, e)
            outcomes["refused"] += 1
        assert checksums(root) == before, (case, source)
    assert outcomes["loaded"] and outcomes["refused"] > 60


def test_the_cache_command_lists_and_cleans(tmp_path, capsys):
    from vitlab.cli import main
    root = make_folder(tmp_path / "pets")
    cache = tmp_path / "c"
    quiet_load(root, cache_dir=cache)
    keep_size_and_mtime(root / "b" / "2.bmp", rewrite_in_place)
    quiet_load(root, cache_dir=cache)
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum("superseded (source changed)" in line for line in out) == 1 and sum(" current " in line for line in out)
    assert out[-1].startswith(tuple("0123456789")) and f"in {cache};" in out[-1]
    assert main(["cache", "clean", "--dry-run", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("would remove 1 entries")
    assert len([e for e in vcache.cache_entries(cache) if e.kind == "store"]) == 2
    assert main(["cache", "clean", "--cache-dir", str(cache)]) == 0
    assert [e.status for e in vcache.cache_entries(cache) if e.kind == "store"] == ["current"]
    with pytest.raises(SystemExit) as exit_:
        main(["cache", "purge"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "invalid choice: 'purge'" in line and "'list'" in line


@pytest.mark.parametrize("writer", ["bytes", "torch.save", "safetensors"])
def test_a_write_onto_a_full_disk_is_one_line_and_keeps_the_previous_file(tmp_path, writer):
    from safetensors.torch import save_file
    big = {"w": torch.arange(100_000, dtype=torch.float32)}  # 400 kB: more than the disk holds
    write = {"bytes": lambda p: p.write_bytes(os.urandom(400_000)),
             "torch.save": lambda p: torch.save(big, p),
             "safetensors": lambda p: save_file(big, p)}[writer]
    with tmpfs(tmp_path / "small", "256k") as disk:
        target = disk / "checkpoint.pt"
        target.write_bytes(b"the previous checkpoint")
        with pytest.raises(ValueError, match=r"^disk full: writing .*checkpoint\.pt stopped after [0-9.]+ MiB, "
                                             r"with [0-9.]+ MiB free on its file system; the previous checkpoint\.pt "
                                             r"is kept; free some space and run again$"):
            with atomic_path(target) as tmp:
                write(tmp)
        assert target.read_bytes() == b"the previous checkpoint"
        assert sorted(p.name for p in disk.iterdir()) == ["checkpoint.pt"]


def test_the_folder_of_a_killed_extraction_is_removed_and_a_live_one_kept(tmp_path):
    from vitlab.atomic import locked_temp_folder
    dead = tmp_path / ".cifar-10-batches-py.0badc0de.tmp"
    (dead / "cifar-10-batches-py").mkdir(parents=True)
    (dead / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"half")
    _age(dead, 3600)
    user = tmp_path / ".my-folder.tmp"  # not named like vitlab's
    user.mkdir()
    _age(user, 3600)
    with locked_temp_folder(tmp_path, "cifar-10-batches-py") as live:
        (live / "x").write_bytes(b"being extracted")
        assert remove_stale_temps(tmp_path, now=time.time() + 86400) == [dead]
        assert live.exists() and user.exists()
    assert not live.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".my-folder.tmp"]


def test_a_build_reads_the_files_only_after_their_newest_change_is_a_tick_old(tmp_path, monkeypatch):
    calls = []
    real = sources.settle
    monkeypatch.setattr(sources, "settle", lambda ident: calls.append(ident) or real(ident))
    root = make_folder(tmp_path / "pets")
    quiet_load(root, cache_dir=tmp_path / "c")
    assert len(calls) == 1 and [e[0] for e in calls[0][1]] == sorted(str(p.relative_to(root))
                                                                      for p in root.rglob("*.bmp"))
    quiet_load(root, cache_dir=tmp_path / "c")
    assert len(calls) == 1  # a store found in the cache reads no image


@pytest.mark.parametrize("classes, per_class, val_fraction, one_class, empty_test", [
    (("a",), 6, 0.2, True, False),
    (("a", "b", "c"), 1, 0.2, False, True),  # every class has one image: none can be held out
    (("a", "b"), 4, 0.0, False, True),
    (("a", "b"), 4, 0.25, False, False),
])
def test_a_data_set_with_nothing_to_learn_or_to_test_is_said(tmp_path, classes, per_class, val_fraction, one_class,
                                                               empty_test):
    root = make_folder(tmp_path / "set", classes=classes, per_class=per_class)
    for _ in range(2):  # built, then found in the cache: said both times
        b, logs = quiet_load(root, cache_dir=tmp_path / "c", val_fraction=val_fraction)
        warnings = [line for line in logs if line.startswith("warning:")]
        assert any("one class ('a')" in line for line in warnings) == one_class
        assert any("test split of set is empty" in line for line in warnings) == empty_test
        assert len(warnings) == one_class + empty_test


@pytest.mark.parametrize("action", [["list"], ["clean", "--all"], ["clean", "--dry-run"]])
def test_a_cache_that_is_a_file_is_one_line(action, tmp_path, capsys, monkeypatch):
    from vitlab.cli import main
    cache = tmp_path / "notes.txt"
    cache.write_text("mine\n")
    monkeypatch.setenv("VITLAB_CACHE", str(cache))
    assert main(["cache", *action]) == 2
    said = capsys.readouterr()
    (line,) = said.err.strip().splitlines()
    assert line == (f"vitlab cache: error: the data cache {cache} is a file, not a folder; accepted: a folder, new "
                    "or the cache's own (--cache-dir, else $VITLAB_CACHE)")
    assert said.out == "" and cache.read_text() == "mine\n"
