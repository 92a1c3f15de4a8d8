"""LibraGrad and PA-LRP: completeness where their papers claim it, and their maps against hand-written references on
a two-block ViT; SaCo against a hand computation; the floor baselines."""
import pytest
import torch
import torch.nn.functional as F
from test_attnlrp import _bias_free_vit

import vitlab
from vitlab.analysis.attnlrp import attnlrp_pixels, lrp_rules
from vitlab.analysis.faithfulness import edge_map, saco, saco_groups, saco_score
from vitlab.analysis.libragrad import libra_gradients, libragrad, libragrad_fullgrad, libragrad_ig
from vitlab.analysis.palrp import _rope_rule, pa_lrp, pa_lrp_cells


def _vit(seed: int = 0):
    torch.manual_seed(seed)
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=16, depth=2, num_heads=2).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # biases, tokens and positions far from 0, so that they matter
            if name.endswith("bias") or name in ("pos_embed", "cls_token"):
                p.normal_(std=0.3)
            elif name.endswith("weight") and p.dim() > 1:  # unit-variance layers: the pixels' share is not tiny
                p.normal_(std=p[0].numel() ** -0.5)
    return model


def _additive(model):
    """The terms a LibraGrad network is linear in besides the input: biases, position embedding, class token."""
    return [p for name, p in model.named_parameters() if name.endswith("bias") or name in ("pos_embed", "cls_token")]


def test_libragrad_is_complete():
    """FullGrad completeness (the paper's claim): logit = sum input x gradient + sum bias x gradient, exactly."""
    model = _vit()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    extra = _additive(model)
    for b in range(2):  # one image at a time: a parameter's gradient sums over the batch
        grad, logit, g_extra = libra_gradients(model, x[b:b + 1], 3, also=extra)
        total = (x[b:b + 1] * grad).sum() + sum((p * g).sum() for p, g in zip(extra, g_extra)).detach()
        assert abs(float(total) - float(logit)) < 1e-9 * max(1.0, abs(float(logit)))
        assert abs(float((x[b:b + 1] * grad).sum())) > 1e-3  # the pixels hold a real share
    # plain input x gradient is not complete on a transformer
    xi = x[:1].clone().requires_grad_(True)
    logit = model(xi)[0, 3]
    g = torch.autograd.grad(logit, [xi, *extra])
    plain = (xi * g[0]).sum() + sum((p * gp).sum() for p, gp in zip(extra, g[1:]))
    assert abs(float((plain - logit).detach())) > 1e-3


def _by_hand(model, x, c, keep=None):
    """The two-block ViT written out with LibraGrad's constants (attention probabilities, the norms' standard
    deviations, GELU's gate Phi(z) = gelu(z) / z) computed on the live values and then detached: the function is
    linear in the rest. Returns the logit of class c; ``keep`` collects each block's input tokens."""
    D = model.embed_dim
    w = model.patch_embed.proj.weight
    patches = F.unfold(x, 4, stride=4).transpose(1, 2)  # (1, 64, 48), row-major patches
    t = patches @ w.reshape(D, -1).T + model.patch_embed.proj.bias
    h = torch.cat([model.cls_token.expand(len(x), -1, -1), t], dim=1) + model.pos_embed

    def norm(z, m):
        zc = z - z.mean(-1, keepdim=True)
        return zc / (zc.pow(2).mean(-1, keepdim=True) + m.eps).sqrt().detach() * m.weight + m.bias

    for blk in model.blocks:
        if keep is not None:
            keep.append(h)
        a = blk.attn
        y = norm(h, blk.norm1)
        q, k, v = (y @ a.qkv.weight.T + a.qkv.bias).reshape(len(x), -1, 3, a.num_heads, a.head_dim).permute(
            2, 0, 3, 1, 4)
        A = ((q * a.scale) @ k.transpose(-2, -1)).softmax(-1).detach()
        o = (A @ v).transpose(1, 2).reshape(len(x), -1, D)
        h = h + o @ a.proj.weight.T + a.proj.bias
        z = norm(h, blk.norm2) @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias
        gate = (F.gelu(z) / z).detach()
        h = h + (z * gate) @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias
    out = norm(h, model.norm)[:, 0] @ model.head.weight.T + model.head.bias
    return out[:, c]


