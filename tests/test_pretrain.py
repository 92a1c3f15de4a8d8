import math

import pytest
import torch

import vitlab
from vitlab.models.vit import VisionTransformer
from vitlab.objectives import (
    MaskedAutoencoder,
    MaskedPatchPrediction,
    Masking,
    create_objective,
    load_decoder_state,
    mean_color_classes,
    patchify,
    random_masking,
    split_pretrained,
    unpatchify,
)
from vitlab.objectives.mae import decoder_defaults, patch_targets
from vitlab.objectives.masking import gather_tokens, num_visible, restore_tokens
from vitlab.objectives.mpp import Corruption, draw_corruption

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread beats two fighting over a busy machine


def toy_vit(**kw) -> VisionTransformer:
    """A 4x4 one-channel image in 2x2 patches: a 2x2 grid of 4 tokens."""
    args = dict(img_size=4, patch_size=2, in_chans=1, num_classes=3, embed_dim=16, depth=1, num_heads=2)
    return VisionTransformer(**{**args, **kw})


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# masking


def test_masking_keeps_exactly_the_ratio_per_sample():
    m = random_masking(16, 64, 0.75, generator=gen())
    assert m.mask.shape == (16, 64) and m.ids_keep.shape == (16, 16) and m.ids_restore.shape == (16, 64)
    assert (m.mask.sum(dim=1) == 48).all()
    assert (m.mask.gather(1, m.ids_keep) == 0).all()  # the kept indices are the visible ones
    assert len({tuple(row.tolist()) for row in m.mask}) == 16  # per sample, not one mask for the batch


def test_num_visible_rounds_like_mae_and_rejects_bad_ratios():
    assert num_visible(64, 0.75) == 16
    assert num_visible(196, 0.75) == 49
    assert num_visible(10, 0.8) == 2  # 10 * (1 - 0.8) is 1.9999999999999996 in floating point
    assert num_visible(10, 0.0) == 10
    for bad in (-0.1, 1.0, 0.99):
        with pytest.raises(ValueError, match="mask ratio"):
            num_visible(10, bad)


def test_ids_restore_unshuffles():
    x = torch.randn(4, 9, 5)
    m = random_masking(4, 9, 0.5, generator=gen(1))
    ids_shuffle = m.ids_restore.argsort(dim=1)
    assert torch.equal(gather_tokens(gather_tokens(x, ids_shuffle), m.ids_restore), x)
    assert torch.equal(ids_shuffle[:, :m.ids_keep.shape[1]], m.ids_keep)
    fill = torch.full((1, 1, 5), 7.0)
    restored = restore_tokens(gather_tokens(x, m.ids_keep), fill, m.ids_restore)
    visible = m.mask == 0
    assert torch.equal(restored[visible], x[visible])
    assert (restored[~visible] == 7.0).all()


def test_masking_is_deterministic_given_a_generator():
    a, b, c = (random_masking(3, 20, 0.6, generator=gen(s)) for s in (5, 5, 6))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a.mask, c.mask)


# ---------------------------------------------------------------------------------------------
# MAE


def block_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """A list that fills with the input of the encoder's first block on every forward."""
    seen: list[torch.Tensor] = []
    model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    return seen


@pytest.mark.parametrize("name,overrides,prefix", [
    ("vit_nano_patch4_32", {}, 1),
    ("vit_tiny_avg_patch4_32", {"depth": 2}, 0),
    ("deit_nano_distilled_patch4_32", {}, 2),
    ("vit_nano_patch4_32", {"reg_tokens": 4}, 5),
    ("vit_nano_patch4_32", {"reg_tokens": 2, "no_embed_class": True}, 3),
    ("vit_nano_patch4_32", {"pos_embed": "sincos"}, 1),
    ("vit_nano_patch4_32", {"pos_embed": "none"}, 1),
])
def test_only_visible_tokens_reach_the_encoder(name, overrides, prefix):
    encoder = vitlab.create_model(name, **overrides)
    mae = MaskedAutoencoder(encoder).eval()
    seen = block_inputs(encoder)
    imgs = torch.randn(3, 3, 32, 32)
    out = mae(imgs, generator=gen())
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.pred.shape == (3, 64, 4 * 4 * 3) and (out.mask.sum(1) == 48).all()
    assert seen[0].shape == (3, prefix + 16, encoder.embed_dim)
    # the tokens are the visible patches with their own position embedding, after the prefix tokens
    full = encoder._pos_embed(encoder.patch_embed(imgs))  # (B, P + 64, D)
    keep = random_masking(3, 64, 0.75, generator=gen()).ids_keep
    assert torch.allclose(seen[0][:, prefix:], gather_tokens(full[:, prefix:], keep))
    assert torch.allclose(seen[0][:, :prefix], full[:, :prefix])


