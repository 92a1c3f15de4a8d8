"""Checks on the explanations and the heads: the model-parameter randomisation test and per-head importance.

Randomisation (Adebayo et al. 2018, cascading): re-initialise the weights from the top down,
the classifier head first, then one block after another from the last, then the embeddings, and
after each stage compare every method's map with the one of the trained model by Spearman's
rank correlation (mean over images). A map that depends on what the model learnt decorrelates;
one that stays similar once every block is random explains the input, not the model, and is
flagged.

Head importance (as in Michel et al. 2019): the drop of the target class's logit when one
head's attention is zeroed (so the head adds nothing to its block's output), mean over images.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..progress import progress_bar
from .capture import attention_modules, capture_attention
from .explain import explain, explanation_methods, method_key
from .faithfulness import map_rank_correlation
from .libragrad import libragrad_ig

FLAG_THRESHOLD = 0.5  # mean rank correlation at or above which a map "did not change"
CHECK_IG_STEPS = 4  # integrated gradients' path points in the check, where it is drawn again at every stage


def randomisation_stages(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(label, module names) of the cascade, top first: the head(s), each block from the last, the embeddings."""
    stages = [("head", [n for n in model.classifier_names if isinstance(getattr(model, n, None), nn.Module)])]
    for name, _, _ in reversed(attention_modules(model)):
        stages.append((name, [name]))
    embed = [n for n in ("patch_embed", "pos_embed", "cls_token", "dist_token", "reg_token")
             if getattr(model, n, None) is not None]
    stages.append(("embeddings", embed))
    return stages


@torch.no_grad()
def reinitialise(model: nn.Module, names: Sequence[str], generator: torch.Generator) -> None:
    """Draw fresh random weights for the named submodules or parameters: N(0, 0.02) everywhere, except
    normalisation layers, which go back to weight 1 and bias 0."""
    for name in names:
        target = getattr(model, name, None) if "." not in name else model.get_submodule(name)
        if isinstance(target, nn.Parameter):
            target.copy_(torch.randn(target.shape, generator=generator) * 0.02)
            continue
        if not isinstance(target, nn.Module):  # a buffer (e.g. a fixed sin-cos position embedding): nothing learnt
            continue
        for module in target.modules():
            norm = isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d))
            for pname, p in module.named_parameters(recurse=False):
                if norm:
                    p.fill_(1.0 if pname == "weight" else 0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
            if isinstance(module, nn.BatchNorm2d) and module.running_mean is not None:
                module.reset_running_stats()


def parameter_randomisation(model: nn.Module, images: torch.Tensor, methods: Sequence[tuple[str, str]] | None = None,
                            *, head_fusion: str = "mean", discard_ratio: float = 0.0, seed: int = 0,
                            threshold: float = FLAG_THRESHOLD, original: dict[str, torch.Tensor] | None = None,
                            progress: bool = False, ig_steps: int = CHECK_IG_STEPS) -> dict:
    """Cascading randomisation test on normalised images (B, C, H, W): a JSON-ready dict with ``stages`` (labels,
    top first), ``correlation`` (method key -> mean Spearman rho after each stage), ``flagged`` (methods whose
    rho stays >= threshold once every block is random) and ``class_agnostic`` (rho still 1 after the head).

    The maps explain the class the trained model predicts, at every stage. The model is not changed. original: the
    trained model's maps of these images already drawn (method key -> maps), not drawn again (but integrated
    gradients', which is drawn here with ``ig_steps`` path points, trained and randomised alike). progress: a bar
    over the stages, with its time left.
    """
    methods = list(methods or explanation_methods(model))
    with torch.no_grad():
        target = model.eval()(images).argmax(dim=-1)
    kw = dict(head_fusion=head_fusion, discard_ratio=discard_ratio)

    def draw(net: nn.Module, m: str, t: str) -> torch.Tensor:
        if m == "libragrad_ig":
            return libragrad_ig(net, images, target, token=t, steps=ig_steps)
        return explain(net, images, m, target, token=t, **kw)

    given = {k: v for k, v in (original or {}).items() if not k.startswith("libragrad_ig")}
    original = {method_key(m, t): given[method_key(m, t)].to(images.device) if method_key(m, t) in given
                else draw(model, m, t) for m, t in methods}
    randomised = copy.deepcopy(model).eval()
    generator = torch.Generator().manual_seed(seed)
    stages = randomisation_stages(model)
    corr: dict[str, list[float]] = {k: [] for k in original}
    with progress_bar(total=len(stages) * len(methods), desc="randomisation", unit="map", disable=not progress) as bar:
        for _, names in stages:
            reinitialise(randomised, names, generator)
            for (m, t), key in zip(methods, original):
                corr[key].append(map_rank_correlation(original[key], draw(randomised, m, t)))
                bar.update()
    last_block = len(stages) - 2  # the stage after which every block is random
    return {"stages": [label for label, _ in stages], "correlation": corr, "threshold": threshold,
            "flagged": [k for k, c in corr.items() if c[last_block] >= threshold],
            "class_agnostic": [k for k, c in corr.items() if c[0] > 0.999],
            "images": len(images), "seed": seed, "ig_steps": ig_steps}


@torch.no_grad()
def head_importance(model: nn.Module, images: torch.Tensor, target_class: Sequence[int] | torch.Tensor | None = None,
                    batch_size: int = 64, progress: bool = False) -> tuple[torch.Tensor, list[str]]:
    """(blocks, heads) drop of the target logit when each head's attention is zeroed, mean over images (NaN past a
    block's own heads, where blocks differ: PE's attention pool has 8 over blocks of fewer); and the block names.
    target_class: one class per image (default: the class predicted on the intact image). progress: a bar over the
    heads, with its time left."""
    modules = attention_modules(model)
    model.eval()
    drops = None
    heads = sum(module.num_heads for _, _, module in modules)
    bar = progress_bar(total=heads * len(images), desc="head importance", unit="img", disable=not progress)
    for s in range(0, len(images), batch_size):
        x = images[s:s + batch_size]
        logits = model(x)
        t = logits.argmax(-1) if target_class is None else torch.as_tensor(target_class[s:s + batch_size]).long()
        base = logits.gather(1, t[:, None])[:, 0]
        rows = []
        for _, _, module in modules:
            row = []
            for h in range(module.num_heads):
                def zero_head(mod, inputs, out, h=h):  # out: (B, heads, Q, K)
                    out = out.clone()
                    out[:, h] = 0
                    return out
                with capture_attention(model):  # the slow path, so that attn_map is called
                    handle = module.attn_map.register_forward_hook(zero_head)
                    try:
                        row.append((base - model(x).gather(1, t[:, None])[:, 0]).sum())
                    finally:
                        handle.remove()
                    bar.update(len(x))
            rows.append(torch.stack(row))
        width = max(len(row) for row in rows)
        batch = torch.stack([F.pad(row, (0, width - len(row)), value=float("nan")) for row in rows])
        drops = batch if drops is None else drops + batch
    bar.close()
    return (drops / len(images)).float(), [name for name, _, _ in modules]
