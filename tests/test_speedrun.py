"""The speed-run pieces: the whitening stem, alternating flips, decoupled SGD, BatchNorm-bias lr, lookahead,
mirror + translate TTA, and the CNN and hybrid training on the digits."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, free_port
from torch import nn

import vitlab
from vitlab.data.augment import AugmentConfig, BatchAugment, alternating_flip
from vitlab.metrics import head_logits
from vitlab.models.airbench import Whiten, patches_2d, whitening_filters
from vitlab.train import load_recipe, train
from vitlab.train.optim import (
    Lookahead,
    build_optimizer,
    kilostep_scale,
    lookahead_alpha,
    param_groups,
    scale_bn_biases,
)
from vitlab.train.schedule import set_lr


def test_whitening_filters_equal_the_hand_computation():
    # four 1-channel 2x2 images, image k lights pixel k at k + 1: the patches' second moment is diag(1, 4, 9, 16) / 4
    images = torch.zeros(4, 1, 2, 2)
    for k in range(4):
        images[k, 0].view(-1)[k] = k + 1.0
    filters = whitening_filters(images, size=2, eps=0.0).view(4, 4)
    expect = torch.zeros(4, 4)  # largest eigenvalue first: pixel 3 (16/4) ... pixel 0 (1/4); filter = e_k / sqrt
    for row, k in enumerate((3, 2, 1, 0)):
        expect[row, k] = 1.0 / math.sqrt((k + 1.0) ** 2 / 4)
    torch.testing.assert_close(filters.abs(), expect)  # an eigenvector's sign is free


def test_whitened_patches_have_identity_covariance():
    g = torch.Generator().manual_seed(0)
    mix = torch.tensor([[1.0, 0.8, 0.1], [0.0, 0.5, 0.3], [0.2, 0.0, 0.9]])
    images = torch.einsum("ij,bjhw->bihw", mix, torch.randn(30, 3, 8, 8, generator=g))  # correlated channels
    images = images + 0.5 * images.roll(1, dims=-1)  # and correlated neighbours
    conv = Whiten(3, 2, eps=0.0)
    conv.init_from_data(images)
    assert conv.out_channels == 24 and not conv.weight.requires_grad
    with torch.no_grad():
        out = conv(images)  # (B, 24, 7, 7); the bias starts at 0
    first, second = out[:, :12], out[:, 12:]
    torch.testing.assert_close(second, -first)
    flat = first.permute(0, 2, 3, 1).reshape(-1, 12).double()
    torch.testing.assert_close(flat.T @ flat / len(flat), torch.eye(12, dtype=torch.float64), atol=1e-4, rtol=0)
    assert patches_2d(images, 2).shape == (30 * 7 * 7, 12)


@pytest.mark.parametrize("name", ["airbench_32", "vit_nano_airbench_32"])
def test_speedrun_models_init_from_data_save_and_load(name, tmp_path):
    model = vitlab.create_model(name, num_classes=10)
    model.init_from_data(torch.randn(16, 3, 32, 32))
    model.freeze_stem()
    assert not any(p.requires_grad for n, p in model.named_parameters() if "whiten" in n)
    model.eval()
    vitlab.save(model, tmp_path / "m")
    loaded = vitlab.load(tmp_path / "m").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert model.family and model.no_timm and model.no_hf and model.no_pretrain


@pytest.mark.parametrize("pad,widths,grid", [(True, (64, 256), 8), (False, (64, 256), 7), (True, (64, 256, 256), 4),
                                             (False, (64, 256, 256), 3)])
def test_hybrid_token_grid_with_and_without_the_stem_pad(pad, widths, grid):
    """Padded, the grid halves exactly; unpadded it is the CNN's own (32 -> 31 -> 15 -> 7 -> 3), and the model has
    one position embedding per cell of it."""
    model = vitlab.create_model("vit_nano_airbench_32", num_classes=10, width_mult=0.25, stem_pad=pad,
                                stem_widths=widths, depth=1)
    x = torch.randn(2, 3, 32, 32)
    assert model.patch_embed(x).shape[1:3] == (grid, grid) == model.patch_embed.grid_size
    assert model.pos_embed.shape[1] == grid * grid + model.num_prefix_tokens * (not model.no_embed_class)
    assert model(x).shape == (2, 10)


def test_whitening_from_data_can_be_switched_off_for_the_ablation():
    """whiten_from_data=False: the first convolution keeps PyTorch's init and trains like any other."""
    images = torch.randn(8, 3, 32, 32)
    for name in ("airbench_32", "vit_nano_airbench_32"):
        on = vitlab.create_model(name, num_classes=10, width_mult=0.25)
        off = vitlab.create_model(name, num_classes=10, width_mult=0.25, whiten_from_data=False)
        w_on, w_off = [dict(m.named_parameters()) for m in (on, off)]
        key = next(k for k in w_on if k.endswith("whiten.weight"))
        before = w_off[key].detach().clone()
        assert on.init_from_data(images) and not off.init_from_data(images)
        assert torch.equal(w_off[key], before) and w_off[key].requires_grad
        assert not w_on[key].requires_grad and not torch.equal(w_on[key], before)


