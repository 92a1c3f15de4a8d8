"""Figures of the analyses, as matplotlib Figures drawn on the Agg canvas (no display, no pyplot state).

Every function returns a Figure with a title, axis labels where the axes mean something, and
a colour bar where colours encode values; ``save_figure`` writes one to a PNG.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..atomic import atomic_path
from ..errors import VitlabError
from .capture import AttentionMap
from .distance import patch_distances
from .explain import split_key

KIND_LABELS = {"mhsa": "self-attention (MHSA)", "gpsa": "gated positional (GPSA)",
               "talking_heads": "talking-heads self-attention", "class_attn": "class attention"}
KIND_COLOURS = {"mhsa": "tab:blue", "gpsa": "tab:orange", "talking_heads": "tab:green", "class_attn": "tab:red"}


def new_figure(width: float, height: float) -> Figure:
    """A Figure on the Agg canvas with constrained layout."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write a Figure to a PNG file through an atomic rename: a full disk leaves the previous file or none, never a
    truncated one, and is one line naming the file."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, facecolor="white", format="png")
    return path


def display_images(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Normalised (B, C, H, W) -> displayable (B, H, W, C) in [0, 1]."""
    mean_t = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    x = images.detach().float().cpu() * std_t + mean_t
    return x.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()


def _show_image(ax, img: np.ndarray) -> None:
    """An (H, W, C) image in [0, 1]: grey for one channel, RGB for three, the channel mean otherwise."""
    if img.shape[-1] == 3:
        ax.imshow(img)
    else:
        ax.imshow(img.mean(axis=-1), cmap="gray", vmin=0, vmax=1)
    ax.set_xticks([])
    ax.set_yticks([])


def _panel(ax, values: np.ndarray, cmap: str = "inferno", vmin: float = 0.0, vmax: float = 1.0) -> None:
    ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def _relative(v: np.ndarray) -> np.ndarray:
    """A map divided by its maximum, so every panel spans [0, 1]."""
    top = float(np.max(v))
    return v / top if top > 0 else v


def query_attention(m: AttentionMap, index: int) -> tuple[np.ndarray, str]:
    """(heads, grid_h, grid_w) attention to the patches of one image: the class token's row, else the patch mean."""
    P = m.num_prefix
    a = m.attn[index].float().cpu()  # (heads, Q, K)
    if m.kind == "attn_pool":
        row, what = a[:, 0, P:], "pooling query"
    elif m.kind == "class_attn" or "cls" in m.prefix_tokens:
        row, what = a[:, 0, P:], "class token"
    else:
        row, what = a[:, P:, P:].mean(dim=1), "mean of patch queries"
    return row.reshape(-1, *m.grid_size).cpu().numpy(), what


def plot_attention_heads(maps: Sequence[AttentionMap], index: int = 0, image: np.ndarray | None = None,
                         title: str | None = None) -> Figure:
    """Per block (rows) and head (columns), one image's attention to the patches as grid heat-maps."""
    heads = max(m.num_heads for m in maps)
    lead = 1 if image is not None else 0
    fig = new_figure(1.25 * (heads + lead) + 1.6, 1.15 * len(maps) + 1.0)
    axes = fig.subplots(len(maps), heads + lead, squeeze=False)
    for r, m in enumerate(maps):
        values, what = query_attention(m, index)
        for h in range(heads):
            ax = axes[r, h + lead]
            if h >= values.shape[0]:
                ax.axis("off")
                continue
            _panel(ax, _relative(values[h]))
            if r == 0:
                ax.set_title(f"head {h}", fontsize=9)
        axes[r, lead].set_ylabel(f"{m.name}\n{m.kind}\n({what})", fontsize=7)
        if lead:
            axes[r, 0].axis("off")
    if lead:
        axes[0, 0].axis("on")
        _show_image(axes[0, 0], image)
        axes[0, 0].set_title("input", fontsize=9)
    fig.suptitle(title or f"Attention to the patches per block and head (image {index})")
    fig.supxlabel("attention head (each panel: the patch grid, x = patch column, y = patch row)", fontsize=9)
    fig.supylabel("block, input to output (top to bottom)", fontsize=9)
    fig.colorbar(ScalarMappable(Normalize(0, 1), "inferno"), ax=axes[:, lead:].ravel().tolist(), shrink=0.6,
                 label="attention / panel maximum")
    return fig


def plot_rollout(images: np.ndarray, masks: dict[str, torch.Tensor], captions: Sequence[str],
                 alpha: float = 0.5, cmap: str = "jet", title: str = "Attention rollout",
                 scores: dict[str, Sequence[str]] | None = None) -> Figure:
    """Input images (top row) and each mask overlaid on them (one row per entry of masks); scores: per mask label,
    one short text per image shown under its panel (e.g. its deletion and insertion AUC)."""
    B, H, W = images.shape[:3]
    rows = 1 + len(masks)
    fig = new_figure(1.7 * B + 1.4, 1.75 * rows + 0.9)
    axes = fig.subplots(rows, B, squeeze=False)
    extent = (-0.5, W - 0.5, H - 0.5, -0.5)  # stretch the patch grid over the image
    for i in range(B):
        _show_image(axes[0, i], images[i])
        axes[0, i].set_title(captions[i], fontsize=7)
        for r, mask in enumerate(masks.values(), start=1):
            _show_image(axes[r, i], images[i])
            axes[r, i].imshow(mask[i].float().cpu().numpy(), cmap=cmap, alpha=alpha, vmin=0, vmax=1,
                              extent=extent, interpolation="bilinear")
            label = list(masks)[r - 1]
            if scores and label in scores:
                axes[r, i].set_xlabel(scores[label][i], fontsize=6)
    axes[0, 0].set_ylabel("input", fontsize=9)
    for r, label in enumerate(masks, start=1):
        axes[r, 0].set_ylabel(label, fontsize=9)
    fig.suptitle(title)
    fig.colorbar(ScalarMappable(Normalize(0, 1), cmap), ax=axes[1:].ravel().tolist(), shrink=0.8,
                 label="relevance / image maximum")
    return fig


def plot_attention_distance(distances: torch.Tensor, kinds: Sequence[str], grid_size: tuple[int, int],
                            patch_size: tuple[int, int], title: str = "Mean attention distance") -> Figure:
    """One dot per head at each depth: mean attention distance in pixels (ViT paper, Fig. 11)."""
    L, H = distances.shape
    fig = new_figure(6.4, 4.4)
    ax = fig.add_subplot()
    d = distances.float().cpu().numpy()
    for kind in dict.fromkeys(kinds):
        layers = [i for i in range(L) if kinds[i] == kind]
        xs = np.repeat(np.array(layers) + 1, H)
        ax.scatter(xs, d[layers].reshape(-1), s=22, alpha=0.8, color=KIND_COLOURS.get(kind, "tab:gray"),
                   label=KIND_LABELS.get(kind, kind), edgecolors="none")
    uniform = float(patch_distances(grid_size, patch_size).mean())
    ax.axhline(uniform, color="gray", linestyle="--", linewidth=1, label=f"uniform attention ({uniform:.1f} px)")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(range(1, L + 1))
    ax.set_xlim(0.3, L + 0.7)
    ax.set_ylim(0, max(float(d.max()), uniform) * 1.15 + 1e-6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{title}\n(one dot per head; {patch_size[0]}x{patch_size[1]}-pixel patches, "
                 f"{grid_size[0]}x{grid_size[1]} grid)", fontsize=10)
    return fig


def plot_position_similarity(sim: torch.Tensor,
                             title: str = "Position embedding similarity") -> Figure:
    """A grid_h x grid_w mosaic: tile (r, c) is the cosine similarity of patch (r, c)'s embedding with all others."""
    gh, gw = sim.shape[:2]
    s = sim.float().cpu().numpy()
    mosaic = np.full((gh * (gh + 1) - 1, gw * (gw + 1) - 1), np.nan)
    for r in range(gh):
        for c in range(gw):
            mosaic[r * (gh + 1):r * (gh + 1) + gh, c * (gw + 1):c * (gw + 1) + gw] = s[r, c]
    fig = new_figure(6.4, 5.8)
    ax = fig.add_subplot()
    im = ax.imshow(mosaic, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    step = max(1, math.ceil(max(gh, gw) / 16))
    ax.set_xticks([c * (gw + 1) + (gw - 1) / 2 for c in range(0, gw, step)], [str(c + 1) for c in range(0, gw, step)])
    ax.set_yticks([r * (gh + 1) + (gh - 1) / 2 for r in range(0, gh, step)], [str(r + 1) for r in range(0, gh, step)])
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    ax.set_title(f"{title}\n(tile = one patch's embedding vs. every patch)", fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.85, label="cosine similarity")
    return fig


def plot_embedding_filters(components: torch.Tensor, variance: torch.Tensor | None = None,
                           title: str = "Principal components of the patch-embedding filters") -> Figure:
    """The k filter components (k, C, ph, pw) as small images, each min-max scaled."""
    k, C = components.shape[:2]
    cols = min(7, k)
    rows = math.ceil(k / cols)
    fig = new_figure(1.25 * cols + (1.3 if C != 3 else 0.3), 1.35 * rows + 0.9)
    axes = fig.subplots(rows, cols, squeeze=False)
    comp = components.float().cpu()
    for i, ax in enumerate(axes.ravel()):
        if i >= k:
            ax.axis("off")
            continue
        c = comp[i]
        c = (c - c.min()) / (c.max() - c.min()).clamp_min(1e-12)  # (C, ph, pw) in [0, 1]
        if C == 3:
            ax.imshow(c.permute(1, 2, 0).cpu().numpy(), interpolation="nearest")
        else:
            ax.imshow(c.mean(dim=0).cpu().numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        label = f"PC {i + 1}" + (f" ({float(variance[i]):.0%})" if variance is not None else "")
        ax.set_title(label, fontsize=8)
    fig.suptitle(f"{title}\n(each component min-max scaled; % = share of the filters' variance)", fontsize=10)
    if C != 3:
        fig.colorbar(ScalarMappable(Normalize(0, 1), "gray"), ax=axes.ravel().tolist(), shrink=0.7,
                     label="weight (0 = component min, 1 = max)")
    return fig


def plot_token_mixing(maps: Sequence[np.ndarray], row_labels: Sequence[str],
                      title: str = "Token-mixing weights (first layer of the token MLP)") -> Figure:
    """One row per block: that block's (units, gh, gw) token-mixing weights as maps, each scaled to its own range."""
    cols = max(len(m) for m in maps)
    fig = new_figure(1.2 * cols + 1.0, 1.25 * len(maps) + 0.8)
    axes = fig.subplots(len(maps), cols, squeeze=False)
    for row, (units, label) in enumerate(zip(maps, row_labels)):
        for j, ax in enumerate(axes[row]):
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(units):
                ax.axis("off")
                continue
            w = units[j]
            lim = float(np.abs(w).max()) or 1.0
            ax.imshow(w, cmap="coolwarm", vmin=-lim, vmax=lim, interpolation="nearest")
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
    fig.suptitle(f"{title}\n(each panel one hidden unit over the patch grid; blue negative, red positive)", fontsize=10)
    return fig


def plot_convit_gates(gates: torch.Tensor, positional_distance: torch.Tensor | None = None,
                      title: str = "ConViT gates") -> Figure:
    """Heat-map of sigmoid(gating_param) per GPSA layer and head; with distances, each head's positional reach."""
    L, H = gates.shape
    panels = 1 if positional_distance is None else 2
    fig = new_figure(0.55 * H * panels + 4.5, 0.45 * L + 2.6)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    g = gates.float().cpu().numpy()
    im = axes[0].imshow(g, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for layer in range(L):
        for h in range(H):
            axes[0].text(h, layer, f"{g[layer, h]:.2f}", ha="center", va="center", fontsize=7,
                         color="white" if g[layer, h] < 0.6 else "black")
    axes[0].set_xticks(range(H))
    axes[0].set_yticks(range(L), [str(i + 1) for i in range(L)])
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("GPSA layer")
    axes[0].set_title("gate = weight of the positional attention", fontsize=9)
    fig.colorbar(im, ax=axes[0], label="sigmoid(gating_param)")
    if positional_distance is not None:
        d = positional_distance.float().cpu().numpy()
        ax = axes[1]
        for h in range(H):
            ax.scatter(np.arange(L) + 1, d[:, h], s=20, label=f"head {h}" if H <= 12 else None)
        ax.set_xlabel("GPSA layer")
        ax.set_ylabel("distance of the positional branch (pixels)")
        ax.set_xticks(range(1, L + 1))
        ax.set_ylim(0, float(d.max()) * 1.15 + 1e-6)
        ax.grid(alpha=0.3)
        if H <= 12:
            ax.legend(fontsize=7, ncol=2)
        ax.set_title("positional attention alone: mean distance per head", fontsize=9)
    fig.suptitle(title)
    return fig


def plot_gpsa_positional(positional: torch.Tensor, grid_size: tuple[int, int], distances: torch.Tensor | None = None,
                         title: str = "ConViT positional attention of the centre patch") -> Figure:
    """Per GPSA layer (rows) and head (columns), the positional attention of the centre patch over the grid."""
    L, H = positional.shape[:2]
    gh, gw = grid_size
    q = (gh // 2) * gw + gw // 2  # the centre query patch
    maps = positional[:, :, q].float().cpu().reshape(L, H, gh, gw).numpy()
    fig = new_figure(1.3 * H + 1.6, 1.3 * L + 1.0)
    axes = fig.subplots(L, H, squeeze=False)
    vmax = float(maps.max())
    for layer in range(L):
        for h in range(H):
            ax = axes[layer, h]
            _panel(ax, maps[layer, h], cmap="viridis", vmax=vmax)
            ax.plot(gw // 2, gh // 2, marker="+", color="white", markersize=6)
            label = f"head {h}" + (f": {float(distances[layer, h]):.1f}px" if distances is not None else "")
            ax.set_title(label, fontsize=7)
        axes[layer, 0].set_ylabel(f"GPSA layer {layer + 1}", fontsize=8)
    fig.suptitle(f"{title}\n(+ marks the query patch; px = mean distance)", fontsize=10)
    fig.supxlabel("head (each panel: the patch grid)", fontsize=9)
    fig.colorbar(ScalarMappable(Normalize(0, vmax), "viridis"), ax=axes.ravel().tolist(), shrink=0.7,
                 label="positional attention (probability)")
    return fig


def plot_class_attention(maps: Sequence[AttentionMap], images: np.ndarray, indices: Sequence[int],
                         title: str = "CaiT class attention") -> Figure:
    """Per image and class-attention block (rows) and head (columns): the class token's attention to the patches."""
    ca = [m for m in maps if m.kind == "class_attn"]
    if not ca:
        raise VitlabError("plot_class_attention needs class-attention maps (CaiT's blocks_token_only)")
    H = ca[0].num_heads
    rows = [(i, m) for i in indices for m in ca]
    fig = new_figure(1.3 * (H + 1) + 1.6, 1.3 * len(rows) + 1.0)
    axes = fig.subplots(len(rows), H + 1, squeeze=False)
    for r, (i, m) in enumerate(rows):
        a = m.attn[i, :, 0].float().cpu()  # (heads, K)
        _show_image(axes[r, 0], images[i])
        axes[r, 0].set_ylabel(f"image {i}\n{m.name}", fontsize=7)
        for h in range(H):
            patches = a[h, m.num_prefix:].reshape(m.grid_size).cpu().numpy()
            _panel(axes[r, h + 1], _relative(patches))
            axes[r, h + 1].set_title(f"head {h} (self {float(a[h, 0]):.2f})", fontsize=7)
    fig.suptitle(f"{title}\n(the class token's attention to the patches; self = its weight on itself)", fontsize=10)
    fig.supxlabel("input, then head (each panel: the patch grid)", fontsize=9)
    fig.colorbar(ScalarMappable(Normalize(0, 1), "inferno"), ax=axes[:, 1:].ravel().tolist(), shrink=0.7,
                 label="attention / panel maximum")
    return fig


def _method_styles(keys: Sequence[str]) -> dict[str, dict]:
    """A colour per method, its distillation-token map dashed in the same colour, and the random order grey and
    dotted: past ten lines the default cycle would give two methods one colour."""
    floors = {"random": dict(color="gray", linestyle=":"), "edge": dict(color="gray", linestyle="-.")}
    parts = {k: split_key(k) for k in keys if k not in floors}
    methods = list(dict.fromkeys(method for method, _ in parts.values()))
    colours = {m: matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"](i) for i, m in enumerate(methods)}
    return {k: floors[k] if k in floors else
            dict(color=colours[parts[k][0]], linestyle="-" if parts[k][1] == "cls" else "--") for k in keys}


def plot_faithfulness(result: dict, title: str = "Faithfulness") -> Figure:
    """Mean deletion and insertion curves, the positive/negative perturbation accuracy and, where measured, ROAD's
    MoRF / LeRF accuracy of every method."""
    methods = result["methods"]
    proto = result["protocol"]
    road = "road" in proto and all("road_morf_accuracy" in m for m in methods.values())
    fig = new_figure(16.0 if road else 11.0, 7.6)
    axes = fig.subplots(2, 3 if road else 2, squeeze=False)
    xs = proto["deletion_insertion"]["x"]
    fr = proto["perturbation"]["fractions"]
    panels = [(axes[0, 0], "deletion_curve", xs, "deletion (lower area is better)", "deletion_auc"),
              (axes[0, 1], "insertion_curve", xs, "insertion (higher area is better)", "insertion_auc"),
              (axes[1, 0], "positive_accuracy", fr, "positive perturbation (lower is better)", "positive_auc"),
              (axes[1, 1], "negative_accuracy", fr, "negative perturbation (higher is better)", "negative_auc")]
    if road:
        panels += [(axes[0, 2], "road_morf_accuracy", proto["road"]["fractions"],
                    "ROAD, most relevant first (lower is better)", "road_morf_auc"),
                   (axes[1, 2], "road_lerf_accuracy", proto["road"]["fractions"],
                    "ROAD, least relevant first (higher is better)", "road_lerf_auc")]
    styles = _method_styles(list(methods))
    for ax, field, x, heading, auc in panels:
        for key, m in methods.items():
            ax.plot(x, m[field], marker=".", label=f"{m['label']} ({m[auc]:.3g})", **styles[key])
        ax.set_title(heading, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in axes[0, :2]:
        ax.set_xlabel("fraction of patches removed / inserted")
        ax.set_ylabel("probability of the predicted class")
    for ax in [*axes[1], *axes[0, 2:]]:
        ax.set_xlabel("fraction of patches removed")
        ax.set_ylabel(f"top-1 accuracy (%, {proto['perturbation']['accuracy_against']})")
    fig.suptitle(f"{title} ({proto['images']} images; AUC in the legend)")
    return fig


def plot_randomisation(result: dict, labels: dict[str, str] | None = None,
                       title: str = "Model-parameter randomisation test") -> Figure:
    """Mean rank correlation of each method's map with the trained model's as weights are randomised top down."""
    stages = result["stages"]
    fig = new_figure(max(6.4, 0.55 * len(stages) + 3.5), 4.6)
    ax = fig.add_subplot()
    x = np.arange(len(stages))
    for key, c in result["correlation"].items():
        flag = " [flagged: does not change]" if key in result["flagged"] else ""
        ax.plot(x, c, marker="o", label=(labels or {}).get(key, key) + flag)
    ax.axhline(result["threshold"], color="gray", linestyle="--", linewidth=1, label="flag threshold")
    ax.set_xticks(x, [f"+ {s}" for s in stages], rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("randomised so far (cumulative, from the top)")
    ax.set_ylabel("Spearman rank correlation with the trained model's map")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{title}\n({result['images']} images; a faithful map decorrelates)", fontsize=10)
    return fig


def plot_head_importance(importance: torch.Tensor, names: Sequence[str], distances: torch.Tensor | None = None,
                         distance_names: Sequence[str] = (), title: str = "Head importance") -> Figure:
    """Layers x heads: the target logit's drop when each head is zeroed, beside each head's mean attention distance."""
    L, H = importance.shape
    panels = 1 if distances is None else 2
    fig = new_figure(0.5 * H * panels + 5.0, 0.42 * L + 2.6)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    imp = importance.float().cpu().numpy()
    lim = float(np.nanmax(np.abs(imp))) or 1.0  # NaN: past a block's own heads, left blank
    im = axes[0].imshow(imp, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    if L * H <= 200:
        for r in range(L):
            for h in range(H):
                if not np.isnan(imp[r, h]):
                    axes[0].text(h, r, f"{imp[r, h]:.2f}", ha="center", va="center", fontsize=6)
    axes[0].set_xticks(range(H))
    axes[0].set_yticks(range(L), list(names), fontsize=7)
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("block")
    axes[0].set_title("drop of the target logit when the head is zeroed", fontsize=9)
    fig.colorbar(im, ax=axes[0], label="logit drop (positive: the head helps)")
    if distances is not None:
        d = np.full((L, H), np.nan)
        for row, name in zip(distances.float().cpu().numpy(), distance_names):
            if name in names:
                d[list(names).index(name), :len(row)] = row
        im2 = axes[1].imshow(d, cmap="viridis", aspect="auto")
        axes[1].set_xticks(range(H))
        axes[1].set_yticks(range(L), list(names), fontsize=7)
        axes[1].set_xlabel("head")
        axes[1].set_title("mean attention distance (pixels; blank: class attention)", fontsize=9)
        fig.colorbar(im2, ax=axes[1], label="pixels")
    fig.suptitle(title)
    return fig


def plot_patch_grid(images: np.ndarray, patch_size: tuple[int, int], captions: Sequence[str],
                    prefix_tokens: Sequence[str] = (), max_tokens: int = 64,
                    title: str = "The image cut into its patch grid") -> Figure:
    """Images (B, H, W, C) in [0, 1] with the patch grid drawn over them and each patch numbered in reading order
    (top row); below, the first image as the token sequence the encoder reads: the prefix tokens, then its
    patches (the first max_tokens)."""
    B, H, W = images.shape[:3]
    ph, pw = (int(p) for p in patch_size)
    gh, gw = H // ph, W // pw
    shown = min(gh * gw, max_tokens)
    tokens = list(prefix_tokens) + list(range(shown))
    per_row = min(len(tokens), 16)
    seq_rows = math.ceil(len(tokens) / per_row)
    fig = new_figure(max(2.4 * B, 0.62 * per_row) + 0.6, 2.7 + 0.62 * seq_rows + 0.6)
    top, bottom = fig.subfigures(2, 1, height_ratios=[2.7, 0.62 * seq_rows + 0.3])
    axes = top.subplots(1, B, squeeze=False)[0]
    step = max(1, math.ceil(max(gh, gw) / 8))  # at most about 8 tick labels per side
    for i, ax in enumerate(axes):
        _show_image(ax, images[i])
        for r in range(1, gh):
            ax.axhline(r * ph - 0.5, color="#00e5ff", lw=1)
        for c in range(1, gw):
            ax.axvline(c * pw - 0.5, color="#00e5ff", lw=1)
        if gh * gw <= 64:
            for k in range(gh * gw):
                r, c = divmod(k, gw)
                ax.text(c * pw + (pw - 1) / 2, r * ph + (ph - 1) / 2, str(k), ha="center", va="center",
                        fontsize=7 if gh * gw <= 16 else 5.5, color="yellow",
                        bbox=dict(boxstyle="round,pad=0.1", facecolor="black", alpha=0.45, linewidth=0))
        ax.set_xticks([c * pw - 0.5 for c in range(0, gw + 1, step)], [str(c * pw) for c in range(0, gw + 1, step)],
                      fontsize=7)
        ax.set_yticks([r * ph - 0.5 for r in range(0, gh + 1, step)], [str(r * ph) for r in range(0, gh + 1, step)],
                      fontsize=7)
        ax.set_xlabel("x (pixels)", fontsize=8)
        ax.set_title(captions[i], fontsize=8)
    axes[0].set_ylabel("y (pixels)", fontsize=8)
    top.suptitle(f"{gh}x{gw} patches of {ph}x{pw} pixels, numbered in reading order")
    seq = bottom.subplots(seq_rows, per_row, squeeze=False)
    for k, ax in enumerate(seq.ravel()):
        ax.set_xticks([])
        ax.set_yticks([])
        if k >= len(tokens):
            ax.axis("off")
            continue
        t = tokens[k]
        if isinstance(t, str):  # a learnt prefix token: no pixels
            ax.set_facecolor("#dddddd")
            ax.text(0.5, 0.5, f"[{t}]", ha="center", va="center", fontsize=7, transform=ax.transAxes)
            continue
        r, c = divmod(t, gw)
        _show_image(ax, images[0, r * ph:(r + 1) * ph, c * pw:(c + 1) * pw])
        ax.set_title(str(t), fontsize=6, pad=2)
    more = f" (the first {shown} of {gh * gw} patches)" if shown < gh * gw else ""
    bottom.suptitle(f"{captions[0]} as the encoder's token sequence{more}", fontsize=9)
    fig.suptitle(title)
    return fig


def _image_rows(columns: dict[str, np.ndarray], row_titles: Sequence[str], title: str,
                outline: np.ndarray | None = None, patch_size: tuple[int, int] = (1, 1)) -> Figure:
    """One row per image, one column per named (B, H, W, C) array; outline (B, h, w) bool marks patches in
    every column but the first."""
    names = list(columns)
    B = len(next(iter(columns.values())))
    fig = new_figure(1.9 * len(names) + 0.4, 1.9 * B + 0.5)
    axes = fig.subplots(B, len(names), squeeze=False)
    for i in range(B):
        for j, name in enumerate(names):
            ax = axes[i, j]
            _show_image(ax, columns[name][i])
            if i == 0:
                ax.set_title(name, fontsize=9)
            if j == 0:
                ax.set_ylabel(row_titles[i], fontsize=7)
            elif outline is not None:
                ph, pw = patch_size
                for r, c in zip(*np.nonzero(outline[i])):
                    ax.add_patch(Rectangle((c * pw - 0.5, r * ph - 0.5), pw, ph, fill=False, lw=0.6,
                                           edgecolor="#ff00ff"))
    fig.suptitle(title)
    return fig


def plot_mae_reconstructions(images: np.ndarray, masked: np.ndarray, reconstructed: np.ndarray, pasted: np.ndarray,
                             row_titles: Sequence[str], title: str = "MAE reconstructions") -> Figure:
    """Rows of (image, masked input, reconstruction, reconstruction with the visible patches pasted), each
    (B, H, W, C) in [0, 1]."""
    return _image_rows({"image": images, "masked input (encoder sees)": masked, "reconstruction": reconstructed,
                        "reconstruction + visible": pasted}, row_titles, title)


def plot_mpp_predictions(images: np.ndarray, corrupted: np.ndarray, true: np.ndarray, predicted: np.ndarray,
                         corrupted_mask: np.ndarray, patch_size: tuple[int, int], row_titles: Sequence[str],
                         title: str = "Masked patch prediction: mean colours") -> Figure:
    """Rows of (image, corrupted input, true 3-bit mean colours, predicted ones), each (B, H, W, C) in [0, 1]; the
    corrupted patches (B, h, w) are outlined."""
    return _image_rows({"image": images, "corrupted input": corrupted, "true mean colours": true,
                        "predicted (corrupted patches)": predicted}, row_titles, title, corrupted_mask, patch_size)
