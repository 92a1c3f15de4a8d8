"""WebDataset shards: listed and counted as webdataset writes them, every training image read once an epoch by
exactly one reader whatever the ranks and workers, a run trained from a shard pattern."""
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port, stop_at_checkpoint
from PIL import Image
from safetensors.torch import load_file

import vitlab
from vitlab.data import sources
from vitlab.data.shards import ShardReader, epoch_pieces, open_shards, worker_skips
from vitlab.data.sources import load_data
from vitlab.probe.run import probe
from vitlab.runs.format import read_summary
from vitlab.train import load_recipe, train
from vitlab.train import setup as run_setup
from vitlab.train.feed import EpochPlan, ShardFeeder

wds = pytest.importorskip("webdataset")

TINY = dict(model="vit_micro_patch2_8", model_args={"in_chans": 3}, batch_size=16, precision="fp32", threads=1,
            drop_path=0.0)


def _images(n: int, classes: int, seed: int, signal: int = 150) -> tuple[np.ndarray, np.ndarray]:
    """(n, 8, 8, 3) uint8 images whose class is their dominant channel (by ``signal`` over noise), and the labels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % classes
    x = rng.integers(0, 90, (n, 8, 8, 3))
    x[np.arange(n), :, :, labels] += signal
    return x.astype(np.uint8), labels


def write_shards(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray, per_shard: int,
                 label_as: str = "cls") -> str:
    """Shards written by webdataset's own TarWriter: KEY.png + KEY.cls (or KEY.json); returns their brace pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(images) // per_shard)
    for s in range(n_shards):
        with wds.TarWriter(str(folder / f"{prefix}-{s:06d}.tar")) as sink:
            for i in range(s * per_shard, min(len(images), (s + 1) * per_shard)):
                buf = io.BytesIO()
                Image.fromarray(images[i]).save(buf, format="PNG")
                label = {"cls": int(labels[i])} if label_as == "cls" else {"json": {"label": int(labels[i])}}
                sink.write({"__key__": f"{prefix}{i:05d}", "png": buf.getvalue(), **label})
    return str(folder / f"{prefix}-{{000000..{n_shards - 1:06d}}}.tar")


@pytest.fixture
def shard_dir(tmp_path):
    x, y = _images(90, 3, 0)
    tx, ty = _images(30, 3, 1)
    train_pattern = write_shards(tmp_path / "wds", "train", x, y, per_shard=20)
    test_pattern = write_shards(tmp_path / "wds", "test", tx, ty, per_shard=16, label_as="json")
    return tmp_path / "wds", train_pattern, test_pattern


def test_shards_are_counted_with_their_labels_and_the_test_split_stored(shard_dir, cache_dir):
    folder, train_pattern, test_pattern = shard_dir
    (folder / "classes.txt").write_text("red\ngreen\nblue\n")
    (folder / "_info.json").write_text(json.dumps({"mean": [0.25, 0.5, 0.75], "std": [0.1, 0.2, 0.3]}))
    s = open_shards(train_pattern)
    assert s.counts == [20, 20, 20, 20, 10] and s.classes == ["red", "green", "blue"]
    assert list(s.labels) == [i % 3 for i in range(90)]
    data = load_data(train_pattern, test_data=test_pattern, img_size=8, log=lambda m: None)
    assert data.num_train == 90 and len(data.test.labels) == 30 and data.classes == ["red", "green", "blue"]
    assert data.mean == (0.25, 0.5, 0.75) and data.std == (0.1, 0.2, 0.3)  # as _info.json records them
    assert data.test.labels.tolist() == [i % 3 for i in range(30)]
    first = np.array(Image.open(io.BytesIO(_png(_images(30, 3, 1)[0][0])))).transpose(2, 0, 1)
    assert torch.equal(data.test.images[0], torch.from_numpy(np.ascontiguousarray(first)))
    same = load_data(f"wds:{folder}", img_size=8, log=lambda m: None)  # the folder form, the same shards
    assert same.num_train == 90 and same.store == data.store  # the test store found again


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("counts,world,workers", [([20, 20, 20, 20, 10], 2, 2), ([7], 2, 3), ([5, 1, 9], 3, 2),
                                                  ([3, 3], 4, 1)])
def test_every_sample_is_read_once_an_epoch_by_one_reader(counts, world, workers):
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    seen, per_rank = [], []
    for rank in range(world):
        mine = 0
        for worker in range(workers):
            for p in epoch_pieces(counts, 11, rank, world, worker, workers):
                seen.extend(range(offsets[p.shard] + p.start, offsets[p.shard] + p.stop))
                mine += p.stop - p.start
        per_rank.append(mine)
    assert sorted(seen) == list(range(sum(counts)))  # no image twice, none left out
    assert max(per_rank) - min(per_rank) <= 1  # the ranks take the same steps
    orders = {tuple(p.shard for p in epoch_pieces(counts, seed, 0, 1)) for seed in range(8)}
    assert len(counts) == 1 or len(orders) > 1  # the shard order changes with the epoch's seed


