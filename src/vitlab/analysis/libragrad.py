"""LibraGrad (Mehri, Soleymani Baghshah & Pilehvar, CVPR 2025): gradients made FullGrad-complete by pruning and
scaling backward paths, with the forward pass unchanged.

A network is FullGrad-complete when its output is exactly the input x gradient of its inputs plus the bias x
gradient of its biases; a CNN of linear layers and ReLUs is, a transformer is not, because of its multiplicative
nonlinearities. LibraGrad restores the property by changing only the backward pass (forward hooks here):

- the attention probabilities are held constant (no gradient through the softmax, nor through q and k): the
  attention is then a gate, linear in its values;
- LayerNorm / RMSNorm: the standard deviation (root mean square) is held constant, so the normalisation is linear;
- gated activations (GELU = x Phi(x), SiLU = x sigmoid(x), QuickGELU, any elementwise activation): the gate is
  held constant, the gradient f(x) / x;
- self-gating, a product of two paths of the same input (SwiGLU's act(gate) * value): the gradient is halved, so
  that each factor receives half of the product's share (their uniform scaling of an n-fold product by 1 / n);
- a CCT's sequence pooling (softmax weights times tokens): its weights are held constant, as attention.

With these, every operation is linear in the input and the additive terms (biases, position embedding, prefix
tokens) jointly, so Euler's theorem makes the logit exactly the sum of input x gradient over the pixels and over
those terms. The paper applies the balanced gradients to every gradient-based attribution; vitlab has three of
the ones it evaluates:

- ``libragrad``: LibraGrad Input x Gradient, the pixels' relevance summed per cell of the token grid;
- ``libragrad_ig``: LibraGrad Integrated Gradients (Sundararajan et al. 2017), the balanced gradients averaged
  over ``IG_STEPS`` points (midpoint rule) of the straight path from the normalised zero image (the data set's
  mean colour) to the image, times the image;
- ``libragrad_fullgrad``: LibraGrad FullGrad+ (the authors' FullGrad+: input x gradient of each block's input
  tokens, summed over the channels and averaged over the blocks), read on the patch tokens.

Each map is min-max scaled to [0, 1] per image, as AttnLRP's (signed relevance: 0 marks the most negative cell).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import SwiGLU
from .attnlrp import ELEMENTWISE, _identity_hook, _norm_hook, _scale_hook, explained_logit
from .capture import attention_modules, explicit_attention

IG_STEPS = 16  # points on the integrated-gradients path
IG_IMAGES_PER_PASS = 64  # images (path points x images) per forward pass of integrated gradients


def _constant_hook(module, inputs, out):
    """The module's output with no gradient through it: a gate held constant."""
    return out.detach()


def _libra_hooks(model: nn.Module) -> list[tuple[nn.Module, object]]:
    hooks = [(attn.attn_map, _constant_hook) for _, _, attn in attention_modules(model)]
    seq_pool = getattr(model, "attention_pool", None)  # a CCT's sequence pooling: its weights held constant
    if isinstance(seq_pool, nn.Linear):
        hooks.append((seq_pool, _scale_hook(0.0)))
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            hooks.append((m, _norm_hook))
        elif isinstance(m, ELEMENTWISE):
            hooks.append((m, _identity_hook))
        elif isinstance(m, SwiGLU):  # act(gate) * value: two paths of one input, each gets half
            hooks.append((m.drop1, _scale_hook(0.5)))
    return hooks


@contextmanager
def libra_rules(model: nn.Module) -> Iterator[None]:
    """Within the block the model's backward pass carries LibraGrad's pruned and scaled gradients; the forward
    values do not change. The model runs in eval mode on its explicit attention path; all is put back on exit."""
    with ExitStack() as stack:
        stack.enter_context(explicit_attention(model))
        for module, hook in _libra_hooks(model):
            stack.callback(module.register_forward_hook(hook).remove)
        yield


