"""DeiT distillation: each loss against a hand computation, a frozen eval-mode teacher, end-to-end runs."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import free_port

import vitlab
from vitlab.train.tasks.distillation import TrainLoss


class FixedTeacher(nn.Module):
    """Returns given logits whatever the input; has a BatchNorm to show it runs in eval mode."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits
        self.bn = nn.BatchNorm1d(1)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        self.bn(x.flatten(1)[:, :1])  # would update running stats in training mode
        return self.logits * self.scale


def _batch():
    torch.manual_seed(1)
    cls = torch.randn(4, 3, requires_grad=True)
    dist = torch.randn(4, 3, requires_grad=True)
    teacher = torch.randn(4, 3)
    targets = torch.tensor([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.3, 0.6, 0.1], [0.05, 0.05, 0.9]])
    return cls, dist, teacher, targets


def _ce(logits, target_probs):
    """Cross-entropy by hand: -sum(t * log softmax) averaged over the batch."""
    rows = []
    for z, t in zip(logits.tolist(), target_probs.tolist()):
        log_z = math.log(sum(math.exp(v) for v in z))
        rows.append(-sum(ti * (zi - log_z) for zi, ti in zip(z, t)))
    return sum(rows) / len(rows)


def _softmax(z, tau=1.0):
    e = [math.exp(v / tau) for v in z]
    return [v / sum(e) for v in e]


def test_hard_distillation_loss_by_hand():
    cls, dist, teacher, targets = _batch()
    loss = TrainLoss(FixedTeacher(teacher), "hard", alpha=0.5)(torch.zeros(4, 1, 2, 2), (cls, dist), targets)
    hard = torch.nn.functional.one_hot(teacher.argmax(1), 3).float()
    expect = 0.5 * _ce(cls.detach(), targets) + 0.5 * _ce(dist.detach(), hard)
    assert loss.item() == pytest.approx(expect, rel=1e-6)


def test_soft_distillation_loss_by_hand():
    cls, dist, teacher, targets = _batch()
    tau, alpha = 2.0, 0.3
    loss = TrainLoss(FixedTeacher(teacher), "soft", tau=tau, alpha=alpha)(torch.zeros(4, 1, 2, 2), (cls, dist),
                                                                          targets)
    kl = 0.0
    for s, t in zip(dist.tolist(), teacher.tolist()):
        p, q = _softmax(t, tau), _softmax(s, tau)
        kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    expect = (1 - alpha) * _ce(cls.detach(), targets) + alpha * tau * tau * kl / 4
    assert loss.item() == pytest.approx(expect, rel=1e-5)


def test_student_without_token_is_distilled_through_its_class_head():
    cls, _, teacher, targets = _batch()
    loss = TrainLoss(FixedTeacher(teacher), "hard", alpha=0.5)(torch.zeros(4, 1, 2, 2), cls, targets)
    hard = torch.nn.functional.one_hot(teacher.argmax(1), 3).float()
    assert loss.item() == pytest.approx(0.5 * _ce(cls.detach(), targets) + 0.5 * _ce(cls.detach(), hard), rel=1e-6)


def test_no_teacher_trains_both_heads_on_the_targets():
    cls, dist, _, targets = _batch()
    loss = TrainLoss()(torch.zeros(4, 1, 2, 2), (cls, dist), targets)
    assert loss.item() == pytest.approx((_ce(cls.detach(), targets) + _ce(dist.detach(), targets)) / 2, rel=1e-6)


def test_teacher_gets_no_gradient_and_stays_in_eval_mode():
    cls, dist, teacher_logits, targets = _batch()
    teacher = FixedTeacher(teacher_logits)
    teacher.train()
    loss_fn = TrainLoss(teacher, "soft", tau=3.0)
    loss_fn.train()  # the training loop calls this every epoch
    assert not teacher.training
    running = teacher.bn.running_mean.clone()
    loss = loss_fn(torch.randn(4, 1, 2, 2), (cls, dist), targets)
    loss.backward()
    assert teacher.scale.grad is None and not teacher.scale.requires_grad
    assert torch.equal(teacher.bn.running_mean, running)
    assert cls.grad is not None and dist.grad is not None


def test_teacher_input_is_renormalised_and_converted():
    teacher = vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8), img_size=16)
    teacher.pretrained_cfg.update(mean=[0.2, 0.3, 0.4], std=[0.5, 0.6, 0.7])
    loss_fn = TrainLoss(teacher, "hard", student_norm=((0.5,), (0.25,)), teacher_norm=([0.2, 0.3, 0.4],
                                                                                      [0.5, 0.6, 0.7]))
    raw = torch.rand(2, 1, 16, 16)
    x = (raw - 0.5) / 0.25
    t = loss_fn.teacher_input(x)
    expect = (raw.expand(-1, 3, -1, -1) - torch.tensor([0.2, 0.3, 0.4]).view(1, 3, 1, 1)) / \
        torch.tensor([0.5, 0.6, 0.7]).view(1, 3, 1, 1)
    torch.testing.assert_close(t, expect)