def _scaled(cells):
    lo, hi = cells.amin(-1, keepdim=True), cells.amax(-1, keepdim=True)
    return ((cells - lo) / (hi - lo)).reshape(-1, 8, 8)


def test_libragrad_maps_match_a_hand_written_two_block_vit():
    model = _vit(1)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_by_hand(model, x, 5), model(x)[:, 5])  # the hand model is the model

    def grad_at(z):
        zi = z.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(_by_hand(model, zi, 5).sum(), [zi])
        return g

    def cells(pixels):  # (1, 3, 32, 32) -> (1, 64): summed over channels and 4x4 pixels
        return pixels.sum(1).reshape(1, 8, 4, 8, 4).sum((2, 4)).reshape(1, 64)

    torch.testing.assert_close(libragrad(model, x, 5).double(), _scaled(cells(x * grad_at(x))), atol=1e-6, rtol=0)
    steps = 4
    ig = sum(grad_at(x * (k + 0.5) / steps) for k in range(steps)) / steps
    torch.testing.assert_close(libragrad_ig(model, x, 5, steps=steps).double(), _scaled(cells(x * ig)), atol=1e-6,
                               rtol=0)
    keep = []
    xi = x.clone().requires_grad_(True)
    logit = _by_hand(model, xi, 5, keep)
    grads = torch.autograd.grad(logit.sum(), keep)
    fullgrad = torch.stack([(h * g)[:, 1:].sum(-1) for h, g in zip(keep, grads)]).mean(0)
    torch.testing.assert_close(libragrad_fullgrad(model, x, 5).double(), _scaled(fullgrad.detach()), atol=1e-6,
                               rtol=0)
    # and the rules are not plain gradients
    plain = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(model(plain)[0, 5], [plain])
    assert not torch.allclose(g, grad_at(x))


def _softmax_leaks(probs, g_probs):
    """What AttnLRP's softmax rule leaves with the softmax's implicit bias (see test_attnlrp)."""
    leaks = 0.0
    for s, g in zip(probs, g_probs):
        R = s * g
        leaks += float((R.sum() - (s.log() * (R - s * R.sum(-1, keepdim=True))).sum()).detach())
    return leaks