def libra_gradients(model: nn.Module, images: torch.Tensor, target_class, token: str = "cls",
                    also: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """LibraGrad's gradient of the target logit w.r.t. the images (B, C, H, W), the logits (B,) and the gradients
    of ``also`` (tensors such as parameters, in the same graph). No parameter's .grad is touched."""
    x = images.detach().clone().requires_grad_(True)
    with torch.enable_grad(), libra_rules(model):
        logit = explained_logit(model, x, target_class, token)
        grads = torch.autograd.grad(logit.sum(), [x, *also], allow_unused=True)
    rest = [torch.zeros_like(t) if g is None else g for t, g in zip(also, grads[1:])]
    return grads[0].detach(), logit.detach(), rest


def _cells(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) relevance -> (B, N): summed over the channels, averaged over each cell of the token grid."""
    return F.adaptive_avg_pool2d(pixels.float().sum(dim=1, keepdim=True), model.patch_embed.grid_size).flatten(1)


def scaled_map(model: nn.Module, cells: torch.Tensor) -> torch.Tensor:
    """(B, N) signed relevance -> (B, grid_h, grid_w) min-max scaled to [0, 1] per image (a constant row is 0)."""
    lo, hi = cells.amin(dim=1, keepdim=True), cells.amax(dim=1, keepdim=True)
    span = hi - lo
    gh, gw = model.patch_embed.grid_size
    return torch.where(span > 0, (cells - lo) / torch.where(span > 0, span, 1.0), 0.0).reshape(-1, gh, gw)


def libragrad(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
              token: str = "cls") -> torch.Tensor:
    """LibraGrad Input x Gradient per cell of the token grid for target_class: (B, grid_h, grid_w) in [0, 1]."""
    grad, _, _ = libra_gradients(model, images, target_class, token)
    return scaled_map(model, _cells(model, images * grad))


def libragrad_ig(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
                 token: str = "cls", steps: int = IG_STEPS) -> torch.Tensor:
    """LibraGrad Integrated Gradients from the zero (mean-colour) normalised image, ``steps`` midpoints of the
    path: (B, grid_h, grid_w) in [0, 1]. The class is fixed by the intact image's target, not re-predicted."""
    B = len(images)
    target = torch.as_tensor(target_class).reshape(-1)
    per_pass = max(1, IG_IMAGES_PER_PASS // B)  # path points per forward pass: several, in one batch
    total = torch.zeros_like(images)
    for first in range(0, steps, per_pass):
        alphas = [(k + 0.5) / steps for k in range(first, min(steps, first + per_pass))]
        points = torch.cat([images * a for a in alphas])
        grad, _, _ = libra_gradients(model, points, target if target.numel() == 1 else target.repeat(len(alphas)),
                                     token)
        total += grad.reshape(len(alphas), *images.shape).sum(0)
    return scaled_map(model, _cells(model, images * total / steps))


def _block_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose input tokens FullGrad+ reads: every block holding an attention (its residual input)."""
    found = []
    for name, _, attn in attention_modules(model):
        block = model.get_submodule(name) if name else attn
        if block not in found:
            found.append(block)
    return found


def libragrad_fullgrad(model: nn.Module, images: torch.Tensor, target_class: int | Sequence[int] | torch.Tensor,
                       token: str = "cls") -> torch.Tensor:
    """LibraGrad FullGrad+: per patch token, input x gradient of each block's input summed over the channels and
    averaged over the blocks (the last N tokens of each block's input are the patches): (B, grid_h, grid_w) in
    [0, 1]."""
    blocks = _block_modules(model)  # refuses a model without attention in one line
    gh, gw = model.patch_embed.grid_size
    N = gh * gw
    inputs: list[torch.Tensor] = []

    def keep(module, args):
        t = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[1] >= N), None)
        if t is not None:
            inputs.append(t)

    handles = [b.register_forward_pre_hook(keep) for b in blocks]
    try:
        x = images.detach().clone().requires_grad_(True)
        with torch.enable_grad(), libra_rules(model):
            logit = explained_logit(model, x, target_class, token)
            grads = torch.autograd.grad(logit.sum(), inputs, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    terms = [(t * g)[:, -N:].sum(-1) for t, g in zip(inputs, grads) if g is not None]
    cells = torch.stack(terms).mean(0).detach().float() if terms else torch.zeros(len(images), N)
    return scaled_map(model, cells)
