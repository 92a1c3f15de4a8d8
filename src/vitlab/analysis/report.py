"""One report for one model: every applicable analysis as a PNG, and report.html that explains them."""
from __future__ import annotations

import base64
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
from .faithfulness import faithfulness, method_key, method_label
from .interactive import EXPLORER_CSS, explorer_data, explorer_html
from .rollout import explain, explanation_methods
from .sanity import head_importance, parameter_randomisation


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


def _figure_src(out_dir: Path, file: str) -> str:
    """A figure next to report.html as a data: URL, so that the report is one self-contained file."""
    return "data:image/png;base64," + base64.b64encode((Path(out_dir) / file).read_bytes()).decode("ascii")


def faithfulness_table(result: dict) -> str:
    """An HTML table: one row per method, its mean deletion/insertion AUC and perturbation AUCs."""
    e = html.escape
    rows = "\n".join(
        f"<tr><td>{e(m['label'])}</td><td>{m['deletion_auc']:.3f}</td><td>{m['insertion_auc']:.3f}</td>"
        f"<td>{m['positive_auc']:.2f}</td><td>{m['negative_auc']:.2f}</td></tr>" for m in result["methods"].values())
    return ("<table><tr><th>method</th><th>deletion AUC &darr;</th><th>insertion AUC &uarr;</th>"
            "<th>positive perturbation AUC &darr;</th><th>negative perturbation AUC &uarr;</th></tr>"
            f"{rows}</table>")