def test_pa_lrp_keeps_the_position_embedding_relevance():
    """Learned (and sin-cos: the same addition) positions: the patch's cell is its pixels' AttnLRP relevance plus its
    position's p * g, and the cells with the class token and its position and the softmax shares sum to the logit."""
    model = _bias_free_vit()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    probs = []
    hooks = [b.attn.attn_map.register_forward_hook(lambda mod, i, o: probs.append(o)) for b in model.blocks]
    try:
        xi = x.clone().requires_grad_(True)
        with torch.enable_grad(), lrp_rules(model, epsilon=1e-12):
            logit = model(xi)[0, 3]
            grads = torch.autograd.grad(logit, [xi, model.cls_token, model.pos_embed, *probs])
    finally:
        for h in hooks:
            h.remove()
    g_x, g_cls, g_pos = grads[:3]
    pixels, position, out = pa_lrp_cells(model, x, 3, epsilon=1e-12)
    torch.testing.assert_close(out[0], logit.detach())
    pix_by_hand = (x * g_x).sum(1).reshape(1, 8, 4, 8, 4).sum((2, 4)).reshape(1, 64)
    torch.testing.assert_close(pixels.double(), pix_by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(position.double(), (model.pos_embed * g_pos)[:, 1:].sum(-1).detach(), atol=1e-5,
                               rtol=1e-5)
    rest = float(((model.cls_token * g_cls).sum() + (model.pos_embed * g_pos)[:, 0].sum()).detach())
    total = float(pixels.sum() + position.sum()) + rest + _softmax_leaks(probs, grads[3:])
    assert abs(total - float(logit.detach())) < 1e-4 * abs(float(logit.detach()))
    assert float(position.abs().sum()) > 1e-3 * float(pixels.abs().sum())  # the positions hold a real share
    # the map: pixels + position, min-max scaled; it differs from AttnLRP's
    R, _ = attnlrp_pixels(model, x, 3)
    attn_cells = R.sum(1).reshape(1, 8, 4, 8, 4).sum((2, 4)).reshape(1, 64)
    torch.testing.assert_close(pa_lrp(model, x, 3).double(), _scaled(attn_cells + position.double()), atol=1e-4,
                               rtol=0)


def test_pa_lrp_gives_rotary_positions_half_of_each_rotated_query_and_key():
    """RoPE (with an absolute embedding too): the uniform rule on q cos + rot(q) sin conserves relevance, so pixels,
    class token, both kinds of position and the softmax shares still sum to the logit; the rotary share is real."""
    torch.manual_seed(0)
    model = vitlab.create_model("vit_small_patch16_rope_mixed_ape_224", img_size=32, patch_size=4, embed_dim=32,
                                depth=2, num_heads=2).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name in ("pos_embed", "cls_token"):
                p.normal_(std=0.5)
            elif name.endswith("gamma"):  # LayerScale's 1e-5 would leave the class token's own path alone
                p.fill_(1.0)
            elif name.endswith("weight") and p.dim() > 1:
                p.normal_(std=p[0].numel() ** -0.5)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    probs, leaves = [], []
    hooks = [b.attn.attn_map.register_forward_hook(lambda mod, i, o: probs.append(o)) for b in model.blocks]
    try:
        xi = x.clone().requires_grad_(True)
        with torch.enable_grad(), lrp_rules(model, epsilon=1e-12), _rope_rule(leaves):
            logit = model(xi)[0, 2]
            grads = torch.autograd.grad(logit, [xi, model.cls_token, model.pos_embed, *probs, *leaves])
    finally:
        for h in hooks:
            h.remove()
    assert len(leaves) == 4  # q and k of two blocks
    g_x, g_cls, g_pos = grads[:3]
    g_probs, g_leaves = grads[3:3 + len(probs)], grads[3 + len(probs):]
    rope = sum(float((leaf * g).sum().detach()) for leaf, g in zip(leaves, g_leaves))
    inputs = float(((x * g_x).sum() + (model.cls_token * g_cls).sum() + (model.pos_embed * g_pos).sum()).detach())
    logit = float(logit.detach())
    assert abs(inputs + rope + _softmax_leaks(probs, g_probs) - logit) < 1e-6 * abs(logit)
    rope_cells = sum((leaf * g).sum(-1).reshape(1, -1, 64).sum(1) for leaf, g in zip(leaves, g_leaves)).detach()
    assert float(rope_cells.abs().sum()) > 1e-2 * float((x * g_x).sum(1).abs().sum())  # a real share per patch
    pixels, position, _ = pa_lrp_cells(model, x, 2, epsilon=1e-12)
    n = model.pos_embed.shape[1] - 64
    expected = float((model.pos_embed * g_pos)[:, n:].sum().detach()) + rope
    assert abs(float(position.sum()) - expected) < 1e-5 * max(1.0, abs(expected))
    torch.testing.assert_close(float(pixels.sum()), float((x * g_x).sum()), atol=1e-6, rtol=1e-6)


def test_saco_matches_a_hand_computation():
    # salience of 3 groups: 6, 3, 1 (gaps 3, 5, 2); drops 0.5, 0.6, 0.1
    # pairs (1,2): drop 0.5 < 0.6 -> -3; (1,3): 0.5 >= 0.1 -> +5; (2,3): 0.6 >= 0.1 -> +2; (-3 + 5 + 2) / 10
    s = torch.tensor([[6.0, 3.0, 1.0]])
    assert saco_score(s, torch.tensor([[0.5, 0.6, 0.1]])).item() == pytest.approx(0.4)
    assert saco_score(s, torch.tensor([[0.9, 0.5, 0.1]])).item() == pytest.approx(1.0)  # drops follow salience
    assert saco_score(s, torch.tensor([[0.1, 0.5, 0.9]])).item() == pytest.approx(-1.0)
    assert saco_score(torch.ones(1, 3), torch.rand(1, 3)).item() == 0  # a constant map says nothing
    # groups: a 1x5 grid of 1x2-pixel cells, its 10 pixels in 3 groups of 4, 3, 3, most salient first; a cell's
    # pixels stay together, and a group boundary may cut a cell (the 0.3 cell: one pixel in each of groups 2, 3)
    maps = torch.tensor([[[0.1, 0.9, 0.5, 0.3, 0.7]]])
    order, salience = saco_groups(maps, (1, 10), 3)
    assert order.tolist() == [[2, 3, 8, 9, 4, 5, 6, 7, 0, 1]]
    torch.testing.assert_close(salience, torch.tensor([[3.2, 1.3, 0.5]]))


def test_saco_groups_are_equal_to_a_pixel():
    """64 patches of 4x4 pixels in Wu et al.'s 10 groups: 102 or 103 pixels each, where whole patches would make
    groups of 7 and 6 (17% apart), whose removals differ in size whatever the map."""
    _, sizes = saco_groups(torch.ones(2, 8, 8), (32, 32))  # a constant map: each group's salience is its size
    assert sizes.tolist() == [[103.0] * 4 + [102.0] * 6] * 2


class _Counter(torch.nn.Module):
    """Two classes; logit 0 = 4 x the sum of the image's first channel over patches 0 and 1 of a 1x4 grid."""

    def forward(self, x):
        s = x[:, 0, :, :4].mean((1, 2)) * 3 + x[:, 0, :, 4:8].mean((1, 2))
        return torch.stack([4 * s, torch.zeros_like(s)], dim=1)


def test_saco_of_a_model_against_hand_probabilities():
    model = _Counter()
    x = torch.ones(1, 1, 4, 16)  # a 1x4 grid of 4x4 patches
    maps = torch.tensor([[[0.2, 1.0, 0.0, 0.5]]])  # groups of 1 (K = 4): patches 1, 3, 0, 2
    removed = torch.zeros_like(x)
    p = lambda s: torch.sigmoid(torch.tensor(4.0 * s)).item()  # noqa: E731  probability of class 0
    intact = p(4.0)
    drops = torch.tensor([[intact - p(3.0), 0.0, intact - p(1.0), 0.0]])  # removing patch 1, 3, 0, 2
    expected = saco_score(torch.tensor([[1.0, 0.5, 0.2, 0.0]]), drops)
    out = saco(model, x, maps, torch.tensor([0]), removed, groups=4)
    torch.testing.assert_close(out, expected)
    assert out.item() < 1  # patch 1 is ranked first but patch 0 matters more


def test_edge_map_by_hand():
    x = torch.zeros(1, 3, 8, 16)
    x[:, :, :, 8:] = 1.0  # a vertical edge between columns 7 and 8: the second of four 4-wide cells ends on it
    m = edge_map(x, (2, 4))
    assert m.shape == (1, 2, 4) and m.max() == 1
    # Sobel d/dx of the summed channels (3 at the step): 3 * (1 + 2 + 1) = 12 on columns 7 and 8 only
    assert torch.allclose(m[0, :, 1], torch.ones(2)) and torch.allclose(m[0, :, 2], torch.ones(2))
    assert m[0, :, 0].abs().max() == 0 and m[0, :, 3].abs().max() == 0