@pytest.mark.parametrize("overrides", [{}, {"class_token": False, "global_pool": "avg"}, {"reg_tokens": 2}])
def test_nothing_hidden_or_corrupted_is_the_plain_forward(overrides):
    """With no patch hidden (MAE) or corrupted (MPP) the encoder computes what its own forward_features does."""
    encoder = vitlab.create_model("vit_nano_patch4_32", **overrides).eval()
    imgs = torch.randn(2, 3, 32, 32)
    P = encoder.num_prefix_tokens
    plain = encoder.forward_features(imgs)  # (B, P + 64, D)
    mae = MaskedAutoencoder(encoder, mask_ratio=0.0).eval()
    latent, masking, _ = mae.forward_encoder(imgs, generator=gen())
    assert torch.allclose(latent[:, :P], plain[:, :P], atol=1e-5)
    assert torch.allclose(latent[:, P:], gather_tokens(plain[:, P:], masking.ids_keep), atol=1e-5)  # same tokens
    mpp = MaskedPatchPrediction(encoder).eval()
    none = torch.zeros(2, 64, dtype=torch.bool)
    out = mpp(imgs, corruption=Corruption(none, none, none, torch.zeros(2, 64, dtype=torch.long)))
    assert torch.allclose(out.logits, mpp.head(mpp.norm(plain[:, P:])), atol=1e-5)


def test_patchify_order_and_inverse():
    imgs = torch.arange(2 * 2 * 4 * 6, dtype=torch.float32).reshape(2, 2, 4, 6)
    p = patchify(imgs, 2)  # a 2x3 grid of 2x2 patches, 2 channels
    assert p.shape == (2, 6, 8)
    # patch 4 = grid row 1, column 1: pixels (2..3, 2..3); values ordered (row, column, channel)
    want = [imgs[0, c, y, x].item() for y in (2, 3) for x in (2, 3) for c in (0, 1)]
    assert p[0, 4].tolist() == want
    assert torch.equal(unpatchify(p, 2, (2, 3)), imgs)


def test_norm_pix_targets():
    patches = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0]]])
    t = patch_targets(patches)
    var = ((1 - 2.5) ** 2 + (2 - 2.5) ** 2 + (3 - 2.5) ** 2 + (4 - 2.5) ** 2) / 3  # unbiased, as MAE
    assert torch.allclose(t[0, 0], torch.tensor([(v - 2.5) / math.sqrt(var + 1e-6) for v in (1, 2, 3, 4)]))
    assert torch.equal(t[0, 1], torch.zeros(4))  # a flat patch: 0 / sqrt(eps)
    assert torch.equal(patch_targets(patches, norm_pix=False), patches)
    random = patch_targets(torch.randn(5, 7, 48) * 3 + 2)
    assert torch.allclose(random.mean(-1), torch.zeros(5, 7), atol=1e-5)
    assert torch.allclose(random.var(-1), torch.ones(5, 7), atol=1e-4)


TOY_IMAGE = [[0.0, 1.0, 2.0, 3.0],
             [4.0, 5.0, 6.0, 7.0],
             [1.0, 1.0, 9.0, 0.0],
             [1.0, 1.0, 3.0, 5.0]]


