"""Pre-training by feature distillation from a frozen backbone: the teacher's view of the student's batch, the loss
pieces against hand computations, the teacher's patch grid resampled to the student's, the teacher kept out of the
objective's state, a run on the digits that fine-tunes through --init, and the options it takes and refuses."""
import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.cli import main
from vitlab.objectives import create_objective, load_objective
from vitlab.objectives.distill import FeatureDistillation, feature_loss, model_features, teacher_view
from vitlab.runs.format import read_summary
from vitlab.train import load_recipe, train
from vitlab.train.tasks.feature_distillation import teacher_bf16

pytestmark = pytest.mark.usefixtures("one_thread")


def make_teacher(patch_size=16, seed=0):
    """A colour DeiT at 32x32 (a 2x2 grid at patch 16), 48 wide, with its own normalisation."""
    torch.manual_seed(seed)
    t = vitlab.create_model("deit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=patch_size, embed_dim=48,
                            depth=1, num_heads=2)
    t.pretrained_cfg.update(mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3])
    return t


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    return vitlab.save(make_teacher(), tmp_path_factory.mktemp("teacher") / "teacher")


def objective(teacher, **kw):
    enc = vitlab.create_model("vit_micro_patch2_8", num_classes=0, **kw)
    obj = create_objective("distill", enc, mean=[0.5], std=[0.5], **FeatureDistillation.teacher_facts(teacher))
    obj.attach_teacher(teacher)
    return obj


def test_the_teacher_sees_the_pixels_at_its_size_channels_and_normalisation():
    x = torch.tensor([[[[0.0, 1.0], [-1.0, 0.5]]]])  # (1, 1, 2, 2) normalised by mean 0.5, std 0.5
    same = teacher_view(x, [0.5], [0.5], [0.4, 0.5, 0.6], [0.2, 0.25, 0.3], [3, 2, 2])
    pixels = torch.tensor([[0.5, 1.0], [0.0, 0.75]])
    for c, (m, s) in enumerate(zip([0.4, 0.5, 0.6], [0.2, 0.25, 0.3])):
        assert torch.allclose(same[0, c], (pixels - m) / s)
    big = teacher_view(torch.zeros(2, 1, 8, 8), [0.5], [0.5], [0.5, 0.5, 0.5], [1, 1, 1], [3, 16, 16])
    assert big.shape == (2, 3, 16, 16) and torch.allclose(big, torch.zeros_like(big))  # grey 0.5 stays 0.5


def test_the_losses_are_one_minus_cosine_and_smooth_l1_to_standardised_teacher_vectors():
    s = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    t = torch.tensor([[0.0, 2.0], [3.0, 3.0]])
    assert feature_loss(s, t, "cosine").item() == pytest.approx((1 - 0 + 1 - 1) / 2, abs=1e-6)
    t2 = torch.tensor([[1.0, 3.0]])  # standardised: mean 2, biased var 1 -> (-1, 1)
    s2 = torch.tensor([[-1.5, 1.2]])  # differences 0.5 (quadratic zone) and 0.2
    expected = (0.5 * 0.5 ** 2 + 0.5 * 0.2 ** 2) / 2
    assert feature_loss(s2, t2, "smooth_l1").item() == pytest.approx(expected, rel=1e-3)


def test_a_vits_patch_features_are_its_output_tokens_on_the_grid():
    model = make_teacher(patch_size=8).eval()  # 4x4 grid
    x = torch.randn(2, 3, 32, 32)
    pooled, patches = model_features(model, x)
    tokens = model.forward_features(x)
    assert patches.shape == (2, 48, 4, 4) and pooled.shape == (2, 48)
    P = model.num_prefix_tokens
    assert torch.equal(patches[1, :, 2, 3], tokens[1, P + 2 * 4 + 3])
    assert P == 1 and torch.equal(pooled, tokens[:, 0])  # the class token


