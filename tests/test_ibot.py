"""iBOT's pieces against hand computations: the masked-patch loss, the mask token in place of the masked patches'
embeddings, the patch centre's EMA; and the objective on ViT, DeiT, register and GAP encoders, in bf16 too."""
import math

import pytest
import torch

import vitlab
from vitlab.objectives import create_objective
from vitlab.objectives.dino import encoded_tokens
from vitlab.objectives.ibot import masked_patch_loss
from vitlab.train import load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def encoder(**kw):
    return vitlab.create_model("vit_micro_patch2_8", num_classes=0, **kw)


def softmax(v):
    e = [math.exp(x) for x in v]
    return [x / sum(e) for x in e]


def test_the_patch_loss_is_the_cross_entropy_over_each_images_masked_patches():
    teacher = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]]])  # 1 crop, 1 image, 3 patches, 2 outputs
    student = torch.tensor([[[[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]]]])
    mask = torch.tensor([[[1.0, 0.0, 1.0]]])
    center, tt, ts = torch.tensor([0.5, 0.0]), 0.5, 0.25

    def ce(p):
        t = softmax([(a - c) / tt for a, c in zip(teacher[0, 0, p].tolist(), center.tolist())])
        log_s = [math.log(x) for x in softmax([a / ts for a in student[0, 0, p].tolist()])]
        return -sum(a * b for a, b in zip(t, log_s))

    expected = (ce(0) + ce(2)) / 2  # the visible patch 1 does not count
    assert masked_patch_loss(teacher, student, mask, center, tt, ts).item() == pytest.approx(expected, rel=1e-5)
    none = masked_patch_loss(teacher, student, torch.zeros_like(mask), center, tt, ts)
    assert none.item() == 0.0  # an image without a masked patch adds nothing


def test_a_masked_patchs_pixels_do_not_reach_the_student():
    ibot = create_objective("ibot", encoder(class_token=True, global_pool="token"), out_dim=8).eval()
    with torch.no_grad():
        ibot.mask_token.normal_()
    x = torch.randn(2, 1, 8, 8)
    mask = torch.zeros(2, 16)
    mask[:, 5] = 1  # the patch at row 1, column 1 of the 4x4 grid: pixels 2-3, 2-3
    changed = x.clone()
    changed[:, :, 2:4, 2:4] += 3.0
    a = encoded_tokens(ibot.encoder, x, mask, ibot.mask_token)
    assert torch.allclose(a, encoded_tokens(ibot.encoder, changed, mask, ibot.mask_token), atol=1e-6)
    assert not torch.allclose(encoded_tokens(ibot.encoder, x), encoded_tokens(ibot.encoder, changed), atol=1e-3)


def test_a_training_step_moves_the_patch_centre_by_its_momentum():
    torch.manual_seed(0)
    ibot = create_objective("ibot", encoder(), out_dim=8, local_crops=0, center_momentum=0.9).train()
    x = torch.randn(3, 1, 8, 8)
    global_crops, _ = ibot.crops(x, torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, t_patch = ibot.outputs(ibot.teacher_encoder, ibot.teacher_head, ibot.teacher_patch_norm,
                                  torch.cat(global_crops))
    out = ibot(x, generator=torch.Generator().manual_seed(4))  # the same crops
    assert torch.allclose(ibot.patch_center, 0.1 * t_patch.mean(dim=(0, 1)), atol=1e-6)
    assert out.mask.shape == (2, 3, 16) and torch.equal(out.mask.sum(-1), torch.full((2, 3), 16 - int(16 * 0.7)))
    assert torch.allclose(out.loss, out.cls_loss + out.patch_loss)


@pytest.mark.parametrize("kw", [{}, {"distilled": True, "class_token": True, "global_pool": "token"},
                                {"class_token": True, "global_pool": "token", "reg_tokens": 2},
                                {"global_pool": "avg", "fc_norm": True}])
def test_ibot_trains_vit_deit_register_and_gap_encoders_and_reaches_the_student_only(kw):
    ibot = create_objective("ibot", encoder(**kw), out_dim=8, local_crops=1, patch_weight=0.5).train()
    out = ibot(torch.randn(2, 1, 8, 8))
    assert torch.isfinite(out.loss) and torch.allclose(out.loss, out.cls_loss + 0.5 * out.patch_loss)
    out.loss.backward()
    assert ibot.mask_token.grad is not None and ibot.encoder.patch_embed.proj.weight.grad is not None
    assert all(p.grad is None for p in [*ibot.teacher_encoder.parameters(), *ibot.teacher_patch_norm.parameters()])


def test_a_bf16_step_is_finite():
    ibot = create_objective("ibot", encoder(), out_dim=8, local_crops=1).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ibot(torch.randn(2, 1, 8, 8))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()


def test_ibot_takes_dinos_defaults_and_refuses_bad_options():
    r = load_recipe(None, data="cifar10", pretrain="ibot", batch_size=512)
    assert r.lr == pytest.approx(1e-3) and r.augment.crop == "none"
    with pytest.raises(ValueError, match="mask_ratio 1.5 must lie in"):
        create_objective("ibot", encoder(), mask_ratio=1.5)
