"""Training, evaluation and prediction on a device other than the CPU, tested on a machine without a GPU.

Two stand-ins for a GPU: the ``meta`` device runs the whole training step (augmentation, forward,
backward, AdamW, EMA) and raises when a CPU tensor meets a device tensor in an op; PyTorch's
``FakeTensorMode`` makes ``cuda`` tensors on this CPU-only build and also catches what ``meta``
lets through (a CPU zero-dim running total that a device value is added into). Neither can read a
value back (``.item()``): the code under test keeps values on the device until one read at the end.
"""
import socket

import pytest
import torch
import torch.nn as nn
from conftest import FAMILIES, FAMILY
from torch._subclasses.fake_tensor import FakeTensorMode

import vitlab
from vitlab.data.augment import AugmentConfig, BatchAugment, normalize
from vitlab.infer.predict import class_probabilities
from vitlab.metrics import confusion_counts, head_logits
from vitlab.train.feed import BatchFeeder
from vitlab.train.optim import param_groups
from vitlab.train.progressive import any_size
from vitlab.train.step import Batch, EpochMeter, Stepper, train_step
from vitlab.train.tasks.distillation import TrainLoss
from vitlab.train.tasks.supervised import HeadsLoss

META = torch.device("meta")


def small(family: str, **kw) -> nn.Module:
    """A family's small model (on the meta device each op runs through Python reference code)."""
    return FAMILY[family].create(num_classes=10, **kw)


EVERYTHING_ON = AugmentConfig(crop="pad", auto_augment="rand", random_erasing=0.5, mixup=0.8, cutmix=1.0)


def tensors_of(*modules):
    for m in modules:
        yield from m.parameters()
        yield from m.buffers()


def batch_for(model, n=8, device=META):
    c, h, w = model.pretrained_cfg["input_size"]
    return (torch.empty(n, c, h, w, dtype=torch.uint8, device=device),
            torch.empty(n, dtype=torch.long, device=device))


@pytest.mark.parametrize("name, cfg", [(f.id, EVERYTHING_ON) for f in FAMILIES] + [
    ("vit", AugmentConfig(crop="rrc", auto_augment="trivial", repeated_aug=3))])
