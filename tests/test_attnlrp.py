"""AttnLRP: the modified backward pass against explicit LRP messages, and conservation layer by layer."""
import torch
from torch import nn

from vitlab.analysis.attnlrp import attnlrp, attnlrp_pixels, lrp_rules
from vitlab.models.layers import Attention


class AttentionThenLinear(nn.Module):
    """Two layers: one self-attention (no biases), then a linear read-out of token 0."""

    def __init__(self, dim=4, heads=2):
        super().__init__()
        self.attn = Attention(dim, num_heads=heads, proj_bias=False)
        self.out = nn.Linear(dim, 1, bias=False)

    def forward(self, x):  # (1, N, D) -> (1,)
        return self.out(self.attn(x)[:, 0])[:, 0]


def _lrp_by_hand(m: AttentionThenLinear, x: torch.Tensor) -> torch.Tensor:
    """The paper's rules written out as messages (epsilon -> 0): relevance of every input value, (N, D)."""
    a = m.attn
    N, D = x.shape
    H, hd = a.num_heads, a.head_dim
    qkv = x @ a.qkv.weight.T  # (N, 3D)
    q, k, v = qkv.reshape(N, 3, H, hd).permute(1, 2, 0, 3)  # (H, N, hd) each
    S = a.scale * q @ k.transpose(-1, -2)  # (H, N, N)
    A = S.softmax(-1)
    C = A @ v  # (H, N, hd)
    c = C.transpose(0, 1).reshape(N, D)
    o = c @ a.proj.weight.T
    w = m.out.weight[0]
    R_o = torch.zeros(N, D, dtype=x.dtype)
    R_o[0] = o[0] * w  # epsilon rule of the read-out, R_y = y
    R_c = c * ((R_o / o) @ a.proj.weight)  # epsilon rule of proj: sum_d c_e W_de / o_d R_d
    R_C = R_c.reshape(N, H, hd).transpose(0, 1)
    msg = A[..., None] * v[:, None] / (2 * C[:, :, None])  # (H, n, m, j): A_nm v_mj / (2 C_nj), the uniform rule
    R_A = (msg * R_C[:, :, None]).sum(-1)
    R_v = (msg * R_C[:, :, None]).sum(1)
    R_S = S * (R_A - A * R_A.sum(-1, keepdim=True))  # the softmax rule, Proposition 3.1
    msg = a.scale * q[:, :, None] * k[:, None] / (2 * S[..., None])  # (H, n, m, j): q_nj k_mj / (2 S_nm)
    R_q = (msg * R_S[..., None]).sum(2)
    R_k = (msg * R_S[..., None]).sum(1)
    R_qkv = torch.stack([R_q, R_k, R_v]).permute(2, 0, 1, 3).reshape(N, 3 * D)
    return x * ((R_qkv / qkv) @ a.qkv.weight)  # epsilon rule of qkv


def test_attnlrp_agrees_with_explicit_lrp_messages_on_two_layers():
    m = AttentionThenLinear().double().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    xi = x[None].clone().requires_grad_(True)
    with torch.enable_grad(), lrp_rules(m, epsilon=0.0):
        y = m(xi)
        (g,) = torch.autograd.grad(y.sum(), [xi])
    expected = _lrp_by_hand(m, x)
    torch.testing.assert_close((xi * g)[0].detach(), expected, rtol=1e-9, atol=1e-12)
    (plain,) = torch.autograd.grad(m(xi).sum(), [xi])
    assert not torch.allclose(g, plain)  # the rules change the backward pass (here: halved at q, k, v and A)


def _bias_free_vit():
    import vitlab
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2, qkv_bias=True).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name in ("pos_embed", "cls_token") or name.endswith("qkv.weight"):
                p.normal_(std=0.5)  # peaked attention: the softmax's share is then far from 0
    return model.eval()


def test_attnlrp_conserves_relevance_layer_by_layer():
    """With no biases, relevance is conserved through every layer but the softmax, which keeps exactly what the
    paper's rule leaves with its implicit bias: sum R - sum_i x_i (R_i - s_i sum_j R_j), x_i = log s_i up to a
    constant per row (the rule does not change under a shift of x). So the input's relevance (pixels, class token,
    position embedding) plus those softmax shares is the logit, and so is every block's input plus the shares of
    the softmaxes after it."""
    model = _bias_free_vit()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64, requires_grad=True)
    hidden, probs = [], []
    hooks = [b.register_forward_hook(lambda mod, i, o: hidden.append(i[0])) for b in model.blocks]
    hooks += [b.attn.attn_map.register_forward_hook(lambda mod, i, o: probs.append(o)) for b in model.blocks]
    try:
        with torch.enable_grad(), lrp_rules(model, epsilon=1e-12):
            logit = model(x)[0, 3]
            grads = torch.autograd.grad(logit, [x, model.cls_token, model.pos_embed, *hidden, *probs])
    finally:
        for h in hooks:
            h.remove()
    g_x, g_cls, g_pos, g_hidden, g_probs = grads[0], grads[1], grads[2], grads[3:5], grads[5:]
    leaks = []
    for s, g in zip(probs, g_probs):
        R = s * g  # relevance at the softmax output (its modified gradient)
        R_in = s.log() * (R - s * R.sum(-1, keepdim=True))
        leaks.append(float((R.sum() - R_in.sum()).detach()))
    inputs = float(((x * g_x).sum() + (model.cls_token * g_cls).sum() + (model.pos_embed * g_pos).sum()).detach())
    logit = logit.detach()
    tol = 1e-6 * abs(float(logit))
    assert abs(inputs + sum(leaks) - float(logit)) < tol
    for i, (h, g) in enumerate(zip(hidden, g_hidden)):  # per layer: each block's input
        assert abs(float((h * g).sum().detach()) + sum(leaks[i:]) - float(logit)) < tol, i
    assert abs(sum(leaks)) > 1e-3 * abs(float(logit))  # the softmax's share is real, and accounted for


def test_attnlrp_map_and_logit():
    import vitlab
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    R, logit = attnlrp_pixels(model, x, [1, 2])
    with torch.no_grad():
        torch.testing.assert_close(logit, model(x)[[0, 1], [1, 2]])
    cells = R.sum(1).reshape(2, 8, 4, 8, 4).sum((2, 4))  # 4x4 patches of an 8x8 grid
    lo, hi = cells.amin((1, 2), keepdim=True), cells.amax((1, 2), keepdim=True)
    torch.testing.assert_close(attnlrp(model, x, [1, 2]), (cells - lo) / (hi - lo), atol=1e-5, rtol=0)
    assert not any(p.grad is not None for p in model.parameters())
