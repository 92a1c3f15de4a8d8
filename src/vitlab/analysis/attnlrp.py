"""AttnLRP (Achtibat et al., ICML 2024): layer-wise relevance propagation through attention, in one backward pass.

Relevance is gradient x input with the backward pass changed so that, layer by layer, it carries the paper's
rules (R is relevance, g the modified gradient arriving at an output, so R_out = out * g):

- linear layers and convolutions (patch embedding, q/k/v, projections, MLP, heads): the epsilon rule,
  R_in = x * W^T (R_out / (z + eps sign z)); as a gradient, the output's gradient times z / (z + eps sign z).
  A bias keeps its share (b * g): relevance a bias absorbs does not reach the input.
- elementwise activations (GELU, QuickGELU, SiLU, ...): the identity rule, R_in = R_out (gradient f(x) / x).
- LayerNorm / RMSNorm: the division by the standard deviation is held constant, so the normalisation is the
  linear map x -> (x - mean) / std and its relevance is conserved (Achtibat et al.'s linearised normalisation);
  the affine part is an elementwise linear layer.
- the softmax: R_in_i = x_i (R_i - s_i sum_j R_j) (their Proposition 3.1, a Taylor decomposition), which is
  exactly the softmax's own gradient times its input, so it needs no change. It is not conservative: the sum
  of R_in falls short of sum R by what the paper leaves with the softmax's implicit bias.
- the two bilinear products of attention, q k^T and A v: the uniform rule, half of each product's relevance to
  each factor (their Proposition 3.2): the gradient reaching the attention probabilities and the one reaching
  the attention's input tokens (which reach its output only through q, k and v) is halved.
- a CCT's sequence pooling (softmax weights times tokens) is read with its weights held constant, so all its
  relevance goes to the tokens (the conservative rule of Ali et al. 2022).

The map is the pixels' relevance (input x modified gradient, summed over the channels), summed over each cell
of the model's token grid and scaled to [0, 1] by its minimum and maximum.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from ..models.layers import QuickGELU
from .capture import attention_modules, explicit_attention, prefix_token_names
from .gradients import class_targets

EPSILON = 1e-6  # the epsilon rule's stabiliser
ELEMENTWISE = (nn.GELU, QuickGELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Hardswish, nn.ELU)  # identity rule


class _GradScale(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by a fixed tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def _epsilon_factor(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    """z / (z + eps sign(z)), sign(0) = 1: what the epsilon rule does to the gradient of a linear layer's output."""
    return z / (z + epsilon * torch.where(z >= 0, 1.0, -1.0))


def _linear_hook(epsilon: float):
    def hook(module, inputs, out):
        return _GradScale.apply(out, _epsilon_factor(out, epsilon).detach())
    return hook


def _identity_hook(module, inputs, out):
    """R_in = R_out: the output as x * (f(x) / x), the ratio held constant."""
    x = inputs[0]
    ratio = torch.where(x.abs() > 1e-12, out / torch.where(x.abs() > 1e-12, x, 1.0), 0.0)
    return x * ratio.detach()


def _norm_hook(module, inputs, out):
    """LayerNorm / RMSNorm with the standard deviation (root mean square) held constant."""
    x = inputs[0]
    dims = tuple(range(-len(module.normalized_shape), 0))
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    if isinstance(module, nn.LayerNorm):
        x = x - x.mean(dim=dims, keepdim=True)
    y = x / (x.pow(2).mean(dim=dims, keepdim=True) + eps).sqrt().detach()
    if module.weight is not None:
        y = y * module.weight
    if getattr(module, "bias", None) is not None:
        y = y + module.bias
    return y


def _scaled(x: torch.Tensor, share: float) -> torch.Tensor:
    return _GradScale.apply(x, torch.full((), share, dtype=x.dtype, device=x.device))


def _scale_hook(share: float):
    def hook(module, inputs, out):
        return _scaled(out, share)
    return hook