def test_train_step_on_another_device(name, cfg):
    """Every tensor the step makes or combines lives on the model's device: augmentation parameters drawn on
    the host reach it by copy, never by mixing; gradients, optimiser state and the EMA stay there."""
    model = small(name).to(META)
    ema = small(name).to(META).requires_grad_(False)
    c, h, w = model.pretrained_cfg["input_size"]
    augment = BatchAugment(cfg, (h, w), (0.5,) * c, (0.25,) * c, 10).to(META)
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3)
    images, labels = batch_for(model)
    fixed = bool(model.fixed_size)  # MLP-Mixer: its own size only
    if not fixed:
        any_size(model)
    for size in [(h // 2, w // 2)] * (not fixed) + [None]:  # progressive resizing, then full size
        loss, hits = train_step(Stepper(model, augment, HeadsLoss(), optimizer, clip_grad=1.0, ema=ema, ema_decay=0.99,
                                        accum_steps=2), Batch(images, labels, size))
    assert loss.device == META and hits.device == META
    assert all(t.device == META for t in tensors_of(model, ema))
    assert all(p.grad is None or p.grad.device == META for p in model.parameters())
    for s in optimizer.state.values():
        assert all(v.device == META for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def test_distillation_step_on_another_device():
    student = small("deit").to(META)
    teacher = vitlab.create_model("resnet10_32", num_classes=10).to(META)
    teacher.pretrained_cfg["mean"], teacher.pretrained_cfg["std"] = [0.4, 0.4, 0.4], [0.2, 0.2, 0.2]
    augment = BatchAugment(EVERYTHING_ON, (32, 32), (0.5,) * 3, (0.25,) * 3, 10).to(META)
    for kind in ("hard", "soft"):
        loss_fn = TrainLoss(teacher, kind, tau=2.0, student_norm=((0.5,) * 3, (0.25,) * 3),
                            teacher_norm=(teacher.pretrained_cfg["mean"], teacher.pretrained_cfg["std"]))
        optimizer = torch.optim.AdamW(param_groups(student, 0.05), lr=1e-3)
        loss, _ = train_step(Stepper(student, augment, loss_fn, optimizer, clip_grad=1.0), Batch(*batch_for(student)))
        assert loss.device == META


@pytest.mark.parametrize("name", FAMILY)
def test_evaluation_and_prediction_on_another_device(name):
    model = small(name).to(META)
    images, labels = batch_for(model, n=6)
    c = images.shape[1]
    for tta in (False, True):
        counts = confusion_counts(model, images, labels, (0.5,) * c, (0.25,) * c, 10, batch_size=4, tta=tta)
        assert {t.device for c_ in counts.values() for t in c_.values()} == {META}
        assert counts["logits"]["confusion"].shape == (10, 10)
    host_images = torch.zeros(6, *images.shape[1:], dtype=torch.uint8)  # images on the host, model on the device
    counts = confusion_counts(model, host_images, torch.zeros(6, dtype=torch.long), (0.5,) * c, (0.25,) * c, 10)
    assert counts["logits"]["top5"].device == META
    probs = class_probabilities(model, host_images)
    assert probs.device == META and probs.shape == (6, 10)


# --- FakeTensorMode: cuda tensors without a GPU ------------------------------------------------------------


def fake_cuda_module(module: nn.Module) -> nn.Module:
    """Replace a module's parameters and buffers by fake cuda tensors (call inside FakeTensorMode)."""
    with torch.no_grad():
        for m in module.modules():
            for n, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda"),
                                                    requires_grad=False)
            for n, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return module


def test_fake_cuda_catches_a_cpu_running_total():
    """The check the tests below rely on: adding a cuda value into a CPU total raises, as on a real GPU."""
    with FakeTensorMode():
        loss = torch.empty((), device="cuda")
        with pytest.raises(RuntimeError):
            torch.zeros(()).add_(loss * 8)


def test_epoch_meter_keeps_totals_on_cuda():
    with FakeTensorMode():
        cuda = torch.device("cuda", 0)
        meter = EpochMeter(cuda)
        for _ in range(3):
            meter.add(torch.empty((), device=cuda), torch.empty((), dtype=torch.long, device=cuda), 8)
        assert meter.sums.device == cuda


def test_evaluation_counts_on_cuda():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    with FakeTensorMode():
        cuda = torch.device("cuda", 0)
        fake_cuda_module(model)
        images = torch.empty(10, 3, 8, 8, dtype=torch.uint8, device=cuda)
        labels = torch.empty(10, dtype=torch.long, device=cuda)
        counts = confusion_counts(model, images, labels, (0.5,) * 3, (0.25,) * 3, 10, batch_size=4, tta=True)
        assert {t.device for t in counts["logits"].values()} == {cuda}
        assert head_logits(model, normalize(images, (0.5,) * 3, (0.25,) * 3))["logits"].device == cuda


def test_batch_feeder_gathers_on_cuda():
    with FakeTensorMode():
        cuda = torch.device("cuda", 0)
        feeder = BatchFeeder(torch.empty(20, 3, 8, 8, dtype=torch.uint8, device=cuda),
                             torch.empty(20, dtype=torch.long, device=cuda), cuda)
        idx = [torch.empty(4, dtype=torch.long, device=cuda) for _ in range(3)]
        got = list(feeder.batches(idx))
        assert len(got) == 3 and all(x.device == cuda and y.device == cuda and x.shape == (4, 3, 8, 8)
                                     for x, y in got)


def test_batch_feeder_copies_host_batches_to_the_device():
    images = torch.arange(20, dtype=torch.uint8).view(20, 1, 1, 1).expand(20, 1, 2, 2).contiguous()
    feeder = BatchFeeder(images, torch.arange(20), META, on_device=False)
    assert feeder.images.device.type == "cpu"  # the set stays on the host
    x, y = feeder.gather(torch.tensor([3, 1]))
    assert x.device == META and y.device == META and x.shape == (2, 1, 2, 2)
    cpu = BatchFeeder(images, torch.arange(20), torch.device("cpu"), on_device=False)
    x, y = next(cpu.batches([torch.tensor([3, 1])]))
    assert y.tolist() == [3, 1] and x[:, 0, 0, 0].tolist() == [3, 1]


# --- several processes: one clock, identical replicas ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from vitlab.train.clock import RunClock
    from vitlab.train.distributed import Dist, replicas_agree
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        d = Dist(rank, world, 0, torch.device("cpu"), dist.group.WORLD)
        # each rank's own clock says something else; all follow rank 0's
        clock = RunClock(d, total_steps=10, budget_seconds=100.0, seconds=30.0 if rank == 0 else 90.0)
        progress = clock.progress(step=0)
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        same = replicas_agree(model, d)
        if rank == 1:
            with torch.no_grad():
                model.bias[0] += 1e-7  # one tensor one ulp-ish off on one rank
        differ = not replicas_agree(model, d)
        results[rank] = (progress, same, differ)
    finally:
        dist.destroy_process_group()


def test_rank_zero_owns_the_clock_and_replicas_are_compared_bit_for_bit():
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=_replica_worker, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    (p0, same0, differ0), (p1, same1, differ1) = results[0], results[1]
    assert p0 == p1 and 0.3 <= p0 < 0.4  # rank 0's 30 s of 100, on both ranks
    assert same0 and same1 and differ0 and differ1


def test_accumulation_matches_one_big_batch():
    """Two micro-batches of 4 give the step of one batch of 8 (no augmentation, no dropout)."""
    off = AugmentConfig(crop="none", hflip=False, auto_augment="none", random_erasing=0.0, mixup=0.0, cutmix=0.0,
                        label_smoothing=0.0)
    images = torch.randint(0, 256, (8, 1, 8, 8), dtype=torch.uint8)
    labels = torch.arange(8) % 10
    results = []
    for accum in (1, 2):
        torch.manual_seed(0)
        model = vitlab.create_model("vit_micro_patch2_8", num_classes=10, drop_path_rate=0.0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(Stepper(model, BatchAugment(off, (8, 8), (0.5,), (0.25,), 10), HeadsLoss(), optimizer,
                           accum_steps=accum), Batch(images, labels))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_unequal_rank_shares_average_to_the_whole_batch_step():
    """A batch of 9 over two ranks (5 + 4 images): each rank weighs its loss by its share, so the average of the
    ranks' steps (what DistributedDataParallel's gradient mean gives with SGD) is the one-process step; unweighted,
    it is not."""
    off = AugmentConfig(crop="none", hflip=False, auto_augment="none", random_erasing=0.0, mixup=0.0, cutmix=0.0,
                        label_smoothing=0.0)
    images = torch.randint(0, 256, (9, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(9) % 10

    def step(idx: torch.Tensor, share: float) -> torch.Tensor:
        torch.manual_seed(0)
        model = vitlab.create_model("vit_micro_patch2_8", num_classes=10, drop_path_rate=0.0)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(Stepper(model, BatchAugment(off, (8, 8), (0.5,), (0.25,), 10), HeadsLoss(), optimizer),
                   Batch(images[idx], labels[idx], share=share))
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - before

    whole = step(torch.arange(9), 1.0)
    shards = [torch.arange(9)[r::2] for r in range(2)]
    weighted = sum(step(s, len(s) * 2 / 9) for s in shards) / 2
    plain = sum(step(s, 1.0) for s in shards) / 2
    torch.testing.assert_close(weighted, whole, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(plain, whole, rtol=1e-4, atol=1e-7)