class LinearTeacher(nn.Module):
    """A linear teacher of 2x2 grey images that counts its calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x.flatten(1))


def test_teacher_once_keeps_each_image_s_mean_with_its_mirror_and_looks_it_up_by_index():
    teacher = LinearTeacher()
    images = torch.randint(0, 256, (6, 1, 2, 2), dtype=torch.uint8)
    loss_fn = TrainLoss(teacher, "hard", alpha=0.5)
    loss_fn.predict_once(images, (0.5,), (0.25,), batch_size=4)
    x = (images.float() / 255 - 0.5) / 0.25
    with torch.no_grad():
        expect = (teacher.fc(x.flatten(1)) + teacher.fc(x.flip(-1).flatten(1))) / 2
    torch.testing.assert_close(loss_fn.kept, expect)
    calls = teacher.calls
    cls, dist, _, targets = _batch()
    index = torch.tensor([5, 0, 3, 3])
    loss = loss_fn(torch.zeros(4, 1, 2, 2), (cls, dist), targets, index)
    hard = torch.nn.functional.one_hot(expect[index].argmax(1), 3).float()
    assert loss.item() == pytest.approx(0.5 * _ce(cls.detach(), targets) + 0.5 * _ce(dist.detach(), hard), rel=1e-6)
    assert teacher.calls == calls  # looked up, not predicted again
    with pytest.raises(ValueError, match="index in the training set"):
        loss_fn(torch.zeros(4, 1, 2, 2), (cls, dist), targets)


def test_a_convolutional_teacher_runs_channels_last_with_the_same_predictions(tmp_path):
    """A teacher with convolutional stages runs channels-last, weights and input (its forward pass alone is faster
    so), and predicts what it predicts contiguous; a ViT teacher with a patch embedding alone stays contiguous."""
    from vitlab.train import load_recipe
    from vitlab.train.tasks.distillation import Distillation
    torch.manual_seed(0)
    cnn = vitlab.create_model("resnet10_32", num_classes=10, widths=[8, 8, 8, 8])
    vitlab.save(cnn, tmp_path / "cnn")
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    kept = {}
    for channels_last in (False, True):
        loss_fn = TrainLoss(vitlab.load(tmp_path / "cnn"), "soft", teacher_channels_last=channels_last)
        loss_fn.predict_once(images, (0.5,) * 3, (0.25,) * 3, batch_size=4)
        kept[channels_last] = loss_fn.kept
        conv = next(m for m in loss_fn.teacher.modules() if isinstance(m, nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert loss_fn.teacher_input(torch.randn(2, 3, 32, 32)).is_contiguous(
            memory_format=torch.channels_last) == channels_last
    torch.testing.assert_close(kept[True], kept[False], rtol=1e-4, atol=1e-4)
    vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=10), tmp_path / "vit")
    for folder, expect in (("cnn", True), ("vit", False)):
        task = Distillation(load_recipe(None, model="vit_micro_patch2_8", teacher=str(tmp_path / folder)), print)
        loss_fn = task.make_loss(torch.device("cpu"), [str(c) for c in range(10)], (0.5,) * 3, (0.25,) * 3)
        assert loss_fn.teacher_channels_last == expect


def test_teacher_fit_counts_the_matches_and_the_probability_off_the_label():
    from vitlab.train.tasks.distillation import teacher_fit
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])
    labels = torch.tensor([0, 2, 2, 1])
    fit = teacher_fit(logits, labels)
    probs = torch.softmax(logits, 1)
    off = 1 - probs[torch.arange(4), labels].mean().item()
    assert fit["match"] == pytest.approx(2 / 4)  # rows 0 and 2; row 3's argmax is class 0
    assert fit["off_label"] == pytest.approx(off, rel=1e-6)
    hot = teacher_fit(torch.nn.functional.one_hot(labels, 3).float() * 100, labels)
    assert hot == {"match": 1.0, "off_label": pytest.approx(0.0, abs=1e-6)}  # the labels themselves: nothing beyond
    assert teacher_fit(logits, labels, tau=3.0)["off_label"] > fit["off_label"]  # a higher temperature spreads them
    with pytest.raises(ValueError, match=r"logits \(N, classes\) and labels \(N,\)"):
        teacher_fit(logits, labels[:3])


class Clock:
    """A fake clock: every reading is 0.05 s after the one before, and ``t`` may be moved on by hand."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.05
        return self.t


