"""One report for one model: every applicable analysis as a PNG, and report.html that explains them."""
from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..models.layers import PatchEmbed
from . import plots
from .capture import attention_modules, capture_attention, prefix_token_names
from .distance import (
    convit_gates,
    distance_layer_names,
    gpsa_positional_attention,
    mean_attention_distance,
    positional_attention_distance,
)
from .embeddings import filter_components, position_similarity
from .rollout import grad_rollout, rollout


@dataclass
class Section:
    """One figure of the report: its PNG file name (next to report.html), heading and caption."""

    file: str
    title: str
    caption: str


def model_family(model: nn.Module) -> str:
    """A readable family name: ViT, DeiT (distilled), ConViT, CaiT, hybrid ViT, ResNet."""
    name = type(model).__name__
    if name == "VisionTransformer":
        if getattr(model, "dist_token", None) is not None:
            return "DeiT (distilled: class + distillation token)"
        return "ViT" if model.cls_token is not None else "ViT (no class token, average pooling)"
    return {"ConVit": "ConViT", "Cait": "CaiT", "HybridVisionTransformer": "hybrid ViT (ResNet patch embedding)",
            "ResNet": "ResNet (CNN)"}.get(name, name)


def model_header(model: nn.Module, class_names: Sequence[str] | None) -> list[tuple[str, str]]:
    """(label, value) rows describing the model for the report's header."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    size = cfg.get("input_size")
    params = sum(p.numel() for p in model.parameters())
    modules = attention_modules(model)
    counts: dict[str, int] = {}
    for _, kind, _ in modules:
        counts[kind] = counts.get(kind, 0) + 1
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    classes = str(getattr(model, "num_classes", "?"))
    if class_names:
        shown = ", ".join(map(str, class_names[:12])) + (", ..." if len(class_names) > 12 else "")
        classes += f" ({shown})"
    embed = model.patch_embed
    return [("family", model_family(model)), ("class", type(model).__name__),
            ("architecture", str(getattr(model, "arch", None) or "(not a registered name)")),
            ("parameters", f"{params:,} ({params / 1e6:.2f} M)"),
            ("input size", "x".join(map(str, size)) if size else "?"),
            ("patches", f"{embed.grid_size[0]}x{embed.grid_size[1]} grid of "
                        f"{embed.patch_size[0]}x{embed.patch_size[1]}-pixel patches"),
            ("prefix tokens", ", ".join(prefix_token_names(model)) or "none"),
            ("attention blocks", kinds), ("classes", classes)]


def _caption_attention(family_has_cls: bool) -> str:
    query = ("the class token's row of the attention (its attention to each patch)" if family_has_cls else
             "the mean over the patch queries (this model has no class token)")
    return (f"Each row is one block (input at the top), each column one head. A panel is the patch grid of the "
            f"input and shows {query}; blocks that have no class token yet (ConViT's GPSA blocks, CaiT's "
            "self-attention blocks) show the mean over the patch queries, i.e. how much attention each patch "
            "receives. Every panel is divided by its own maximum: a uniformly bright panel is a head that "
            "attends everywhere, a single bright cell one that attends to one patch.")


def write_report(out_dir: Path, title: str, header: Sequence[tuple[str, str]], predictions: list[dict],
                 sections: Sequence[Section], notes: Sequence[str]) -> Path:
    """Write report.html next to the figures; image links are relative file names."""
    e = html.escape
    rows = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in header)
    pred_rows = []
    for p in predictions:
        top = "<br>".join(f"{e(name)} &mdash; {prob:.1%}" for name, prob in p["top"])
        pred_rows.append(f"<tr><td>{p['index']}</td><td>{e(p['name'])}</td><td>{e(p.get('label') or '')}</td>"
                         f"<td>{top}</td></tr>")
    figs = "\n".join(
        f'<section><h2>{e(s.title)}</h2><figure><img src="{e(s.file)}" alt="{e(s.title)}">'
        f"<figcaption>{e(s.caption)}</figcaption></figure></section>" for s in sections)
    note_items = "\n".join(f"<li>{e(n)}</li>" for n in notes)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
figure {{ margin: 0 0 2em; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ color: #444; margin-top: 0.4em; line-height: 1.4; }}
</style></head><body>
<h1>{e(title)}</h1>
<table>{rows}</table>
<h2>Predictions on the shown images (top 5)</h2>
<table><tr><th>#</th><th>image</th><th>true label</th><th>top-5 predictions</th></tr>
{chr(10).join(pred_rows)}</table>
{figs}
<h2>Notes</h2><ul>{note_items}</ul>
</body></html>
"""
    path = Path(out_dir) / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def inspect_model(model: nn.Module, images: torch.Tensor, out_dir: str | Path, *,
                  image_names: Sequence[str] | None = None, labels: Sequence[int] | None = None,
                  class_names: Sequence[str] | None = None, distance_images: torch.Tensor | None = None,
                  head_fusion: str = "mean", discard_ratio: float = 0.9, batch_size: int = 64,
                  max_head_figures: int = 4, title: str | None = None) -> Path:
    """Run every applicable analysis on normalised images (B, C, H, W); write the PNGs and report.html to out_dir.

    distance_images (default: images) are the set the mean attention distance is averaged over.
    Returns the path of report.html. A model without attention (ResNet) raises ValueError.
    """
    attention_modules(model)  # fails early, and clearly, for a CNN
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    C = images.shape[1]
    mean, std = cfg.get("mean", (0.5,) * C), cfg.get("std", (0.5,) * C)
    class_names = list(class_names or cfg.get("label_names") or []) or None
    device = next(model.parameters()).device
    images = images.to(device)
    B = len(images)
    names = list(image_names or [f"image {i}" for i in range(B)])
    sections: list[Section] = []
    notes: list[str] = []
    summary: dict = {}

    def add(fig, file: str, heading: str, caption: str) -> None:
        plots.save_figure(fig, out / file)
        sections.append(Section(file, heading, caption))

    # predictions and attention maps of the shown images, in one forward pass
    with torch.no_grad(), capture_attention(model) as maps:
        logits = model(images)  # (B, classes)
    probs = logits.float().softmax(dim=-1)
    top = probs.topk(min(5, probs.shape[-1]), dim=-1)
    label_of = lambda c: class_names[c] if class_names and c < len(class_names) else f"class {c}"
    predictions = [{"index": i, "name": names[i],
                    "label": label_of(int(labels[i])) if labels is not None else None,
                    "top": [(label_of(int(c)), float(p)) for p, c in zip(top.values[i], top.indices[i])]}
                   for i in range(B)]
    display = plots.display_images(images, mean, std)  # (B, H, W, C) in [0, 1]
    prefix = prefix_token_names(model)
    has_cls = "cls" in prefix

    # attention per block and head
    n_heads_figs = min(B, max_head_figures)
    for i in range(n_heads_figs):
        fig = plots.plot_attention_heads(maps, i, display[i],
                                         title=f"Attention per block and head: {names[i]} "
                                               f"(predicted {predictions[i]['top'][0][0]})")
        add(fig, f"attention_heads_{i}.png", f"Attention per block and head: {names[i]}", _caption_attention(has_cls))
    if B > n_heads_figs:
        notes.append(f"Per-head attention figures are drawn for the first {n_heads_figs} of the {B} images.")

    # rollout
    masks = {}
    token_label = "class token" if has_cls else "mean of patch queries"
    masks[f"rollout\n({token_label})"] = rollout(maps, head_fusion=head_fusion, discard_ratio=discard_ratio)
    if "dist" in prefix:
        masks["rollout\n(distillation token)"] = rollout(maps, head_fusion=head_fusion, discard_ratio=discard_ratio,
                                                         token="dist")
    masks["grad rollout\n(predicted class)"] = grad_rollout(model, images, top.indices[:, 0],
                                                            discard_ratio=discard_ratio)
    captions = [f"{names[i]}\n{p['top'][0][0]} ({p['top'][0][1]:.0%})" for i, p in enumerate(predictions)]
    add(plots.plot_rollout(display, masks, captions, title="Attention rollout"), "rollout.png", "Attention rollout",
        f"Attention rollout (Abnar & Zuidema 2020) traces how much each input patch contributes to the "
        f"{token_label} at the output: per block the heads are fused by their {head_fusion}, the lowest "
        f"{discard_ratio:.0%} of each row is dropped (never the class token's attention to itself), the identity "
        "is added for the residual connection, and the blocks' matrices are multiplied. Red (jet) marks the "
        "most relevant patches, blue the least; each map is scaled to its own maximum. The grad-rollout row "
        "weights every attention map by its gradient with respect to the predicted class's score and keeps the "
        "positive part, so it is class-specific."
        + (" The distillation-token row reads the same rollout from DeiT's distillation token." if "dist" in prefix
           else ""))

    # mean attention distance
    dist_set = images if distance_images is None else distance_images.to(device)
    distances = mean_attention_distance(model, dist_set, batch_size=batch_size)  # (layers, heads)
    layer_kinds = distance_layer_names(model)
    summary["mean_attention_distance_px"] = {n: d.tolist() for (n, _), d in zip(layer_kinds, distances)}
    embed = model.patch_embed
    add(plots.plot_attention_distance(distances, [k for _, k in layer_kinds], embed.grid_size, embed.patch_size),
        "attention_distance.png", "Mean attention distance",
        f"As in the ViT paper (Fig. 11): for each head, the attention-weighted distance in pixels between a query "
        f"patch's centre and the patches it attends to, averaged over queries and {len(dist_set)} image(s). Only "
        "patch-to-patch attention counts (prefix tokens dropped, rows renormalised); class-attention blocks are "
        "left out. One dot per head; the dashed line is the distance of uniform attention. Low dots are local "
        "heads (like convolutions), high dots global ones; trained ViTs mix both in early layers and become "
        "global with depth.")

    # position embedding similarity
    if getattr(model, "pos_embed", None) is not None:
        sim = position_similarity(model)
        add(plots.plot_position_similarity(sim), "position_similarity.png", "Position embedding similarity",
            "As in the ViT paper (Fig. 7, centre): tile (r, c) shows the cosine similarity between the position "
            "embedding of the patch in row r, column c and that of every patch. A learned embedding that encodes "
            "2D position shows a bright spot at the tile's own place that fades with distance, often with "
            "row and column structure; a random one shows noise.")
    else:
        notes.append("Position embedding similarity: skipped, the model has no position embedding.")

    # patch-embedding filters
    if isinstance(embed, PatchEmbed):
        comps, var = filter_components(embed.proj.weight, 28)
        add(plots.plot_embedding_filters(comps, var), "embedding_filters.png", "Patch-embedding filter components",
            f"As in the ViT paper (Fig. 7, left): the top {len(comps)} principal components of the "
            f"{embed.proj.weight.shape[0]} linear patch-embedding filters, each shown as a "
            f"{embed.patch_size[0]}x{embed.patch_size[1]} patch (colours are the filter's RGB weights for "
            "3-channel models, min-max scaled per component). Trained models show smooth, Gabor- or "
            "DCT-like bases; random weights show noise.")
    else:
        notes.append("Patch-embedding filters: skipped, the patch embedding of a hybrid is a ResNet followed by a "
                     "1x1 projection, not filters over pixels.")

    # ConViT gates and positional attention
    if any(k == "gpsa" for _, k, _ in attention_modules(model)):
        gates, pos_dist = convit_gates(model), positional_attention_distance(model)
        summary["convit_gates"], summary["positional_attention_distance_px"] = gates.tolist(), pos_dist.tolist()
        add(plots.plot_convit_gates(gates, pos_dist), "convit_gates.png", "ConViT gates",
            "Each GPSA head mixes content attention and positional attention with the gate sigmoid(lambda) "
            "(left; 1 = purely positional, 0 = purely content, sigmoid(1) = 0.73 at init). Right: the mean "
            "distance in pixels of each head's positional branch alone; small values are local, "
            "convolution-like heads. Trained ConViTs let later GPSA layers drift to content (low gates).")
        add(plots.plot_gpsa_positional(gpsa_positional_attention(model), embed.grid_size, pos_dist),
            "convit_positional.png", "ConViT positional attention",
            "For each GPSA layer and head, the positional attention softmax(pos_proj(relative offsets)) of the "
            "centre patch (+) over the patch grid, with its mean distance. At init the heads form the offsets "
            "of a convolution kernel.")
    else:
        notes.append("ConViT gates: skipped, the model has no gated positional self-attention (not a ConViT).")

    # CaiT class attention
    if any(m.kind == "class_attn" for m in maps):
        idx = list(range(min(B, 4)))
        add(plots.plot_class_attention(maps, display, idx), "cait_class_attention.png", "CaiT class attention",
            "CaiT's class token only enters in the final class-attention blocks, where it alone queries the "
            "[class, patches] tokens. Each row is one image and class-attention block, each column a head: the "
            "class token's attention to the patches (scaled to the panel's maximum); 'self' is its weight on "
            "itself. Talking-heads self-attention rows in the other figures do not sum exactly to 1 (the "
            "post-softmax head mixing proj_w is linear), and are shown as they are.")
    else:
        notes.append("CaiT class attention: skipped, the model has no class-attention blocks (not a CaiT).")

    summary["predictions"] = predictions
    (out / "analysis.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    header = model_header(model, class_names)
    title = title or f"vitlab inspect: {getattr(model, 'arch', None) or type(model).__name__}"
    return write_report(out, title, header, predictions, sections, notes)