def test_worker_skips_follow_the_turns_of_in_order_workers():
    counts = [2, 3]  # worker 1 has one more: turns 0 1 0 1 1
    turns = [0, 1, 0, 1, 1]
    for done in range(6):
        assert worker_skips(done, counts) == [turns[:done].count(0), turns[:done].count(1)]


def test_a_reader_gives_every_image_once_and_a_resumed_reader_the_rest(shard_dir, cache_dir):
    _, train_pattern, test_pattern = shard_dir
    data = load_data(train_pattern, test_data=test_pattern, img_size=8, log=lambda m: None)
    reader = ShardReader(data.shards, buffer=16)
    reader.start(seed=5)
    whole = list(reader)
    assert sorted(i for _, _, i in whole) == list(range(90))
    assert all(label == index % 3 for _, label, index in whole)
    assert [i for _, _, i in whole] != list(range(90))  # shuffled
    reader.start(seed=5, done=37)
    assert [i for _, _, i in reader] == [i for _, _, i in whole][37:]


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_an_unreadable_training_image_stops_the_epoch_with_one_line(workers, tmp_path, shard_dir, cache_dir,
                                                                    monkeypatch):
    _, train_pattern, test_pattern = shard_dir
    with wds.TarWriter(str(tmp_path / "bad-000000.tar")) as sink:
        for i in range(10):
            image = _png(np.full((8, 8, 3), i, np.uint8)) if i != 6 else b"not an image"
            sink.write({"__key__": f"k{i}", "png": image, "cls": str(i % 3)})
    bad = str(tmp_path / "bad-{000000..000000}.tar")
    with pytest.raises(ValueError, match="sample k6 cannot be read by Pillow"):  # among the first images, read ahead
        load_data(bad, test_data=test_pattern, img_size=8, log=lambda m: None)
    monkeypatch.setattr(sources, "PEEK", 4)  # beyond them: met while training
    data = load_data(bad, test_data=test_pattern, img_size=8, log=lambda m: None)
    feeder = ShardFeeder(ShardReader(data.shards, workers=workers), torch.device("cpu"), workers)
    with pytest.raises(ValueError) as e:
        list(feeder.epoch(EpochPlan(10, 2, 0)))
    assert str(e.value).splitlines() == [str(e.value)] and "sample k6 cannot be read by Pillow" in str(e.value)


def test_missing_label_and_bad_pattern_are_one_line(tmp_path, shard_dir, cache_dir):
    with wds.TarWriter(str(tmp_path / "nolabel-000000.tar")) as sink:
        sink.write({"__key__": "a", "png": _png(np.zeros((8, 8, 3), np.uint8))})
    with pytest.raises(ValueError, match=r"sample a has no label; accepted: KEY.cls"):
        open_shards(str(tmp_path / "nolabel-{000000..000000}.tar"))
    with pytest.raises(ValueError, match=r"2 of the 3 shards .* do not exist"):
        open_shards(str(tmp_path / "nolabel-{000000..000002}.tar"))
    with pytest.raises(ValueError, match="no test split; accepted: --test-data"):
        load_data(shard_dir[1], img_size=8, log=lambda m: None)
    with wds.TarWriter(str(tmp_path / "empty-000000.tar")) as sink:
        pass
    with pytest.raises(ValueError, match="holds no sample"):
        open_shards(str(tmp_path / "empty-{000000..000000}.tar"))


@pytest.fixture
def in_process(monkeypatch):
    """Training runs read their shards in this process (no DataLoader worker processes)."""
    monkeypatch.setattr(run_setup, "SHARD_WORKERS", 0)


def test_a_run_trains_from_a_shard_pattern_seeing_every_image_once_an_epoch(shard_dir, cache_dir, tmp_path,
                                                                             monkeypatch, in_process):
    folder, train_pattern, test_pattern = shard_dir
    seen = {}
    real = ShardFeeder.epoch

    def counted(self, plan, done=0, workers=None):
        for images, labels, index in real(self, plan, done, workers):
            seen.setdefault(plan.seed, []).extend(index.tolist())
            assert labels.tolist() == [i % 3 for i in index.tolist()]
            yield images, labels, index
    monkeypatch.setattr(ShardFeeder, "epoch", counted)
    summary = train(load_recipe(None, **TINY, data=train_pattern, test_data=test_pattern, epochs=2, lr=3e-3,
                                out=str(tmp_path / "run")), log=lambda m: None)
    assert summary["num_train"] == 90 and summary["images"] == 180 and summary["num_test"] == 30
    assert [sorted(v) for v in seen.values()] == [list(range(90))] * 2
    first, second = seen.values()
    assert first != second  # another order each epoch
    assert vitlab.evaluate(str(tmp_path / "run"))["top1"] == summary["top1"]  # its own test shards, from config.yaml
    with pytest.raises(ValueError, match="streamed from WebDataset shards: a probe needs every training image"):
        probe(str(tmp_path / "run"), f"wds:{folder}", log=lambda m: None, progress=False)