def test_model_arg_adds_to_the_recipes_model_args():
    r = load_recipe(ROOT / "recipes/cifar10_hybrid_speedrun.yaml", model_args={"whiten_from_data": False, "depth": 1})
    assert r.model_args == {"stem_widths": [64, 256, 256], "stem_pad": False, "depth": 1, "embed_dim": 256,
                            "num_heads": 4, "whiten_from_data": False}


def test_hybrid_recipe_starts_small_on_a_coarser_token_grid():
    from vitlab.train.progressive import any_size, progressive_size, size_step
    r = load_recipe(ROOT / "recipes/cifar10_hybrid_speedrun.yaml")
    model = vitlab.create_model(r.model, **r.model_args).eval()
    any_size(model)
    sizes = [progressive_size(p, (32, 32), r.progressive_scale, r.progressive_until, size_step(model))
             for p in (0.0, r.progressive_until)]
    assert sizes == [(24, 24), (32, 32)]  # the first half at 24x24, then the test size
    with torch.no_grad():
        tokens = [model.forward_features(torch.randn(2, 3, *s)).shape[1] for s in sizes]
    assert tokens == [4, 9]  # the stem's 2x2 grid, then its 3x3


def test_airbench_convs_start_as_identities():
    model = vitlab.create_model("airbench_32", width_mult=0.25)
    conv = model.stem.groups[1].conv1  # 16 -> 64 channels
    x = torch.randn(1, 16, 5, 5)
    torch.testing.assert_close(conv(x)[:, :16], x)
    assert model.stem.groups[2].conv1.out_channels == 64


def test_alternating_flip_flips_every_image_every_other_epoch():
    images = torch.arange(6 * 2 * 3 * 4, dtype=torch.uint8).view(6, 2, 3, 4)
    index = torch.tensor([0, 5, 17, 1000, 49_999, 3])
    flipped = [alternating_flip(images, index, e, seed=1) for e in range(4)]
    mirrored = [(f == images.flip(-1)).flatten(1).all(1) for f in flipped]
    kept = [(f == images).flatten(1).all(1) for f in flipped]
    for e in range(4):
        assert (mirrored[e] ^ kept[e]).all()  # each image as it is or mirrored
        assert torch.equal(mirrored[e], ~mirrored[(e + 1) % 4])  # each image mirrored in one of two epochs
    assert torch.equal(mirrored[0], mirrored[2])  # deterministic: the same images in every even epoch
    assert torch.equal(alternating_flip(images, index, 0, seed=1), flipped[0])
    bits = alternating_flip(torch.zeros(10_000, 1, 1, 2, dtype=torch.uint8).index_fill_(-1, torch.tensor([0]), 1),
                            torch.arange(10_000), 0)[:, 0, 0, 0] == 0
    assert 0.45 < bits.float().mean() < 0.55  # about half of the images in the even epochs


def test_augment_leaves_flips_to_the_alternating_rule():
    cfg = AugmentConfig(crop="none", hflip=True, alternating_flip=True, auto_augment="none", random_erasing=0,
                        mixup=0, cutmix=0, label_smoothing=0)
    aug = BatchAugment(cfg, (4, 4), (0.0,), (1 / 255,), 2)
    images = torch.randint(0, 255, (64, 1, 4, 4), dtype=torch.uint8)
    x, _ = aug(images, torch.zeros(64, dtype=torch.long))
    torch.testing.assert_close(x, images.float())  # no random flip on top