def test_the_teachers_grid_is_resampled_to_the_students_and_the_teacher_is_not_in_the_state():
    teacher = make_teacher().eval()  # a 2x2 grid; the digits student's is 4x4
    obj = objective(teacher).train()
    x = torch.randn(3, 1, 8, 8)
    pooled, patches = obj.teacher_features(x, (4, 4))
    t_pooled, t_grid = model_features(teacher, teacher_view(x, [0.5], [0.5], [0.4, 0.5, 0.6], [0.2, 0.25, 0.3],
                                                            [3, 32, 32]))
    assert torch.allclose(pooled, t_pooled, atol=1e-6)
    expected = F.interpolate(t_grid, size=(4, 4), mode="bilinear", align_corners=False).permute(0, 2, 3, 1)
    assert patches.shape == (3, 4, 4, 48) and torch.allclose(patches, expected, atol=1e-6)
    assert not any(k.startswith("_teacher") or "teacher." in k for k in obj.state_dict())
    owners = {n.split(".")[0] for n, _ in obj.named_parameters()}
    assert {"encoder", "pooled_head", "patch_head"} <= owners <= {"encoder", "pooled_head", "patch_head", "patch_norm"}


@pytest.mark.parametrize("kw", [{}, {"distilled": True, "class_token": True, "global_pool": "token"},
                                {"class_token": True, "global_pool": "token", "reg_tokens": 2},
                                {"global_pool": "avg", "fc_norm": True}])
def test_distillation_trains_vit_deit_register_and_gap_students_and_reaches_the_student_only(kw):
    teacher = make_teacher()
    obj = objective(teacher, **kw).train()
    out = obj(torch.randn(2, 1, 8, 8))
    assert torch.allclose(out.loss, out.pooled + out.patch) and 0 < out.pooled <= 2 and 0 < out.patch <= 2
    out.loss.backward()
    assert obj.encoder.patch_embed.proj.weight.grad is not None and obj.patch_head.weight.grad is not None
    assert all(p.grad is None for p in teacher.parameters())


def test_a_bf16_teacher_runs_in_bf16_and_auto_follows_the_inference_rule():
    teacher = make_teacher()
    assert teacher_bf16("bf16", teacher)[0] and not teacher_bf16("fp32", teacher)[0]
    assert teacher_bf16("auto", teacher)[0] is False  # 0.0006 GMACs: under any line the rule draws
    obj = objective(teacher).train()
    x = torch.randn(2, 1, 8, 8)
    fp32 = obj.teacher_features(x, (4, 4))[1]
    obj.attach_teacher(teacher, bf16=True)
    bf16 = obj.teacher_features(x, (4, 4))[1]
    assert bf16.dtype == torch.float32 and not torch.equal(fp32, bf16) and torch.allclose(fp32, bf16, atol=0.1)
    assert torch.isfinite(obj(x).loss)


def test_a_distillation_run_writes_an_encoder_that_fine_tunes(tmp_path, cache_dir, teacher_folder):
    out = tmp_path / "pre"
    summary = vitlab.pretrain("vit_micro_patch2_8", "digits", method="distill", teacher=str(teacher_folder),
                              out=out, epochs=1, train_fraction=0.1, precision="fp32", threads=1,
                              pretrain_args={"loss": "smooth_l1", "hidden_dim": 16}).summary
    assert summary["pretrain"] == "distill" and summary["teacher"] == str(teacher_folder)
    assert math.isfinite(summary["test_loss"])
    restored = load_objective(out)
    assert isinstance(restored, FeatureDistillation) and restored.loss_kind == "smooth_l1"
    assert restored.teacher_size == [3, 32, 32] and restored.teacher_mean == [0.4, 0.5, 0.6]
    r = load_recipe(None, init=str(out), data="digits", epochs=1, train_fraction=0.05, precision="fp32", threads=1,
                    out=str(tmp_path / "ft"))
    train(r, log=lambda s: None)
    assert read_summary(tmp_path / "ft").top1 is not None and vitlab.load(tmp_path / "ft").num_classes == 10


@pytest.mark.parametrize("args,said", [
    (["--method", "mae", "--teacher", "T"], "teacher='T' is not valid with pretrain='mae', which learns without a "
                                            "teacher; accepted: pretrain distill with --teacher"),
    (["--method", "distill"], "pretrain distill needs a teacher to distil: --teacher MODEL"),
    (["--method", "distill", "--teacher", "T", "--distill", "soft"], "--distill: supervised training's"),
])
def test_the_teacher_is_taken_by_distill_only_in_one_line(tmp_path, capsys, args, said):
    assert main(["pretrain", *args, "--data", "digits", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and not (tmp_path / "run").exists()


def test_pretrain_help_lists_the_teacher_and_hides_supervised_options(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--teacher" in text and "distill: loss, hidden_dim, patch_weight" in text
    assert "--tau" not in text and "--mixup" not in text and "--head-init" not in text