@pytest.mark.parametrize("norm_pix", [True, False])
def test_mae_loss_equals_a_hand_computation(norm_pix):
    torch.manual_seed(3)
    mae = MaskedAutoencoder(toy_vit(), mask_ratio=0.5, norm_pix_loss=norm_pix).eval()
    imgs = torch.tensor(TOY_IMAGE)[None, None]  # (1, 1, 4, 4)
    # keep patches 0 and 3 (top left, bottom right); hide 1 (top right) and 2 (bottom left)
    masking = Masking(ids_keep=torch.tensor([[3, 0]]), ids_restore=torch.tensor([[1, 2, 3, 0]]),
                      mask=torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    out = mae(imgs, masking=masking)
    pred = out.pred[0].tolist()  # 4 patches x 4 pixels, each patch's pixels row by row
    hidden = {1: [2.0, 3.0, 6.0, 7.0], 2: [1.0, 1.0, 1.0, 1.0]}
    total = 0.0
    for n, pixels in hidden.items():
        if norm_pix:
            mean = sum(pixels) / 4
            var = sum((v - mean) ** 2 for v in pixels) / 3
            pixels = [(v - mean) / math.sqrt(var + 1e-6) for v in pixels]
        total += sum((p - t) ** 2 for p, t in zip(pred[n], pixels)) / 4
    assert out.loss.item() == pytest.approx(total / 2, rel=1e-5)
    # the visible patches do not count: changing their predictions leaves the loss as it is
    pred2 = out.pred.detach().clone()
    pred2[0, 0] += 5.0
    assert mae.forward_loss(imgs, pred2, out.mask).item() == pytest.approx(out.loss.item(), rel=1e-6)


def test_mae_decoder_sees_mask_tokens_and_a_fixed_sincos_table():
    mae = MaskedAutoencoder(vitlab.create_model("vit_nano_patch4_32"))
    d = mae.decoder
    assert d.pos_embed.shape == (1, 64, d.embed.out_features) and not d.pos_embed.requires_grad
    assert "pos_embed" not in d.state_dict()  # fixed: rebuilt, not stored
    row, col = d.pos_embed[0, 9], d.pos_embed[0, 10]  # grid (1, 1) and (1, 2): same row, next column
    q = d.embed.out_features // 4
    assert torch.allclose(row[:2 * q], col[:2 * q])  # the first half encodes the row
    assert not torch.allclose(row[2 * q:], col[2 * q:])
    assert torch.allclose(row[2 * q:3 * q], torch.sin(1.0 / 10000 ** (torch.arange(q) / q)))  # sin(x * omega), x = 1


def test_decoder_defaults_follow_the_stated_rule():
    assert decoder_defaults(768) == (512, 8, 16)  # MAE's ViT-B/L decoder
    assert decoder_defaults(1024) == (512, 8, 16)
    assert decoder_defaults(192) == (96, 2, 3)  # half the width of a small encoder, 2 deep
    assert decoder_defaults(384) == (192, 2, 6)
    assert decoder_defaults(64) == (32, 2, 1)
    mae = MaskedAutoencoder(vitlab.create_model("vit_nano_patch4_32"), decoder_dim=64, decoder_depth=3)
    assert len(mae.decoder.blocks) == 3 and mae.decoder.embed.out_features == 64


def test_mae_runs_other_input_sizes_with_a_dynamic_encoder():
    mae = MaskedAutoencoder(vitlab.create_model("vit_nano_patch4_32", dynamic_img_size=True))
    out = mae(torch.randn(2, 3, 48, 32))
    assert out.pred.shape == (2, 96, 48) and (out.mask.sum(1) == 72).all()


def test_reconstruct_inverts_the_targets():
    mae = MaskedAutoencoder(toy_vit(), mask_ratio=0.5)
    imgs = torch.tensor(TOY_IMAGE)[None, None]
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    pred = patch_targets(patchify(imgs, 2))  # a perfect prediction
    masked, recon = mae.reconstruct(imgs, pred, mask)
    assert torch.allclose(recon, imgs, atol=1e-4)
    assert torch.equal(masked[0, 0, :2, 2:], torch.zeros(2, 2))  # hidden patch 1
    assert torch.equal(masked[0, 0, :2, :2], imgs[0, 0, :2, :2])  # visible patch 0


# ---------------------------------------------------------------------------------------------
# masked patch prediction


def test_mpp_targets_equal_a_hand_computation():
    imgs = torch.zeros(1, 3, 4, 4)
    imgs[0, 0, :2, :2] = torch.tensor([[0.0, 0.25], [0.5, 1.0]])  # patch 0: red mean 0.4375 -> level 3
    imgs[0, 1, :2, :2] = 1.0  # green 1.0 -> level 8, clamped to 7
    imgs[0, 2, :2, 2:] = 0.124  # patch 1: blue 0.124 -> 0; 0.126 -> 1
    imgs[0, 2, 2:, :2] = 0.126
    imgs[0, :, 2:, 2:] = torch.tensor([0.3, 0.6, 0.9])[:, None, None]  # patch 3: levels 2, 4, 7
    want = [[3 * 64 + 7 * 8 + 0, 0, 1, 2 * 64 + 4 * 8 + 7]]
    assert mean_color_classes(imgs, 2).tolist() == want
    assert mean_color_classes(imgs, 2, bits=1).tolist() == [[0 * 4 + 1 * 2 + 0, 0, 0, 0 * 4 + 1 * 2 + 1]]
    # the objective undoes the data set's normalisation first
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    encoder = toy_vit(in_chans=3)
    mpp = MaskedPatchPrediction(encoder, mean=mean, std=std)
    normed = (imgs - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert mpp.targets(normed).tolist() == want
    assert mpp.num_colors == 512 and mpp.head.out_features == 512


def test_corruption_proportions_hold_over_many_draws():
    c = draw_corruption(400, 64, generator=gen(7))
    assert (c.corrupted.sum(1) == 32).all()  # exactly half of every image's patches
    assert not (c.mask_token & c.swapped).any()
    assert not (c.mask_token & ~c.corrupted).any() and not (c.swapped & ~c.corrupted).any()
    n = c.corrupted.sum().item()  # 12,800 draws: a binomial's sd at 0.8 is 0.0035, at 0.1 is 0.0027
    assert c.mask_token.sum().item() / n == pytest.approx(0.8, abs=0.015)
    assert c.swapped.sum().item() / n == pytest.approx(0.1, abs=0.012)
    assert (c.corrupted & ~c.mask_token & ~c.swapped).sum().item() / n == pytest.approx(0.1, abs=0.012)
    assert (c.source != torch.arange(64)).all()  # "another" patch
    assert c.corrupted.float().mean(0).min() > 0.35  # every position gets corrupted, not a fixed set
    assert (draw_corruption(3, 9, generator=gen()).corrupted.sum(1) == 5).all()  # 9 - int(9 * 0.5)


def test_mpp_feeds_the_corrupted_embeddings_to_the_encoder():
    encoder = toy_vit(in_chans=3, img_size=6)  # a 3x3 grid
    mpp = MaskedPatchPrediction(encoder).eval()
    seen = block_inputs(encoder)
    imgs = torch.rand(1, 3, 6, 6)
    f = torch.tensor
    c = Corruption(corrupted=f([[1, 1, 1, 1, 0, 0, 0, 0, 0]]).bool(),  # patches 0-3: 0, 1 masked, 2 swapped, 3 kept
                   mask_token=f([[1, 1, 0, 0, 0, 0, 0, 0, 0]]).bool(),
                   swapped=f([[0, 0, 1, 0, 0, 0, 0, 0, 0]]).bool(), source=f([[1, 2, 7, 4, 5, 6, 7, 8, 0]]))
    out = mpp(imgs, corruption=c)
    x = seen[0][0, 1:]  # (9, D) after the class token
    patches = encoder.patch_embed(imgs).reshape(9, -1)
    pos = encoder.pos_embed[0, 1:]
    assert torch.allclose(x[0], mpp.mask_token[0, 0] + pos[0]) and torch.allclose(x[1], mpp.mask_token[0, 0] + pos[1])
    assert torch.allclose(x[2], patches[7] + pos[2])  # another patch's embedding, at this position
    assert torch.allclose(x[3:], patches[3:] + pos[3:])  # kept as they are
    logp = out.logits[0].log_softmax(-1)
    want = -sum(logp[i, out.targets[0, i]] for i in range(4)) / 4  # cross-entropy on the 4 corrupted only
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# training, families, weights


@pytest.mark.parametrize("method", ["mae", "mpp"])
def test_a_few_steps_reduce_the_loss(method):
    torch.manual_seed(0)
    objective = create_objective(method, vitlab.create_model("vit_micro_patch2_8", in_chans=3))
    ramp = torch.linspace(0, 1, 8)  # images with structure to learn: ramps of random colour and direction
    colors = torch.rand(16, 3, 1, 1)
    imgs = torch.where(torch.rand(16, 1, 1, 1) < 0.5, ramp[None, :], ramp[:, None]) * colors
    opt = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=2e-3)

    def loss_at(seed: int) -> float:  # over eight held-out masks: one mask's loss alone is noisy
        with torch.no_grad():
            return sum(objective(imgs, generator=gen(seed + k)).loss.item() for k in range(8)) / 8

    before = loss_at(123)
    for step in range(40):
        loss = objective(imgs, generator=gen(step)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    # MAE's 40 steps end between 0.26x and 0.72x of the start, by seed, thread count and CPU (untrained: ~1x)
    assert loss_at(123) < 0.8 * before


@pytest.mark.parametrize("method", ["mae", "mpp", "dino"])
def test_every_trainable_parameter_gets_a_gradient(method):
    encoder = vitlab.create_model("deit_nano_distilled_patch4_32")
    objective = create_objective(method, encoder)
    objective(torch.randn(2, 3, 32, 32)).loss.backward()
    no_grad = [n for n, p in objective.named_parameters() if p.requires_grad and p.grad is None]
    assert no_grad == []  # DDP without find_unused_parameters needs this
    assert not encoder.head.weight.requires_grad and not encoder.head_dist.weight.requires_grad


@pytest.mark.parametrize("name,method,reason", [
    ("convit_nano_patch4_32", "mae", "GPSA"),
    ("convit_nano_patch4_32", "mpp", "class token joins"),
    ("vit_nano_r18_32", "mae", "CNN stem"),
    ("vit_nano_r18_32", "mpp", "CNN stem"),
    ("cait_xxs_patch4_32", "mae", "class-attention"),
    ("resnet10_32", "mpp", "no patch tokens"),
])
def test_unsupported_families_raise_one_line(name, method, reason):
    with pytest.raises(ValueError, match=reason) as err:
        create_objective(method, vitlab.create_model(name))
    assert "\n" not in str(err.value) and method.upper() in str(err.value)


def test_unknown_method_and_bad_options_raise():
    with pytest.raises(ValueError, match="accepted: mae, mpp"):
        create_objective("simclr", toy_vit())
    with pytest.raises(ValueError, match="no visible token"):
        MaskedAutoencoder(toy_vit(), mask_ratio=0.9)
    with pytest.raises(ValueError, match="one value per input channel"):
        MaskedPatchPrediction(toy_vit(), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="sum to at most 1"):
        MaskedPatchPrediction(toy_vit(), mask_prob=0.9, random_prob=0.2)
    with pytest.raises(ValueError, match="corrupt_ratio"):
        MaskedPatchPrediction(toy_vit(), corrupt_ratio=1.0)


@pytest.mark.parametrize("method", ["mae", "mpp"])
def test_encoder_weights_are_the_plain_models(method, tmp_path):
    objective = create_objective(method, vitlab.create_model("vit_nano_patch4_32"))
    opt = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-2)
    objective(torch.randn(4, 3, 32, 32), generator=gen()).loss.backward()
    opt.step()
    encoder, decoder_state = split_pretrained(objective)
    fresh = vitlab.create_model("vit_nano_patch4_32")
    assert fresh.load_state_dict(encoder.state_dict(), strict=True)  # every key, every shape
    assert set(encoder.state_dict()) == set(fresh.state_dict())
    assert decoder_state and not any(k.startswith("encoder.") for k in decoder_state)
    folder = vitlab.save(encoder, tmp_path / "encoder")
    loaded = vitlab.load(folder)
    for k, v in encoder.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # the decoder state brings a fresh objective back to the same outputs
    again = create_objective(method, loaded)
    load_decoder_state(again, decoder_state)
    imgs = torch.randn(2, 3, 32, 32)
    objective.eval(), again.eval()
    assert torch.allclose(objective(imgs, generator=gen(9)).loss, again(imgs, generator=gen(9)).loss)
    other = create_objective("mpp" if method == "mae" else "mae", vitlab.create_model("vit_nano_patch4_32"))
    with pytest.raises(ValueError, match="does not fit"):
        load_decoder_state(other, decoder_state)
