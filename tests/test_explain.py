"""vitlab.analysis: relevance, raw attention, faithfulness (deletion/insertion, perturbation test)."""
import numpy as np
import pytest
import torch
from test_analysis import TINY, tiny
from torch import nn

import vitlab
from vitlab.analysis import (
    METHODS,
    REGISTRY,
    AttentionMap,
    Method,
    explain,
    explanation_methods,
    gradient_saliency,
    raw_attention,
    relevance,
    relevance_from_maps,
)
from vitlab.analysis.capture import capture_attention
from vitlab.analysis.faithfulness import (
    PERTURBATION_STEPS,
    baseline_images,
    curve_fractions,
    deletion_insertion,
    faithfulness,
    patch_mask,
    perturbation_hits,
    random_order,
    relevance_order,
    trapezoid,
)

# ---------------------------------------------------------------------------------------------
# relevance


def _trapz(ys, xs) -> float:
    """The trapezoid rule written out."""
    return sum((ys[i] + ys[i + 1]) / 2 * (xs[i + 1] - xs[i]) for i in range(len(xs) - 1))


def _min_max(v):
    return (v - v.min()) / (v.max() - v.min())


def test_relevance_matches_hand_computation_two_blocks():
    g = torch.Generator().manual_seed(3)
    T = 5  # cls + 2x2 patches, 2 heads
    a = [torch.rand(1, 2, T, T, generator=g, dtype=torch.float64).softmax(-1) for _ in range(2)]
    d = [torch.randn(1, 2, T, T, generator=g, dtype=torch.float64) for _ in range(2)]
    maps = [AttentionMap(f"blocks.{i}", "mhsa", a[i].float(), ("cls",), (2, 2)) for i in range(2)]
    # by hand: R = I; R = R + cam1 R; R = R + cam2 R with cam = mean over heads of (grad * A)^+
    cam = [(d[i][0] * a[i][0]).clamp(min=0).mean(0) for i in range(2)]
    R = torch.eye(T, dtype=torch.float64)
    R = R + cam[0] @ R
    R = R + cam[1] @ R
    expected = _min_max(R[0, 1:])
    out = relevance_from_maps(maps, [x.float() for x in d])
    assert out.shape == (1, 2, 2)
    torch.testing.assert_close(out[0].double().flatten(), expected, atol=1e-6, rtol=0)
    # a negative product everywhere contributes nothing: the map is the identity's row (constant 0)
    flat = relevance_from_maps(maps, [-(x.abs()).float() for x in d])
    assert flat.abs().max() == 0


