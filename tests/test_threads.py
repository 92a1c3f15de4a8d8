"""The default CPU thread count: from the work of a training step and the cores other work leaves free, with the
machine's readings injected (no timing)."""
import pytest
import torch

import vitlab
from vitlab.devices import FLOPS_PER_THREAD, TICKS_PER_SECOND, busy_cores, choose_threads, set_cpu_threads
from vitlab.models.summary import matmul_flops
from vitlab.train.recipe import load_recipe
from vitlab.train.trainer import train

DIGITS_STEP = 0.4e9  # the digits model's step at batch 32
CIFAR_STEP = 200e9  # a 5M-parameter ViT's step on 32x32 images at batch 128


@pytest.mark.parametrize("step, cores, busy, expected", [
    (DIGITS_STEP, 2, 0.0, 1),    # too little work to split, even on an idle machine
    (DIGITS_STEP, 64, 0.0, 1),
    (CIFAR_STEP, 2, 0.0, 2),     # work for many threads: every core
    (CIFAR_STEP, 2, 0.3, 2),     # a little background work does not take a core
    (CIFAR_STEP, 2, 1.0, 1),     # one core taken: the other
    (CIFAR_STEP, 2, 2.0, 1),     # two CPU-bound processes on two cores: one thread, never none
    (CIFAR_STEP, 2, 5.0, 1),
    (CIFAR_STEP, 16, 4.2, 12),
    (3 * FLOPS_PER_THREAD, 16, 0.0, 3),  # as many threads as the step has work for
])
def test_threads_follow_the_work_and_the_free_cores(step, cores, busy, expected):
    threads, why = choose_threads(step, cores, busy)
    assert threads == expected
    assert f"{max(0, cores - round(busy))} of {cores} cores free" in why and "GMACs a step" in why


def test_busy_cores_leave_out_this_process_and_survive_a_missing_proc_stat():
    readings = iter([(100.0, 400.0), (250.0, 600.0)])  # (busy, total) jiffies over 2 cores: 150 of 200 busy
    own = iter([1.0, 1.5])  # of which this process used 0.5 s
    busy = busy_cores([0, 1], read=lambda cores: next(readings), own=lambda: next(own), sleep=lambda s: None)
    assert busy == pytest.approx(2 * (150 - 0.5 * TICKS_PER_SECOND) / 200)
    assert busy_cores([0, 1], read=lambda cores: None, sleep=lambda s: None) == 0.0
    idle = iter([(100.0, 400.0), (100.0, 600.0)])
    assert busy_cores([0, 1], read=lambda cores: next(idle), own=lambda: 0.0, sleep=lambda s: None) == 0.0


def test_omp_num_threads_decides_when_set(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    assert set_cpu_threads(CIFAR_STEP) == f"threads: {before} (OMP_NUM_THREADS)"
    assert torch.get_num_threads() == before


def test_matmul_flops_counts_linear_and_conv_layers_and_leaves_the_model_as_it_was():
    model = vitlab.create_model("vit_micro_patch2_8", num_classes=10).train()
    # patch embedding (a 2x2 conv to 64 channels, 16 positions), 4 blocks of qkv, proj and a 2x MLP, the head
    per_block = 16 * 2 * (64 * 192 + 64 * 64 + 64 * 128 + 128 * 64)
    expected = 16 * 2 * 64 * 4 + 4 * per_block + 2 * 64 * 10
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    assert matmul_flops(model, torch.zeros(1, 1, 8, 8)) == expected
    assert model.training and torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_the_run_logs_its_thread_choice_and_an_explicit_count_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("vitlab.devices.busy_cores", lambda cores: float(len(cores)))  # every core taken
    quick = dict(data="digits", epochs=1, batch_size=256, precision="fp32", train_fraction=0.2)
    lines = []
    train(load_recipe(None, **quick, out=str(tmp_path / "auto")), log=lines.append)
    assert any(line.startswith("threads: 1 (") and "cores free" in line for line in lines)
    lines.clear()
    train(load_recipe(None, **quick, threads=2, out=str(tmp_path / "two")), log=lines.append)
    assert not any(line.startswith("threads:") for line in lines)
