"""Tasks: the recipe picks one, and a task's whole behaviour is its own (self-distillation from an EMA teacher as
the example of a task added in one file)."""
import json

import pytest
import torch

import vitlab
from vitlab.train import load_recipe, train
from vitlab.train.tasks import TASKS, task_for
from vitlab.train.tasks.distillation import Distillation
from vitlab.train.tasks.feature_distillation import FeatureDistillationPretraining
from vitlab.train.tasks.masked import MaskedPretraining
from vitlab.train.tasks.self_distillation import TEACHER_DECAY, SelfDistillation
from vitlab.train.tasks.supervised import Supervised


def test_the_recipe_picks_the_task(tmp_path):
    teacher = vitlab.save(vitlab.create_model("resnet10_32", num_classes=10), tmp_path / "teacher")
    cases = [({}, Supervised), ({"pretrain": "mae"}, MaskedPretraining), ({"teacher": str(teacher)}, Distillation),
             ({"distill": "self"}, SelfDistillation),
             ({"pretrain": "distill", "teacher": str(teacher)}, FeatureDistillationPretraining)]
    for values, cls in cases:
        assert type(task_for(load_recipe(None, **values), print)) is cls
    assert TASKS[-1] is Supervised and Supervised.wanted(load_recipe(None))  # the last takes any recipe
    assert len({cls.name for cls in TASKS}) == len(TASKS)


@pytest.mark.parametrize("values, message", [
    ({"distill": "self", "teacher": "somewhere"}, "distill='self' takes no --teacher"),
    ({"distill": "self", "pretrain": "mae"}, "distill: not valid with pretrain='mae'"),
])
def test_self_distillation_options_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(None, **values)


def test_the_ema_teacher_follows_the_student():
    task = SelfDistillation(load_recipe(None, distill="self", tau=2.0), lambda s: None)
    student = vitlab.create_model("vit_micro_patch2_8", num_classes=10)
    assert task.wrap(student, (0.5,), (0.25,)) is student
    loss = task.make_loss(torch.device("cpu"), [str(i) for i in range(10)], (0.5,), (0.25,))
    teacher = task.teacher
    assert teacher is not student and not any(p.requires_grad for p in teacher.parameters())
    before = teacher.head.weight.clone()
    with torch.no_grad():
        student.head.weight.add_(1.0)
    task.after_step(student)
    torch.testing.assert_close(teacher.head.weight, before + (1 - TEACHER_DECAY))
    x, targets = torch.randn(4, 1, 8, 8), torch.full((4, 10), 0.1)
    loss(x, student(x), targets).backward()  # the student learns; the teacher does not
    assert student.head.weight.grad is not None and teacher.head.weight.grad is None


def test_self_distillation_run(tmp_path, cache_dir):
    out = tmp_path / "run"
    lines = []
    summary = train(load_recipe(None, model="vit_micro_patch2_8", distill="self", epochs=2, train_fraction=0.2,
                                precision="fp32", threads=1, out=str(out)), log=lines.append)
    assert summary["distill"] == "self" and summary["top1"] is not None and summary["epochs"] == 2
    assert any(line.startswith("teacher: an EMA copy of the student") for line in lines)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["train_acc"] is not None for r in rows)
    assert vitlab.load(out).num_classes == 10