def test_relevance_tokens_by_hand():
    g = torch.Generator().manual_seed(4)
    # distillation token: row 1, prefix columns (cls, dist) dropped
    a = torch.rand(1, 1, 6, 6, generator=g, dtype=torch.float64).softmax(-1)
    d = torch.randn(1, 1, 6, 6, generator=g, dtype=torch.float64)
    maps = [AttentionMap("blocks.0", "mhsa", a.float(), ("cls", "dist"), (2, 2))]
    R = torch.eye(6, dtype=torch.float64) + (a * d)[0, 0].clamp(min=0)
    torch.testing.assert_close(relevance_from_maps(maps, [d.float()], token="dist")[0].double().flatten(),
                               _min_max(R[1, 2:]), atol=1e-6, rtol=0)
    # CaiT: a patch-only block, then class attention that only updates the class token's row
    p = torch.rand(1, 1, 4, 4, generator=g, dtype=torch.float64).softmax(-1)
    dp = torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64)
    c = torch.rand(1, 1, 1, 5, generator=g, dtype=torch.float64).softmax(-1)
    dc = torch.rand(1, 1, 1, 5, generator=g, dtype=torch.float64)  # positive
    maps = [AttentionMap("blocks.0", "talking_heads", p.float(), (), (2, 2)),
            AttentionMap("blocks_token_only.0", "class_attn", c.float(), ("cls",), (2, 2))]
    R = torch.eye(5, dtype=torch.float64)
    R[1:, 1:] += (p * dp)[0, 0].clamp(min=0)
    full = torch.zeros(5, 5, dtype=torch.float64)
    full[0] = (c * dc)[0, 0, 0]
    R = R + full @ R
    out = relevance_from_maps(maps, [dp.float(), dc.float()])
    torch.testing.assert_close(out[0].double().flatten(), _min_max(R[0, 1:]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="distilled"):
        relevance_from_maps(maps, [dp.float(), dc.float()], token="dist")


def test_relevance_of_a_model_uses_the_target_logit_gradient():
    model = tiny("vit")
    x = torch.randn(2, 3, 32, 32)
    with torch.enable_grad(), capture_attention(model, keep_graph=True) as maps:
        logits = model(x.requires_grad_(True))
        grads = torch.autograd.grad(logits[0, 3] + logits[1, 5], [m.attn for m in maps])
    expected = relevance_from_maps([AttentionMap(m.name, m.kind, m.attn.detach(), m.prefix_tokens, m.grid_size)
                                    for m in maps], grads)
    torch.testing.assert_close(relevance(model, x, [3, 5]), expected)
    assert not any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", list(TINY))
def test_every_method_on_every_family(family):
    model = tiny(family)
    x = torch.randn(2, 3, 32, 32)
    gh, gw = model.patch_embed.grid_size
    pairs = explanation_methods(model)
    assert {m for m, _ in pairs} == set(METHODS) == {"raw_attention", "rollout", "grad_rollout", "relevance", "attnlrp",
                                                      "pa_lrp", "libragrad", "libragrad_ig", "libragrad_fullgrad",
                                                      "saliency"}
    assert ("relevance", "dist") in pairs if family == "deit" else all(t == "cls" for _, t in pairs)
    assert ("saliency", "dist") not in pairs  # saliency reads no token
    for method, token in pairs:
        r = explain(model, x, method, [1, 2], token=token)
        assert r.shape == (2, gh, gw) and torch.isfinite(r).all(), (method, token)
        assert r.min() >= 0 and torch.allclose(r.amax(dim=(1, 2)), torch.ones(2)), (method, token)
    with pytest.raises(ValueError, match="method"):
        explain(model, x, "lrp", 1)
    torch.testing.assert_close(explain(model, x, "pa-lrp", [1, 2]), explain(model, x, "pa_lrp", [1, 2]))


@pytest.mark.parametrize("family", ["resnet", "mixer"])
def test_new_methods_refuse_a_model_without_attention_in_one_line(family):
    from conftest import FAMILY

    from vitlab.errors import VitlabError
    model = FAMILY[family].create().eval()
    for method in ("pa_lrp", "libragrad", "libragrad_ig", "libragrad_fullgrad"):
        with pytest.raises(VitlabError, match="no attention") as err:
            explain(model, torch.randn(1, 3, 32, 32), method, 0)
        assert "\n" not in str(err.value)


class LinearOnPixels(nn.Module):
    """logits = W x over the flattened pixels: the gradient of logit c is W[c] for every image."""

    def __init__(self, weight: torch.Tensor, patch: int = 2):  # weight (classes, C, H, W)
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.patch_embed = nn.Module()
        self.patch_embed.patch_size = (patch, patch)
        self.patch_embed.grid_size = (weight.shape[2] // patch, weight.shape[3] // patch)

    def forward(self, x):
        return x.flatten(1) @ self.weight.flatten(1).T


def test_gradient_saliency_matches_hand_computation():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(3, 2, 4, 6, generator=g)  # 3 classes, 2 channels, 4x6 pixels: a 2x3 grid of 2x2 patches
    model = LinearOnPixels(w).train()
    x = torch.randn(2, 2, 4, 6, generator=g)
    out = explain(model, x, "saliency", [2, 0])
    assert out.shape == (2, 2, 3)
    for i, c in enumerate((2, 0)):
        pixels = w[c].abs().amax(0)  # (4, 6): the largest |d logit / d pixel| over the channels
        cells = torch.tensor([[pixels[2 * r:2 * r + 2, 2 * k:2 * k + 2].mean().item() for k in range(3)]
                              for r in range(2)])
        torch.testing.assert_close(out[i], cells / cells.max())
    assert model.training and model.weight.grad is None  # mode put back, no parameter gradient left behind
    assert REGISTRY["saliency"].class_specific and REGISTRY["saliency"].tokens == ("cls",)
    with pytest.raises(ValueError, match="token"):
        explain(model, x, "saliency", 0, token="dist")
    with pytest.raises(ValueError, match="target_class"):
        gradient_saliency(model, x, 3)


def test_a_registered_method_reaches_explain_and_faithfulness(monkeypatch):
    """A new method is one function and one registry entry; explain, explanation_methods and faithfulness read it."""
    def centre(model, images):  # a class-agnostic prior that reads no token: the centre patches first
        gh, gw = model.patch_embed.grid_size
        r = torch.arange(gh).view(-1, 1) - (gh - 1) / 2
        c = torch.arange(gw).view(1, -1) - (gw - 1) / 2
        return (1 / (1 + r ** 2 + c ** 2)).expand(len(images), gh, gw)

    monkeypatch.setitem(REGISTRY, "centre", Method(centre, "centre prior", "a centre prior"))
    assert not REGISTRY["centre"].class_specific and REGISTRY["relevance"].class_specific
    model = tiny("deit")
    x = torch.randn(2, 3, 32, 32)
    pairs = explanation_methods(model)
    assert ("centre", "cls") in pairs and ("centre", "dist") not in pairs and ("rollout", "dist") in pairs
    torch.testing.assert_close(explain(model, x, "centre", 1), centre(model, x))
    result = faithfulness(model, x, methods=[("centre", "cls")], curve_steps=2)
    assert result["methods"]["centre"]["label"] == "centre prior"


def test_raw_attention_is_the_last_blocks_class_row():
    g = torch.Generator().manual_seed(5)
    a1, a2 = (torch.rand(1, 2, 5, 5, generator=g).softmax(-1) for _ in range(2))
    maps = [AttentionMap(f"blocks.{i}", "mhsa", a, ("cls",), (2, 2)) for i, a in enumerate((a1, a2))]
    row = a2[0].mean(0)[0, 1:]
    torch.testing.assert_close(raw_attention(maps)[0].flatten(), row / row.max())


# ---------------------------------------------------------------------------------------------
# faithfulness


class OnePatchDecides(nn.Module):
    """A toy classifier on a 4x4 grid of 8-pixel patches: the brightness of one patch picks the class."""

    def __init__(self, patch: int = 5):
        super().__init__()
        self.patch = patch

    def forward(self, x):  # (B, C, 32, 32) -> (B, 2)
        r, c = divmod(self.patch, 4)
        s = x[:, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8].mean(dim=(1, 2, 3))
        return torch.stack([4 * s, -4 * s], dim=1)


def test_known_good_order_beats_random_on_deletion_and_insertion():
    model = OnePatchDecides(patch=5)
    x = torch.zeros(6, 3, 32, 32)
    x[:, :, 8:16, 8:16] = 1.0  # patch 5 bright: class 0
    target = torch.zeros(6, dtype=torch.long)
    truth = torch.zeros(6, 4, 4)
    truth[:, 1, 1] = 1.0  # the true relevance: patch 5 only
    good = relevance_order(truth)
    assert (good[:, 0] == 5).all()
    bad = good.flip(1)  # the decisive patch last
    rand = random_order(6, 16, torch.Generator().manual_seed(0))
    counts = curve_fractions(16, 16)
    xs = [k / 16 for k in counts]
    base = torch.zeros_like(x)
    aucs = {}
    for name, order in (("good", good), ("random", rand), ("bad", bad)):
        dele, ins = deletion_insertion(model, x, order, target, counts, (4, 4), base, base)
        assert dele.shape == ins.shape == (6, 17)
        aucs[name] = (trapezoid(xs, dele).mean().item(), trapezoid(xs, ins).mean().item())
    assert aucs["good"][0] < aucs["random"][0] < aucs["bad"][0]  # deletion: lower is better
    assert aucs["good"][1] > aucs["random"][1] > aucs["bad"][1]  # insertion: higher is better
    # exact: the good order deletes the patch at the first step; the curve is p0 once, then 0.5
    p0 = torch.softmax(model(x[:1]), -1)[0, 0].item()
    assert aucs["good"][0] == pytest.approx((p0 + 0.5) / 2 / 16 + 0.5 * 15 / 16, abs=1e-6)


def test_perturbation_auc_is_the_trapezoid_over_the_stated_points():
    model = OnePatchDecides(patch=0)
    x = torch.zeros(4, 3, 32, 32)
    x[:2, :, :8, :8] = 1.0  # images 0, 1: class 0
    x[2:, :, :8, :8] = -1.0  # images 2, 3: class 1
    labels = torch.tensor([0, 0, 1, 1])
    order = relevance_order(torch.eye(16)[0].expand(4, 16).reshape(4, 4, 4))  # patch 0 first
    removed = torch.zeros_like(x)
    hits = perturbation_hits(model, x, order, labels, PERTURBATION_STEPS, (4, 4), removed)
    assert hits.shape == (10, 4)
    assert hits[0].all()  # unperturbed: all right
    # from f = 0.1 on (floor(1.6) = 1 patch) patch 0 is gone: equal logits, argmax says class 0
    assert (hits[1:] == torch.tensor([True, True, False, False])).all()
    accuracy = hits.double().mean(1) * 100  # 100, then 50 at 0.1 .. 0.9
    auc = trapezoid(PERTURBATION_STEPS, accuracy)
    assert auc.item() == pytest.approx((100 + 50) / 2 * 0.1 + 50 * 0.8)


def test_saco_scores_alone_are_faithfulness_s():
    from vitlab.analysis.faithfulness import saco_scores
    model = tiny("vit")
    x = torch.randn(5, 3, 32, 32)
    methods = [("attnlrp", "cls"), ("raw_attention", "cls")]
    full = faithfulness(model, x, batch_size=2, curve_steps=2, keep_images=0, methods=methods, seed=3,
                        progress=False)
    alone = saco_scores(model, x, batch_size=2, methods=methods, seed=3)
    assert set(alone) == {"attnlrp", "raw_attention", "random", "edge"}
    for key, value in alone.items():  # the random floor too: the same draws
        assert value == pytest.approx(full["methods"][key]["saco"], abs=1e-9), key


def test_faithfulness_on_a_model(tmp_path):
    model = tiny("deit")
    x = torch.randn(5, 3, 32, 32)
    labels = torch.tensor([0, 1, 2, 3, 4])
    r = faithfulness(model, x, labels, batch_size=2, curve_steps=8, keep_images=3, progress=False)
    new = ("pa_lrp", "libragrad", "libragrad_ig", "libragrad_fullgrad")
    keys = {"raw_attention", "rollout", "grad_rollout", "relevance", "attnlrp", "raw_attention_dist", "rollout_dist",
            "grad_rollout_dist", "relevance_dist", "attnlrp_dist", "saliency", "random", "edge", *new,
            *(f"{m}_dist" for m in new)}
    assert set(r["methods"]) == keys
    p = r["protocol"]
    assert p["images"] == 5 and p["patches"] == 64
    assert p["perturbation"]["fractions"] == list(PERTURBATION_STEPS)
    assert p["perturbation"]["patches_removed"] == [0, 6, 12, 19, 25, 32, 38, 44, 51, 57]
    assert p["deletion_insertion"]["patch_counts"] == [0, 8, 16, 24, 32, 40, 48, 56, 64]
    with torch.no_grad():
        intact = (model(x).argmax(-1) == labels).double().mean().item() * 100
    for m in r["methods"].values():
        assert len(m["positive_accuracy"]) == 10 and m["positive_accuracy"][0] == pytest.approx(intact)
        assert m["positive_auc"] == pytest.approx(_trapz(m["positive_accuracy"], PERTURBATION_STEPS))
        assert m["negative_auc"] == pytest.approx(_trapz(m["negative_accuracy"], PERTURBATION_STEPS))
        for road in ("road_morf", "road_lerf"):
            assert m[f"{road}_accuracy"][0] == pytest.approx(intact)
            assert m[f"{road}_auc"] == pytest.approx(_trapz(m[f"{road}_accuracy"], PERTURBATION_STEPS))
        xs = p["deletion_insertion"]["x"]
        assert 0 <= m["deletion_auc"] <= 1 and 0 <= m["insertion_auc"] <= 1
        assert len(m["deletion_curve"]) == len(xs) == 9
    assert r["methods"]["random"]["road_morf_auc"] == r["methods"]["random"]["road_lerf_auc"]
    agree = r["rank_agreement"]
    for m in r["methods"].values():  # SaCo: a coefficient in [-1, 1]
        assert -1 <= m["saco"] <= 1
    assert p["saco"]["groups"] == 10
    assert agree["methods"] == list(r["methods"]) and len(agree["metrics"]) == 7
    for matrix in (agree["spearman"], agree["kendall"]):
        # 1 on the diagonal, or 0 where a metric gives every method the same score (no order to agree with)
        assert all(matrix[i][i] == pytest.approx(1.0) or matrix[i][i] == 0 for i in range(7))
        assert all(-1 - 1e-9 <= v <= 1 + 1e-9 for row in matrix for v in row)
    assert len(r["images"]) == 3
    one = r["images"][0]["methods"]["relevance"]
    assert one["deletion_auc"] == pytest.approx(_trapz(one["deletion_curve"], p["deletion_insertion"]["x"]))
    with pytest.raises(ValueError, match="baseline"):
        faithfulness(model, x, deletion_baseline="noise")
    from vitlab.analysis.plots import plot_faithfulness
    fig = plot_faithfulness(r)  # twelve lines a panel, ROAD's two panels beside the four others
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 6 and any("ROAD, most relevant" in t for t in titles)
    lines = {line.get_label().rsplit(" (", 1)[0]: line for line in fig.axes[0].get_lines()}
    cls, dist = lines["AttnLRP"], lines["AttnLRP (distillation token)"]
    assert cls.get_color() == dist.get_color() and (cls.get_linestyle(), dist.get_linestyle()) == ("-", "--")
    floors = ("random map", "edge detector (Sobel)")
    colours = {line.get_color() for k, line in lines.items() if "distillation" not in k and k not in floors}
    assert len(colours) == 10 and all(lines[k].get_color() == "gray" for k in floors)  # one colour per method


def test_baselines_and_masks():
    x = torch.randn(2, 3, 16, 16)
    black = baseline_images(x, "black", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    torch.testing.assert_close(black, torch.full_like(x, -2.0))
    assert baseline_images(x, "mean", (0.5,) * 3, (0.5,) * 3).abs().max() == 0
    blur = baseline_images(x, "blur", (0.5,) * 3, (0.5,) * 3, blur_sigma=2.0)
    assert blur.shape == x.shape and blur.std() < x.std()
    order = torch.tensor([[3, 0, 1, 2], [0, 1, 2, 3]])
    m = patch_mask(order, 1, (2, 2), (16, 16))
    assert m.shape == (2, 1, 16, 16)
    assert m[0, 0, 8:, 8:].all() and m[0].sum() == 64 and m[1, 0, :8, :8].all() and m[1].sum() == 64
    assert curve_fractions(64, 16) == list(range(0, 65, 4)) and curve_fractions(4, 16) == [0, 1, 2, 3, 4]


def test_faithfulness_of_a_resnet_fails_clearly():
    with pytest.raises(ValueError, match="has no attention"):
        faithfulness(vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8)), torch.randn(1, 3, 32, 32))


# ---------------------------------------------------------------------------------------------
# sanity check and head importance


def test_parameter_randomisation_cascade():
    from vitlab.analysis.sanity import parameter_randomisation, randomisation_stages

    model = tiny("cait")
    assert [s for s, _ in randomisation_stages(model)] == ["head", "blocks_token_only.0", "blocks.1", "blocks.0",
                                                           "embeddings"]
    x = torch.randn(3, 3, 32, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = parameter_randomisation(model, x, [("rollout", "cls"), ("relevance", "cls")])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched
    assert set(r["correlation"]) == {"rollout", "relevance"} and len(r["correlation"]["rollout"]) == 5
    assert all(-1 <= c <= 1 for cs in r["correlation"].values() for c in cs)
    assert r["correlation"]["rollout"][0] == pytest.approx(1.0)  # rollout never looks at the head
    assert r["class_agnostic"] == ["rollout"]
    everything = parameter_randomisation(model, x, [("rollout", "cls")], threshold=-1.0)
    assert everything["flagged"] == ["rollout"]
    assert parameter_randomisation(model, x, [("rollout", "cls")], threshold=1.01)["flagged"] == []


def test_head_importance_is_zero_for_a_head_the_block_ignores():
    from vitlab.analysis.sanity import head_importance

    model = tiny("vit")  # 2 blocks, 2 heads of 16 channels
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[:, :16] = 0  # block 0 drops head 0's output
    x = torch.randn(4, 3, 32, 32)
    imp, names = head_importance(model, x, batch_size=3)
    assert names == ["blocks.0", "blocks.1"] and imp.shape == (2, 2)
    assert imp[0, 0].abs() < 1e-5 and imp[0, 1].abs() > 1e-4 and imp[1].abs().min() > 1e-4
    # by hand for block 1, head 1: zero its value path through the output projection instead
    with torch.no_grad():
        logits = model(x)
        t = logits.argmax(-1)
        w = model.blocks[1].attn.proj.weight.clone()
        model.blocks[1].attn.proj.weight[:, 16:] = 0
        drop = (logits.gather(1, t[:, None]) - model(x).gather(1, t[:, None])).mean()
        model.blocks[1].attn.proj.weight.copy_(w)
    assert imp[1, 1].item() == pytest.approx(drop.item(), abs=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_explorer_attention_encoding_round_trips(bits):
    import base64
    import zlib

    from vitlab.analysis.interactive import encode_attention

    g = torch.Generator().manual_seed(6)
    a = torch.rand(1, 3, 5, 5, generator=g).softmax(-1)  # heads 3, 5 tokens: 75 values, odd
    maps = [AttentionMap("blocks.0", "mhsa", a, ("cls",), (2, 2))]
    raw = zlib.decompress(base64.b64decode(encode_attention(maps, 0, bits)))
    n = a.numel()
    size = n if bits == 8 else (n + 1) // 2
    q = np.frombuffer(raw[:size], dtype=np.uint8)
    if bits == 4:
        q = np.stack([q >> 4, q & 15], axis=1).reshape(-1)[:n]
    top = np.frombuffer(raw[size:], dtype="<f4").reshape(3, 5, 1)
    assert len(raw) == size + 4 * 15
    decoded = q.reshape(3, 5, 5) / (2 ** bits - 1) * top
    assert np.abs(decoded - a[0].numpy()).max() <= top.max() / (2 ** bits - 1) / 2 + 1e-6
    with pytest.raises(ValueError, match="bits"):
        encode_attention(maps, 0, 2)
