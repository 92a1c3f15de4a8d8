"""--shard fsdp (FSDP2) on CPU processes (gloo, 2 ranks): the same run as one process, half the memory a rank,
sharded checkpoints that resume after kill -9, the ordinary run folder at the end, and one line for a bad set-up."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.train import load_recipe, train
from vitlab.train.distributed import Dist
from vitlab.train.setup import even_batches
from vitlab.train.shard import SHARDS_PREFIX, check_can_shard

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "vit_micro_patch2_8", "--batch-size", "64", "--precision", "fp32", "--threads", "1",
        "--drop-path", "0.1", "--padding", "1", "--label-smoothing", "0.1", "--cutmix", "1.0", "--mix-prob", "0.5"]
TIMEOUT = 240


def env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def torchrun(n: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
            str(29700 + os.getpid() % 200), *map(str, args)]


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=TIMEOUT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc


def metrics(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def test_without_torchrun_is_one_line(tmp_path, cache_dir):
    with pytest.raises(ValueError, match=r"shard='fsdp' needs torchrun .*accepted without torchrun: shard='none'"):
        train(load_recipe(None, model="vit_micro_patch2_8", epochs=1, out=str(tmp_path / "r"), shard="fsdp"))
    assert not (tmp_path / "r" / "checkpoint.pt").exists()


def test_a_model_without_blocks_and_options_that_keep_a_second_copy_are_refused():
    with pytest.raises(ValueError, match="resnet10_32 has no transformer blocks; accepted"):
        check_can_shard(vitlab.create_model("resnet10_32"), Dist(world=2, control=object()))
    check_can_shard(vitlab.create_model("vit_micro_patch2_8"), Dist(world=2, control=object()))  # has blocks
    with pytest.raises(ValueError, match=r"does not combine with --ema-decay, --compile \(.*accepted"):
        load_recipe(None, shard="fsdp", ema_decay=0.99, compile=True)


def test_evaluation_batches_split_every_rank_alike():
    """A sharded forward pass is a collective: every rank must evaluate as many batches as the others."""
    for n, world, batch in ((513, 2, 256), (1025, 4, 256), (360, 2, 256), (7, 3, 2)):
        b = even_batches(n, batch, world)
        shards = [n * (r + 1) // world - n * r // world for r in range(world)]
        assert b >= batch and len({-(-k // b) for k in shards}) == 1
    assert even_batches(360, 256, 2) == 256


@pytest.mark.slow
def test_sharded_run_matches_one_process_and_its_folder_loads(tmp_path, cache_dir):
    """20 steps on two ranks (crops, cutmix and drop-path drawn, gradient checkpointing and clipping composed with
    the sharding) end with the very weights of one process that cuts each batch into the same two micro-batches;
    the run folder is an ordinary one."""
    common = [*TINY, "--steps", "20", "--clip-grad", "0.5", "--cache-dir", cache_dir]
    run([sys.executable, "-m", "vitlab", "train", *map(str, common), "--accum-steps", "2",
         "--out", str(tmp_path / "one")])
    run(torchrun(2, "-m", "vitlab", "train", *common, "--shard", "fsdp", "--grad-checkpointing",
                 "--out", tmp_path / "two"))
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [20]
    assert abs(one[0]["train_loss"] - two[0]["train_loss"]) < 1e-6  # the ranks' loss sums add in another order
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["replicas_in_sync"] is True
    x = torch.randn(4, 1, 8, 8)
    m1, m2 = vitlab.load(tmp_path / "one").eval(), vitlab.load(tmp_path / "two").eval()
    with torch.no_grad():
        torch.testing.assert_close(m1(x), m2(x), atol=1e-4, rtol=1e-4)
    assert (tmp_path / "two" / "checkpoint.pt").is_file()
    assert len(list((tmp_path / "two").glob(SHARDS_PREFIX + "*"))) == 1  # the older shards removed
    ev = run([sys.executable, "-m", "vitlab", "eval", str(tmp_path / "two"), "--data", "digits", "--cache-dir",
              str(cache_dir), "--out", str(tmp_path / "ev")])
    assert abs(json.loads((tmp_path / "ev" / "summary.json").read_text())["top1"] - summary["top1"]) < 1e-9, ev.stderr


MEMORY = """
import json, sys, torch, torch.nn.functional as F, vitlab
from pathlib import Path
from vitlab.train.distributed import init_distributed, cleanup
from vitlab.train.shard import local_bytes, shard_model
dist = init_distributed("cpu")
torch.manual_seed(0)
model = vitlab.create_model("vit_micro_patch2_8", embed_dim=64, depth=4, num_heads=2)
shard_model(model, dist, "fp32")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
F.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.randint(0, 10, (4,))).backward()
opt.step()
Path(sys.argv[1], f"mem-{dist.world}-{dist.rank}.json").write_text(json.dumps(local_bytes(model, opt)))
cleanup(dist)
"""


@pytest.mark.slow
def test_each_rank_holds_about_half_the_parameters_gradients_and_optimizer_state(tmp_path):
    script = tmp_path / "mem.py"
    script.write_text(MEMORY)
    found = {}
    for n in (1, 2):  # each rank writes a file: two ranks' lines on one stdout pipe can interleave
        run(torchrun(n, script, tmp_path))
        found[n] = [json.loads(f.read_text()) for f in sorted(tmp_path.glob(f"mem-{n}-*.json"))]
    (whole,) = found[1]
    assert len(found[2]) == 2 and whole["gradients"] == whole["parameters"] and whole["optimizer"] == 2 * whole[
        "parameters"]
    for part in found[2]:
        for k in ("parameters", "gradients", "optimizer", "total"):
            assert 0.45 * whole[k] <= part[k] <= 0.55 * whole[k], (k, part, whole)


def workers_of(agent: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{agent}/task/{agent}/children").read_text().split()]
    return []


@pytest.mark.slow
def test_kill_9_of_one_rank_mid_epoch_then_resume_gives_the_uninterrupted_weights(tmp_path, cache_dir):
    common = [*TINY, "--epochs", "2", "--checkpoint-every", "5", "--shard", "fsdp", "--cache-dir", cache_dir]
    run(torchrun(2, "-m", "vitlab", "train", *common, "--out", tmp_path / "full"))
    out = tmp_path / "killed"
    agent = subprocess.Popen(torchrun(2, "-m", "vitlab", "train", *common, "--out", out), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env(), start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not list(out.glob(f"{SHARDS_PREFIX}000000010-*")) and time.monotonic() < deadline:
            assert agent.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        os.kill(workers_of(agent.pid)[-1], signal.SIGKILL)  # one rank, mid-epoch 1 (23 steps an epoch)
        agent.wait(timeout=TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode != 0 and not (out / "summary.json").exists()
    refused = run(torchrun(1, "-m", "vitlab", "train", "--resume", out), check=False)
    assert refused.returncode != 0
    assert "written by 2 processes sharding the model, and this run has 1; accepted: --resume with 2" in refused.stderr
    run(torchrun(2, "-m", "vitlab", "train", "--resume", out))
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the epoch resumed within counts its training loss from the resume on; every later figure is the same
    done, full = metrics(out), metrics(tmp_path / "full")
    assert [r["step"] for r in done] == [r["step"] for r in full] == [23, 46]
    assert [r["test_loss"] for r in done] == [r["test_loss"] for r in full]
    assert done[1]["train_loss"] == full[1]["train_loss"]