def write_report(out_dir: Path, title: str, header: Sequence[tuple[str, str]], predictions: list[dict],
                 sections: Sequence[Section], notes: Sequence[str], tables: Sequence[tuple[str, str]] = (),
                 explorer: str = "") -> Path:
    """Write report.html, one self-contained file: the figures (also left next to it as PNGs) are embedded as
    data: URLs; tables are (heading, HTML table) pairs; explorer is the interactive section's HTML."""
    e = html.escape
    rows = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in header)
    pred_rows = []
    for p in predictions:
        top = "<br>".join(f"{e(name)} &mdash; {prob:.1%}" for name, prob in p["top"])
        pred_rows.append(f"<tr><td>{p['index']}</td><td>{e(p['name'])}</td><td>{e(p.get('label') or '')}</td>"
                         f"<td>{top}</td></tr>")
    figs = "\n".join(
        f'<section><h2>{e(s.title)}</h2><figure><img src="{_figure_src(out_dir, s.file)}" data-file="{e(s.file)}" '
        f'alt="{e(s.title)}"><figcaption>{e(s.caption)}</figcaption></figure></section>' for s in sections)
    table_html = "\n".join(f"<section><h2>{e(heading)}</h2>{table}</section>" for heading, table in tables)
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
{EXPLORER_CSS}
</style></head><body>
<h1>{e(title)}</h1>
<table>{rows}</table>
<h2>Predictions on the shown images (top 5)</h2>
<table><tr><th>#</th><th>image</th><th>true label</th><th>top-5 predictions</th></tr>
{chr(10).join(pred_rows)}</table>
{explorer}
{table_html}
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
                  max_head_figures: int = 4, title: str | None = None,
                  faithfulness_images: torch.Tensor | None = None, faithfulness_labels: Sequence[int] | None = None,
                  curve_steps: int = 16, sanity_images: int = 4, importance_images: int = 64,
                  explorer_images: int = 4) -> Path:
    """Run every applicable analysis on normalised images (B, C, H, W); write the PNGs, faithfulness.json,
    analysis.json and report.html (self-contained, with the interactive explorer) to out_dir.

    distance_images (default: images) are the set the mean attention distance and head importance
    are averaged over; faithfulness_images (default: images) with their labels (default: the
    shown labels, else the model's own prediction) the set the faithfulness scores are measured on.
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

    # explanation maps and their faithfulness
    pred = top.indices[:, 0]
    pairs = explanation_methods(model)
    token_label = "class token" if has_cls else "mean of patch queries"
    maps_by_key = {method_key(m, t): explain(model, images, m, pred, token=t, head_fusion=head_fusion,
                                             discard_ratio=discard_ratio) for m, t in pairs}
    fset = images if faithfulness_images is None else faithfulness_images.to(device)
    flabels = labels if faithfulness_images is None else faithfulness_labels
    faith = faithfulness(model, fset, None if flabels is None else torch.as_tensor(list(flabels)),
                         methods=pairs, batch_size=batch_size, curve_steps=curve_steps, head_fusion=head_fusion,
                         discard_ratio=discard_ratio, keep_images=B if faithfulness_images is None else 0)
    if faithfulness_images is not None:  # the shown images' own curves, for the figure and the explorer
        faith["images"] = faithfulness(model, images, methods=pairs, batch_size=batch_size, curve_steps=curve_steps,
                                       head_fusion=head_fusion, discard_ratio=discard_ratio, keep_images=B,
                                       progress=False)["images"]
    (out / "faithfulness.json").write_text(json.dumps(faith, indent=1) + "\n", encoding="utf-8")
    per_image = {k: [img["methods"][k] for img in faith["images"]] for k in maps_by_key}
    row_label = {k: method_label(k).replace(" (", "\n(", 1) for k in maps_by_key}
    masks = {row_label[k]: v for k, v in maps_by_key.items()}
    scores = {row_label[k]: [f"del {s['deletion_auc']:.2f} / ins {s['insertion_auc']:.2f}" for s in per_image[k]]
              for k in maps_by_key}
    captions = [f"{names[i]}\n{p['top'][0][0]} ({p['top'][0][1]:.0%})" for i, p in enumerate(predictions)]
    add(plots.plot_rollout(display, masks, captions, title="Attention rollout and relevance", scores=scores),
        "rollout.png", "Attention rollout and relevance",
        f"Four ways to ask which patches the prediction rests on, for the {token_label}: the last block's "
        "attention (heads averaged; the baseline), attention rollout (Abnar & Zuidema 2020: per block the heads "
        f"are fused by their {head_fusion}, the lowest {discard_ratio:.0%} of each row dropped (never the class "
        "token's attention to itself), the identity added for the residual connection and the blocks' matrices "
        "multiplied), gradient rollout (each map weighted by its gradient with respect to the predicted class's "
        "logit, positive part, then rolled out) and the relevance of Chefer, Gur & Wolf (ICCV 2021: R = I, then "
        "per block R += mean over heads of (gradient x attention)^+ @ R, no renormalisation). Rollout and raw "
        "attention are the same for every class; the gradient methods explain the predicted class. Red (jet) "
        "marks the most relevant patches; each map is scaled to its own range. Under each map: its deletion and "
        "insertion AUC on that image (see Faithfulness)."
        + (" The distillation-token rows read the same methods from DeiT's distillation token." if "dist" in prefix
           else ""))
    summary["faithfulness"] = {k: {m: v[m] for m in ("deletion_auc", "insertion_auc", "positive_auc",
                                                      "negative_auc")} for k, v in faith["methods"].items()}
    proto = faith["protocol"]
    di = proto["deletion_insertion"]
    add(plots.plot_faithfulness(faith), "faithfulness.png", "Faithfulness",
        f"Over {proto['images']} image(s). Deletion/insertion (RISE, Petsiuk et al. 2018): the probability of the "
        f"class predicted on the intact image as patches are replaced by the '{di['deletion_baseline']}' "
        f"baseline (deletion) or revealed over a '{di['insertion_baseline']}' copy (insertion; blur sigma "
        f"{di['blur_sigma_px']:.1f} px), "
        "most relevant first; a faithful map gives a low deletion and a high insertion area. Positive/negative "
        "perturbation (Chefer et al. 2021): top-1 accuracy "
        f"({proto['perturbation']['accuracy_against']}) after blacking out 10%..90% of the patches, the most "
        "(positive: lower is better) or least (negative: higher is better) relevant first; AUC by the trapezoid "
        "rule with the unperturbed point. The dashed line is a random patch order. Every parameter is in "
        "faithfulness.json.")

    # sanity check: cascading parameter randomisation
    sanity_set = images[:sanity_images]
    sanity = parameter_randomisation(model, sanity_set, pairs, head_fusion=head_fusion, discard_ratio=discard_ratio)
    summary["randomisation"] = sanity
    labels_by_key = {k: method_label(k) for k in maps_by_key}
    add(plots.plot_randomisation(sanity, labels_by_key), "randomisation.png", "Sanity check: parameter randomisation",
        f"The model-parameter randomisation test (Adebayo et al. 2018) on {len(sanity_set)} image(s): the weights are "
        "re-drawn at random from the top down (the classifier head first, then each block from the last, then the "
        "embeddings), and each method's map is compared with the trained model's by Spearman rank correlation. "
        "A map that explains the model loses its shape; one that stays similar once every block is random "
        f"(correlation >= {sanity['threshold']}) reflects the input more than the model and is flagged.")
    for k in sanity["flagged"]:
        notes.append(f"Sanity check: {labels_by_key[k]} does not change when the model's weights are randomised "
                     f"(rank correlation {sanity['correlation'][k][-2]:.2f} with every block random): it is flagged "
                     "as not explaining the model.")
    agnostic = [labels_by_key[k] for k in sanity["class_agnostic"]]
    if agnostic:
        notes.append("Class-agnostic (unchanged when the classifier head is randomised): " + ", ".join(agnostic) + ".")

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

    # per-head importance, beside the heads' mean attention distance
    imp_set = dist_set[:importance_images]
    importance, block_names = head_importance(model, imp_set, batch_size=batch_size)
    summary["head_importance"] = {n: r.tolist() for n, r in zip(block_names, importance)}
    add(plots.plot_head_importance(importance, block_names, distances, [n for n, _ in layer_kinds]),
        "head_importance.png", "Head importance",
        f"For each block and head, how much the logit of the predicted class drops when that head's attention is "
        f"zeroed (so it adds nothing to its block's output), mean over {len(imp_set)} image(s); red: the head "
        "helps the prediction, blue: removing it raises the logit. Right: the same heads' mean attention "
        "distance, to see whether the heads that matter are local or global.")

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
    methods = {k: (method_label(k), v) for k, v in maps_by_key.items()}
    data = explorer_data(maps, display, names, [f"{names[i]}: predicted {p['top'][0][0]} ({p['top'][0][1]:.0%})"
                                                + (f", true {p['label']}" if p.get("label") else "")
                                                for i, p in enumerate(predictions)],
                         methods, per_image, {k: v for k, v in faith["methods"].items() if k in methods},
                         max_images=explorer_images)
    tables = [(f"Faithfulness over {proto['images']} image(s) (faithfulness.json)", faithfulness_table(faith))]
    return write_report(out, title, header, predictions, sections, notes, tables, explorer_html(data))