def test_teacher_once_predicts_before_the_first_step_and_counts_it_as_training_time(tmp_path, cache_dir,
                                                                                     monkeypatch):
    """The student's run makes the teacher's predictions once (50 s on the fake clock), counts them in its training
    seconds, and never runs the teacher in a step."""
    from vitlab.train import load_recipe, train
    teacher_out = tmp_path / "teacher"
    train(load_recipe(None, model="vit_micro_patch2_8", epochs=1, precision="fp32", threads=1, out=str(teacher_out)))
    clock, made = Clock(), {}
    real = TrainLoss.predict_once

    def predict_once(self, images, *args, **kwargs):
        real(self, images, *args, **kwargs)
        clock.t += 50
        made["images"], made["kept"] = len(images), self.kept
        self.teacher.forward = lambda x: pytest.fail("the teacher ran in a step")

    monkeypatch.setattr(TrainLoss, "predict_once", predict_once)
    from vitlab.train.tasks import distillation
    real_fit = distillation.teacher_fit

    def teacher_fit(logits, labels, tau=1.0):
        made["labels"] = labels
        return real_fit(logits, labels, tau)

    monkeypatch.setattr(distillation, "teacher_fit", teacher_fit)
    lines = []
    summary = train(load_recipe(None, model="vit_micro_patch2_8", teacher=str(teacher_out), teacher_once=True,
                                mixup=0, cutmix=0, epochs=1, batch_size=64, precision="fp32", threads=1,
                                out=str(tmp_path / "student")), log=lines.append, now=clock)
    assert made["kept"].shape == (made["images"], 10) and made["images"] == summary["num_train"]
    assert any(line.endswith("made once in 50 s (counted as training time)") for line in lines), lines
    assert made["labels"].shape == (summary["num_train"],) and set(made["labels"].tolist()) == set(range(10))
    fit = real_fit(made["kept"], made["labels"])
    said = f"the teacher's predictions match {fit['match']:.2%} of the training labels and put " \
        f"{fit['off_label']:.3f} of their probability (at temperature 1) on the other classes, on average"
    assert any(line.endswith(said) for line in lines), lines
    assert 50 < summary["train_seconds"] < 50 + 200 * 0.05  # the predictions, then one epoch's readings
    assert summary["distill"] == "hard"


@pytest.mark.parametrize("options, message", [
    ({"teacher_once": True}, "teacher_once needs a teacher model"),
    ({"teacher_once": True, "distill": "self"}, "not distill='self'"),
    ({"teacher_once": True, "teacher": "t", "mixup": 0.2, "cutmix": 0}, "not the images that mixup 0.2 mix"),
])
def test_teacher_once_without_a_teacher_or_with_mixed_images_is_refused(options, message):
    from vitlab.train import load_recipe
    with pytest.raises(ValueError, match=message):
        load_recipe(None, **options)


def _run(*args, torchrun=False):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port())] if torchrun else [sys.executable]
    proc = subprocess.run([*prefix, "-m", "vitlab", "train", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "run"
    _run("--model", "resnet10_32", "--model-arg", "widths=[16,32,32,32]", "--epochs", "3", "--precision", "fp32",
         "--threads", "1", "--out", out)
    return out


@pytest.mark.slow
def test_distilled_student_end_to_end(tmp_path, teacher_run):
    """Hard distillation under a time budget; the saved student evaluates each head and returns their mean."""
    out = tmp_path / "student"
    _run("--model", "vit_micro_patch2_8", "--model-arg", "distilled=true", "--model-arg", "class_token=true",
         "--model-arg", "global_pool=token", "--teacher", teacher_run,
         "--distill", "hard", "--time-budget", "0.2", "--precision", "fp32", "--threads", "1", "--out", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["distill"] == "hard" and set(summary["heads"]) == {"cls", "dist", "mean"}
    assert summary["train_seconds"] < 12 + 1  # the budget counts training time, from the first step
    student = vitlab.load(out)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        feats = student.forward_features(x)
        mean = (student.head(feats[:, 0]) + student.head_dist(feats[:, 1])) / 2
        torch.testing.assert_close(student(x), mean)


@pytest.mark.slow
def test_soft_distillation_under_torchrun(tmp_path, teacher_run):
    out = tmp_path / "student2"
    _run("--model", "vit_micro_patch2_8", "--teacher", teacher_run, "--distill", "soft", "--tau", "2",
         "--epochs", "2", "--precision", "fp32", "--out", out, torchrun=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["distill"] == "soft" and summary["epochs"] == 2