def _halve_tokens(module, args):
    """Forward pre-hook of an attention module: its tokens reach the output only through q, k and v, each a
    factor of q k^T or A v, so halving their gradient here is the uniform rule on the tokens' side."""
    return (_scaled(args[0], 0.5), *args[1:])


def _rule_hooks(model: nn.Module, epsilon: float) -> list[tuple[nn.Module, object, bool]]:
    """(module, hook, whether it is a forward pre-hook) of every rule, the attention-specific ones first."""
    hooks = []
    for _, _, attn in attention_modules(model):
        hooks.append((attn, _halve_tokens, True))
        hooks.append((attn.attn_map, _scale_hook(0.5), False))  # A of A v
    seq_pool = getattr(model, "attention_pool", None)  # a CCT's sequence pooling: its weights held constant
    if isinstance(seq_pool, nn.Linear):
        hooks.append((seq_pool, _scale_hook(0.0), False))
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)) and m is not seq_pool:
            hooks.append((m, _linear_hook(epsilon), False))
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            hooks.append((m, _norm_hook, False))
        elif isinstance(m, ELEMENTWISE):
            hooks.append((m, _identity_hook, False))
    return hooks


@contextmanager
def lrp_rules(model: nn.Module, epsilon: float = EPSILON) -> Iterator[None]:
    """Within the block the model's backward pass carries AttnLRP's rules: input x gradient is relevance.

    The model runs in eval mode on its explicit attention path; everything is put back on exit. Forward values
    do not change. Hooks registered on ``attn_map`` before entering see the softmax's output and, in the
    backward pass, its modified gradient.
    """
    with ExitStack() as stack:
        stack.enter_context(explicit_attention(model))
        for module, hook, pre in _rule_hooks(model, epsilon):
            handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
            stack.callback(handle.remove)
        yield


def explained_logit(model: nn.Module, x: torch.Tensor, target_class, token: str = "cls") -> torch.Tensor:
    """The logits of target_class, one per image, (B,): the class head's for token 'cls' (a distilled model's
    class-token head), the distillation head's for 'dist'."""
    if token not in ("cls", "dist"):
        raise VitlabError(f"token {token!r} is not one of ('cls', 'dist')")
    if token == "dist" and "dist" not in prefix_token_names(model):
        raise VitlabError("token='dist' needs a distilled model (DeiT with a distillation token)")
    heads = model.forward_heads(model.forward_features(x))
    logits = heads[1 if token == "dist" else 0]
    target = class_targets(target_class, logits)
    return logits.gather(1, target[:, None])[:, 0]


def attnlrp_pixels(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
                   token: str = "cls", epsilon: float = EPSILON) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnLRP's relevance of every input value (B, C, H, W) and the explained logits (B,). No parameter's
    .grad is touched."""
    x = images.detach().clone().requires_grad_(True)
    with torch.enable_grad(), lrp_rules(model, epsilon):
        logit = explained_logit(model, x, target_class, token)
        (grad,) = torch.autograd.grad(logit.sum(), [x])
    return (x * grad).detach(), logit.detach()


def attnlrp(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
            token: str = "cls") -> torch.Tensor:
    """AttnLRP (Achtibat et al. 2024) per cell of the token grid for target_class: (B, grid_h, grid_w) in [0, 1].

    The pixels' relevance summed over the channels and over each cell of ``patch_embed.grid_size`` (a patch, or
    a hybrid's stride), then min-max scaled (signed relevance: 0 is the most negative cell, not no relevance).
    """
    relevance, _ = attnlrp_pixels(model, images, target_class, token)
    gh, gw = model.patch_embed.grid_size
    cells = F.adaptive_avg_pool2d(relevance.float().sum(dim=1, keepdim=True), (gh, gw)).flatten(1)  # (B, N)
    lo, hi = cells.amin(dim=1, keepdim=True), cells.amax(dim=1, keepdim=True)
    span = hi - lo  # relevance may be tiny (a near-zero logit), so no absolute floor: only a constant map is 0
    return torch.where(span > 0, (cells - lo) / torch.where(span > 0, span, 1.0), 0.0).reshape(-1, gh, gw)