@pytest.mark.parametrize("source", ["shards", "store"])
def test_a_run_stopped_within_an_epoch_resumes_there_as_if_never_stopped(source, shard_dir, cache_dir, tmp_path,
                                                                          monkeypatch, in_process):
    _, train_pattern, test_pattern = shard_dir
    data = dict(data=train_pattern, test_data=test_pattern) if source == "shards" else \
        dict(data="digits", train_fraction=0.06, model_args={})
    common = dict(TINY, **data, epochs=2, lr=3e-3, checkpoint_every=2)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(load_recipe(None, **common, out=str(whole)), log=lambda m: None)
    with monkeypatch.context() as m:
        stop_at_checkpoint(m, 4)  # steps 2 and 4 of epoch 1, its end, then step 2 of epoch 2 (6 steps an epoch)
        with pytest.raises(KeyboardInterrupt):
            train(load_recipe(None, **common, out=str(stopped)), log=lambda m: None)
    lines = []
    train(load_recipe(None, **common, out=str(stopped)), resume=True, log=lines.append)
    assert any("at image 30 of epoch 2 (step 8)" in line for line in lines), "\n".join(lines)
    assert same_weights(stopped / "model.safetensors", whole / "model.safetensors")
    assert read_summary(stopped).images == read_summary(whole).images == 2 * read_summary(whole).num_train


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


READERS = """
import json, sys
import torch.distributed as dist
from vitlab.data.shards import ShardReader
import vitlab
from vitlab.data import sources
from vitlab.data.sources import load_data
from vitlab.train.feed import EpochPlan, ShardFeeder
import torch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = load_data(sys.argv[1], test_data=sys.argv[2], img_size=8, log=lambda m: None)
feeder = ShardFeeder(ShardReader(data.shards, rank, world, 2), torch.device("cpu"), 2)
seen = {}
for epoch in range(2):
    plan = EpochPlan(data.num_train, 4, 100 + epoch, rank, world)
    seen[epoch] = [i for _, _, index in feeder.epoch(plan) for i in index.tolist()]
with open(f"{sys.argv[3]}/rank{rank}.json", "w") as f:
    json.dump(seen, f)
"""


KILLED = """
import os, signal, sys
from vitlab.cli import main
from vitlab.train import setup

real, saved = setup.save_checkpoint, []

def save_then_die(*args, **kwargs):
    real(*args, **kwargs)
    saved.append(1)
    if len(saved) == 3:
        os.kill(os.getpid(), signal.SIGKILL)

setup.save_checkpoint = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def torchrun(*args, port: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_two_processes_of_two_readers_each_see_every_image_once(shard_dir, cache_dir, tmp_path):
    _, train_pattern, test_pattern = shard_dir  # 5 shards for 2 ranks x 2 workers: one shard is split by index
    script = tmp_path / "readers.py"
    script.write_text(READERS)
    proc = torchrun(script, train_pattern, test_pattern, tmp_path, port=free_port())
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        keys = ranks[0][epoch] + ranks[1][epoch]
        assert sorted(keys) == list(range(90)), epoch  # none twice, none missing
        assert abs(len(ranks[0][epoch]) - len(ranks[1][epoch])) <= 1
    assert ranks[0]["0"] != ranks[0]["1"]
    run = tmp_path / "run"  # and a whole run under torchrun, from the shards
    proc = torchrun("-m", "vitlab", "train", "--data", train_pattern, "--test-data", test_pattern, "--model",
                    "vit_micro_patch2_8", "--model-arg", "in_chans=3", "--batch-size", "16", "--precision", "fp32",
                    "--threads", "1", "--epochs", "2", "--workers", "2", "--out", run, port=free_port())
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary.processes == 2 and summary.replicas_in_sync and summary.num_train == 90
    assert summary.images == 180


@pytest.mark.slow
def test_a_run_killed_within_an_epoch_resumes_as_if_never_stopped(shard_dir, cache_dir, tmp_path):
    _, train_pattern, test_pattern = shard_dir
    common = ["train", "--data", train_pattern, "--test-data", test_pattern, "--model", "vit_micro_patch2_8",
              "--model-arg", "in_chans=3", "--batch-size", "8", "--precision", "fp32", "--threads", "1",
              "--epochs", "2", "--workers", "2", "--checkpoint-every", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "vitlab", *common, "--out", tmp_path / "whole"], env=env, check=True,
                   capture_output=True, timeout=300)
    stopped, script = tmp_path / "stopped", tmp_path / "killed.py"
    script.write_text(KILLED)  # vitlab train, killed with -9 right after its third checkpoint within an epoch
    proc = subprocess.run([sys.executable, script, *common, "--out", stopped], env=env, capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL and not (stopped / "summary.json").exists()
    at = torch.load(stopped / "checkpoint.pt", weights_only=True)["resume_at"]
    assert at is not None and at["workers"] == 2 and at["images"] == 24  # after step 3 of 12
    resumed = subprocess.run([sys.executable, "-m", "vitlab", "train", "--resume", stopped], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at image 24 of epoch 1 (step 3)" in resumed.stderr
    assert same_weights(stopped / "model.safetensors", tmp_path / "whole" / "model.safetensors")