def _sgd_steps(lr: float, wd: float, batch: int, m: float, at: float) -> tuple[float, float]:
    """(lr_step, wd_step) of the decayed group of the SGD the optimiser builds, at schedule value ``at``."""
    opt = build_optimizer([{"params": [nn.Parameter(torch.zeros(2, 2))], "weight_decay": wd}], "sgd", lr, m, batch,
                          torch.device("cpu"))
    set_lr(opt, at)
    group = opt.param_groups[0]
    return group["lr"], group["lr"] * group["weight_decay"]  # torch's SGD decays by lr * weight_decay a step


def test_decoupled_sgd_equals_airbench_formula():
    assert kilostep_scale(0.85) == pytest.approx(1024 * (1 + 1 / 0.15))
    lr_step, wd_step = _sgd_steps(11.5, 0.0153, 1024, 0.85, at=11.5)
    assert lr_step == pytest.approx(11.5 * 1024 / (1024 * (1 + 1 / 0.15))) == pytest.approx(1.5)
    assert wd_step == pytest.approx(0.0153 * 1024 / (1024 * (1 + 1 / 0.15)))
    assert _sgd_steps(11.5, 0.0153, 512, 0.85, at=11.5) == pytest.approx((lr_step / 2, wd_step / 2))
    # the schedule scales the decay with the rate: half the rate, half of each
    assert _sgd_steps(11.5, 0.0153, 1024, 0.85, at=11.5 / 2) == pytest.approx((lr_step / 2, wd_step / 2))


def _toy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))


def test_sgd_steps_equal_airbench_sgd_on_the_summed_loss():
    """Ours (mean loss, lr_scale) against airbench's definition: torch SGD on the summed loss at
    lr / kilostep_scale, weight decay wd * B / kilostep_scale / lr_group, BatchNorm biases at 64x lr."""
    lr, wd, m, batch, bias_scale = 2.0, 0.05, 0.85, 32, 64.0
    ours, theirs = _toy(), _toy()
    groups = scale_bn_biases(param_groups(ours, wd), ours, bias_scale)
    opt = build_optimizer(groups, "sgd", lr, m, batch, torch.device("cpu"))
    ks = kilostep_scale(m)
    lr_t, wd_t = lr / ks, wd * batch / ks
    bn_bias = theirs[1].bias
    decay = [p for p in theirs.parameters() if p.ndim > 1]
    nodecay = [p for p in theirs.parameters() if p.ndim <= 1 and p is not bn_bias]
    ref = torch.optim.SGD([dict(params=decay, lr=lr_t, weight_decay=wd_t / lr_t),
                           dict(params=nodecay, lr=lr_t, weight_decay=0.0),
                           dict(params=[bn_bias], lr=lr_t * bias_scale, weight_decay=0.0)],
                          momentum=m, nesterov=True)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)
        sched = 1.0 - 0.2 * step  # a schedule scales both alike
        set_lr(opt, lr * sched)
        for group, base in zip(ref.param_groups, (lr_t, lr_t, lr_t * bias_scale)):
            group["lr"] = base * sched
        for net, o, reduction in ((ours, opt, "mean"), (theirs, ref, "sum")):
            o.zero_grad()
            F.cross_entropy(net(x), y, reduction=reduction).backward()
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bn_bias_scale_applies_through_set_lr_with_adamw():
    model = _toy()
    opt = build_optimizer(scale_bn_biases(param_groups(model, 0.05), model, 8.0), "adamw", 1e-3, 0.9, 32,
                          torch.device("cpu"))
    set_lr(opt, 2e-3)
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lrs[id(model[1].bias)] == pytest.approx(16e-3)
    assert lrs[id(model[1].weight)] == pytest.approx(2e-3) and lrs[id(model[0].weight)] == pytest.approx(2e-3)


