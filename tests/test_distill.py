"""DeiT distillation: each loss against a hand computation, a frozen eval-mode teacher, end-to-end runs."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

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


def _run(*args, torchrun=False):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"] \
        if torchrun else [sys.executable]
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
