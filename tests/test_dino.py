"""DINO's pieces against hand computations: the loss (centring, sharpening, the pairs of views), the teacher's
momentum and temperature schedules, the centre's EMA, the teacher's EMA, the crops and the head."""
import math

import pytest
import torch

import vitlab
from vitlab.objectives import create_objective
from vitlab.objectives.dino import (
    ProjectionHead,
    cosine_momentum,
    crop_size,
    dino_loss,
    random_crops,
    teacher_temperature,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def encoder(**kw):
    return vitlab.create_model("vit_micro_patch2_8", num_classes=0, **kw)


def test_the_loss_is_the_cross_entropy_of_centred_sharpened_teacher_views_and_other_student_views():
    teacher = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 2.0, 0.0]]])  # 2 global views, batch 1, 3 outputs
    student = torch.tensor([[[0.5, 0.0, 0.0]], [[0.0, 0.0, 1.0]], [[0.2, 0.2, 0.0]]])  # 2 global + 1 local
    center = torch.tensor([0.5, 0.0, 0.0])
    tt, ts = 0.5, 0.25

    def softmax(v):
        e = [math.exp(x) for x in v]
        return [x / sum(e) for x in e]

    t = [softmax([(a - c) / tt for a, c in zip(teacher[i, 0].tolist(), center.tolist())]) for i in range(2)]
    log_s = [[math.log(p) for p in softmax([a / ts for a in student[j, 0].tolist()])] for j in range(3)]
    pairs = [(0, 1), (0, 2), (1, 0), (1, 2)]  # teacher view i never meets student view i
    expected = sum(-sum(a * b for a, b in zip(t[i], log_s[j])) for i, j in pairs) / len(pairs)
    assert dino_loss(teacher, student, center, tt, ts).item() == pytest.approx(expected, rel=1e-5)


def test_the_momentum_follows_a_cosine_from_its_start_to_one():
    assert cosine_momentum(0, 100, 0.996) == pytest.approx(0.996)
    assert cosine_momentum(50, 100, 0.996) == pytest.approx(0.998)
    assert cosine_momentum(25, 100, 0.996) == pytest.approx(1 - 0.004 * (math.cos(math.pi / 4) + 1) / 2)
    assert cosine_momentum(100, 100, 0.996) == cosine_momentum(500, 100, 0.996) == 1.0


def test_the_teacher_temperature_warms_up_linearly_then_stays():
    assert teacher_temperature(0, 10, 0.04, 0.07) == pytest.approx(0.04)
    assert teacher_temperature(5, 10, 0.04, 0.07) == pytest.approx(0.055)
    assert teacher_temperature(10, 10, 0.04, 0.07) == teacher_temperature(99, 10, 0.04, 0.07) == 0.07
    assert teacher_temperature(0, 0, 0.04, 0.07) == 0.07


def test_a_training_step_moves_the_centre_and_then_the_teacher_by_their_momenta():
    torch.manual_seed(0)
    dino = create_objective("dino", encoder(), out_dim=8, local_crops=1, momentum=0.5, momentum_steps=4,
                            center_momentum=0.9).train()
    x = torch.randn(3, 1, 8, 8)
    out = dino(x)
    assert int(dino.steps) == 1
    assert torch.allclose(dino.center, 0.1 * out.teacher.mean(dim=(0, 1)), atol=1e-6)  # from 0: (1 - 0.9) mean
    teacher_before = [p.clone() for p in dino.teacher_encoder.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(teacher_before, dino.encoder.parameters()))  # starts as the student
    with torch.no_grad():
        for p in dino.encoder.parameters():
            p.add_(1.0)  # as if the optimiser stepped
    dino(x)  # the next step first moves the teacher, at step 0's momentum (0.5)
    m = cosine_momentum(0, 4, 0.5)
    for before, student, after in zip(teacher_before, dino.encoder.parameters(), dino.teacher_encoder.parameters()):
        assert torch.allclose(after, m * before + (1 - m) * student, atol=1e-6)
    assert not any(p.requires_grad for p in dino.teacher_encoder.parameters())


@pytest.mark.parametrize("method", ["dino", "ibot"])
def test_evaluation_changes_nothing_and_is_the_same_for_the_same_generator(method):
    dino = create_objective(method, encoder(), out_dim=8).eval()
    x = torch.randn(2, 1, 8, 8)
    state = {k: v.clone() for k, v in dino.state_dict().items()}
    a, b = (dino(x, generator=torch.Generator().manual_seed(3)).loss for _ in range(2))
    assert torch.equal(a, b) and all(torch.equal(state[k], v) for k, v in dino.state_dict().items())


def test_the_loss_reaches_the_student_only():
    dino = create_objective("dino", encoder(), out_dim=8, local_crops=2).train()
    dino(torch.randn(2, 1, 8, 8)).loss.backward()
    assert dino.encoder.patch_embed.proj.weight.grad is not None and dino.head.last.grad is not None
    assert all(p.grad is None for p in dino.teacher_encoder.parameters())


def test_crops_have_the_asked_size_and_keep_the_images_content_in_order():
    ramp = torch.arange(8.0).expand(8, 8).reshape(1, 1, 8, 8).repeat(3, 1, 1, 1)  # values rise left to right
    crops = random_crops(ramp, (4, 4), (0.05, 0.4), torch.Generator().manual_seed(0))
    assert crops.shape == (3, 1, 4, 4)
    assert (crops.diff(dim=-1) >= 0).all() and (crops.diff(dim=-2).abs() < 1e-5).all()  # no flip, rows alike
    assert crops.min() >= 0 and crops.max() <= 7
    assert not torch.equal(crops[0], crops[1])  # each image its own crop
    constant = random_crops(torch.full((2, 1, 8, 8), 0.3), (4, 4), (0.05, 0.4))
    assert torch.allclose(constant, torch.full_like(constant, 0.3))
    assert crop_size(32, 4, 0.5) == 16 and crop_size(8, 2, 0.5) == 4 and crop_size(8, 4, 0.1) == 4


def test_the_head_ends_in_unit_rows_on_a_unit_vector():
    head = ProjectionHead(6, 10, 12, 4)
    out = head(torch.randn(5, 6))
    assert out.shape == (5, 10) and out.abs().max() <= 1 + 1e-6  # cosine of two unit vectors


@pytest.mark.parametrize("kw", [{}, {"distilled": True, "class_token": True, "global_pool": "token"},
                                {"class_token": True, "global_pool": "token", "reg_tokens": 2},
                                {"global_pool": "avg", "fc_norm": True}])
def test_dino_runs_on_vit_deit_register_and_gap_encoders(kw):
    dino = create_objective("dino", encoder(**kw), out_dim=8, local_crops=1).train()
    loss = dino(torch.randn(2, 1, 8, 8)).loss
    assert torch.isfinite(loss)
    loss.backward()


def test_a_family_dino_does_not_apply_to_is_one_line():
    with pytest.raises(ValueError, match="DINO pre-training does not apply"):
        create_objective("dino", vitlab.create_model("resnet10_32", num_classes=0))