def test_lookahead_equals_its_formula():
    assert lookahead_alpha(0.5, 5, 0.95) == pytest.approx(0.95 ** 5 * 0.125)
    assert lookahead_alpha(0.0, 5, 0.95) == 0.0 and lookahead_alpha(2.0, 5, 0.95) == pytest.approx(0.95 ** 5)
    model, model2 = _toy(), _toy()
    la = Lookahead(model, every=3, decay=0.9)
    slow2 = {k: v.clone() for k, v in model2.state_dict().items() if v.dtype.is_floating_point}
    for step in range(1, 7):
        for m in (model, model2):  # a training step's change to the weights and the BatchNorm statistics
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.1 * step)
                m[1].running_mean.add_(1.0)
        la.step(model, step, progress=step / 6)
        if step % 3 == 0:  # the formula, by hand on the twin
            a = 0.9 ** 3 * (step / 6) ** 3
            with torch.no_grad():
                for k, v in model2.state_dict().items():
                    if v.dtype.is_floating_point:
                        slow2[k] = a * slow2[k] + (1 - a) * v
                        v.copy_(slow2[k])
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, model2.state_dict()[k])
    with torch.no_grad():
        model[0].weight.add_(1.0)
    la.finish(model)  # the fast weights become the slow ones
    torch.testing.assert_close(model[0].weight, slow2["0.weight"])


def test_mirror_translate_tta_weights_as_airbench():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(4, 1, 6, 6)
    model(x)
    got = head_logits(model, x, tta=True, translate=1)["logits"]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")

    def mirror(t):
        return 0.5 * model(t) + 0.5 * model(t.flip(-1))
    expect = 0.5 * mirror(x) + 0.25 * mirror(padded[..., 0:6, 0:6]) + 0.25 * mirror(padded[..., 2:8, 2:8])
    torch.testing.assert_close(got, expect)
    torch.testing.assert_close(head_logits(model, x, tta=True, translate=0)["logits"], mirror(x))


@pytest.mark.parametrize("values, message", [
    ({"optimizer": "rmsprop"}, "adamw, sgd"),
    ({"momentum": 1.0}, "momentum"),
    ({"bn_bias_lr_scale": 0}, "bn_bias_lr_scale"),
    ({"lookahead_every": -1}, "lookahead_every"),
    ({"tta_translate": 1}, "needs tta"),
    ({"alternating_flip": "sometimes"}, "alternating_flip"),
])
def test_bad_speedrun_options_are_one_line(values, message):
    with pytest.raises(ValueError) as e:
        load_recipe(None, **values)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, args", [("airbench_32", {"widths": [16, 32]}),
                                        ("vit_nano_airbench_32", {"stem_widths": [16], "embed_dim": 32,
                                                                  "depth": 1, "num_heads": 2})])
def test_speedrun_recipe_trains_on_the_digits(name, args, tmp_path, cache_dir):
    lines = []
    out = tmp_path / "run"
    summary = train(load_recipe(ROOT / "recipes/cifar10_airbench.yaml", data="digits", model=name, img_size=8,
                                model_args={"in_chans": 1, **args}, epochs=4, batch_size=64, precision="fp32",
                                threads=1, freeze_stem_after=2, out=str(out), hflip=True),
                    log=lines.append)
    assert any("initialised" in line and "from" in line for line in lines)
    assert summary["top1"] > 0.5  # ten classes: chance is 0.1
    lines.clear()  # fine-tuning from the run keeps its whitening filters
    # the recipe file names airbench_32: beside --init it must name the model the run holds
    train(load_recipe(ROOT / "recipes/cifar10_airbench.yaml", data="digits", init=str(out), model=name, img_size=8,
                      epochs=1, batch_size=64, precision="fp32", threads=1, out=str(tmp_path / "tuned")),
          log=lines.append)
    assert lines and not any("initialised" in line for line in lines)
    if name == "airbench_32":  # vitlab eval with the recipe's mirror + translate TTA gives the run's own figure
        from vitlab.infer.eval import evaluate_folder
        assert evaluate_folder(out, tta=True, tta_translate=1)["top1"] == pytest.approx(summary["top1"])
        with pytest.raises(ValueError, match="needs --tta"):
            evaluate_folder(out, tta_translate=2)


@pytest.mark.slow
def test_stem_freezes_mid_run_under_torchrun(tmp_path):
    """Two processes: the whitening bias stops training after epoch 1 and the replicas (wrapped again, so that they
    no longer wait for its gradient) train on in sync to the end."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "vitlab", "train", "--config",
                           str(ROOT / "recipes/cifar10_airbench.yaml"),
                           "--data", "digits", "--img-size", "8", "--model-arg", "in_chans=1", "--model-arg",
                           "widths=[16,32]", "--epochs", "3", "--batch-size", "64", "--freeze-stem-after", "1",
                           "--no-tta", "--tta-translate", "0", "--precision", "fp32", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["replicas_in_sync"] and summary["epochs"] == 3
