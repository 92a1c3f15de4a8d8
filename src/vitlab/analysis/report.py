"""One report for one model: every applicable analysis as a PNG, and report.html that explains them."""
from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..atomic import atomic_write_bytes
from ..finite import check_finite
from ..progress import progress_bar
from . import plots
from .capture import attention_modules, capture_attention, prefix_token_names
from .distance import distance_layer_names, mean_attention_distance
from .explain import explain, explanation_methods, method_key
from .faithfulness import faithfulness
from .interactive import EXPLORER_CSS
from .sections import ATTENTION_FREE_SECTIONS, ATTENTION_ONLY, SECTIONS


@dataclass
class Section:
    """One figure of the report: its PNG file name (next to report.html), heading and caption."""

    file: str
    title: str
    caption: str


def model_family(model: nn.Module) -> str:
    """A readable family name: ViT, DeiT (distilled), ConViT, CaiT, hybrid ViT, ResNet."""
    return getattr(model, "family", None) or type(model).__name__


def model_header(model: nn.Module, class_names: Sequence[str] | None) -> list[tuple[str, str]]:
    """(label, value) rows describing the model for the report's header."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    size = cfg.get("input_size")
    params = sum(p.numel() for p in model.parameters())
    modules = [] if getattr(model, "no_attention", "") else attention_modules(model)
    counts: dict[str, int] = {}
    for _, kind, _ in modules:
        counts[kind] = counts.get(kind, 0) + 1
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none"
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


def _figure_src(out_dir: Path, file: str) -> str:
    """A figure next to report.html as a data: URL, so that the report is one self-contained file."""
    return "data:image/png;base64," + base64.b64encode((Path(out_dir) / file).read_bytes()).decode("ascii")


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
    atomic_write_bytes(path, page.encode("utf-8"))
    return path


@dataclass
class Inspection:
    """What the report's sections read and add to: the model, the shown images (normalised, on the model's device)
    and the options; the figures, notes, tables, summary and explorer they produce. What several sections need is
    computed once, on first use."""

    model: nn.Module
    images: torch.Tensor
    out: Path
    image_names: Sequence[str] | None = None
    labels: Sequence[int] | None = None
    class_names: Sequence[str] | None = None
    distance_images: torch.Tensor | None = None
    faithfulness_images: torch.Tensor | None = None
    faithfulness_labels: Sequence[int] | None = None
    head_fusion: str = "mean"
    discard_ratio: float = 0.9
    batch_size: int = 64
    max_head_figures: int = 4
    curve_steps: int = 16
    sanity_images: int = 4
    importance_images: int = 64
    explorer_images: int = 4
    objective: nn.Module | None = None  # a pre-training run's objective (encoder + decoder): its own section
    sections: list[Section] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tables: list[tuple[str, str]] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    explorer: str = ""
    names: list[str] = field(init=False)  # image_names, or "image i"
    mean: Sequence[float] = field(init=False)  # the model's normalisation
    std: Sequence[float] = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        cfg = getattr(self.model, "pretrained_cfg", None) or {}
        C = self.images.shape[1]
        self.mean, self.std = cfg.get("mean", (0.5,) * C), cfg.get("std", (0.5,) * C)
        self.class_names = list(self.class_names or cfg.get("label_names") or []) or None
        self.device = next(self.model.parameters()).device
        self.images = self.images.to(self.device)
        self.names = list(self.image_names or [f"image {i}" for i in range(len(self.images))])
        self.out = Path(self.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def figure(self, fig, file: str, title: str, caption: str) -> None:
        """Save a Figure next to report.html and show it there under title, with caption."""
        plots.save_figure(fig, self.out / file)
        self.sections.append(Section(file, title, caption))

    def note(self, text: str) -> None:
        """A line for the report's notes (e.g. why a section was skipped)."""
        self.notes.append(text)

    @cached_property
    def display(self) -> np.ndarray:
        """The shown images as (B, H, W, C) in [0, 1]."""
        return plots.display_images(self.images, self.mean, self.std)

    @cached_property
    def prefix(self) -> list[str]:
        return prefix_token_names(self.model)

    @cached_property
    def _first_pass(self) -> tuple[torch.Tensor, list]:
        """The shown images' logits and attention maps, from one forward pass."""
        if getattr(self.model, "no_attention", ""):  # nothing to capture
            with torch.no_grad():
                logits, maps = self.model.eval()(self.images), []
        else:
            with torch.no_grad(), capture_attention(self.model) as maps:
                logits = self.model(self.images)  # (B, classes)
        check_finite(logits, len(logits), "outputs", "the model")
        return logits, maps

    @property
    def maps(self) -> list:
        return self._first_pass[1]

    @cached_property
    def no_classifier(self) -> str:
        """Why the model's outputs are not class scores ('' when they are)."""
        if self.objective is not None:
            return "the model is a pre-training run's encoder, whose classifier head is untrained"
        if getattr(self.model, "num_classes", 1) == 0:
            return "the model has no classifier head"
        return ""

    @cached_property
    def predictions(self) -> list[dict]:
        """Per shown image: its index, name, true label (or None) and top-5 (class name, probability); no top-5
        where the model has no trained classifier."""
        top = self._first_pass[0].float().softmax(dim=-1)
        if self.no_classifier:
            top = top[:, :0]
        top = top.topk(min(5, top.shape[-1]), dim=-1)
        names = self.class_names
        label_of = lambda c: names[c] if names and c < len(names) else f"class {c}"  # noqa: E731
        return [{"index": i, "name": self.names[i],
                 "label": label_of(int(self.labels[i])) if self.labels is not None else None,
                 "top": [(label_of(int(c)), float(p)) for p, c in zip(top.values[i], top.indices[i])]}
                for i in range(len(self.images))]

    @cached_property
    def pairs(self) -> list[tuple[str, str]]:
        """The (method, token) pairs of the registry that apply to the model."""
        return explanation_methods(self.model)

    @cached_property
    def explanations(self) -> dict[str, torch.Tensor]:
        """Method key -> the shown images' maps (B, grid_h, grid_w), for the predicted class."""
        pred = self._first_pass[0].argmax(dim=-1)
        return {method_key(m, t): explain(self.model, self.images, m, pred, token=t, head_fusion=self.head_fusion,
                                          discard_ratio=self.discard_ratio) for m, t in self.pairs}

    @cached_property
    def faith(self) -> dict:
        """faithfulness() over the faithfulness set (default: the shown images), with the shown images' curves."""
        kw = dict(methods=self.pairs, batch_size=self.batch_size, curve_steps=self.curve_steps,
                  head_fusion=self.head_fusion, discard_ratio=self.discard_ratio)
        B = len(self.images)
        if self.faithfulness_images is None:
            labels = None if self.labels is None else torch.as_tensor(list(self.labels))
            return faithfulness(self.model, self.images, labels, keep_images=B, **kw)
        labels = None if self.faithfulness_labels is None else torch.as_tensor(list(self.faithfulness_labels))
        faith = faithfulness(self.model, self.faithfulness_images.to(self.device), labels, keep_images=0, **kw)
        faith["images"] = faithfulness(self.model, self.images, keep_images=B, progress=False, **kw)["images"]
        return faith

    @cached_property
    def faith_per_image(self) -> dict[str, list[dict]]:
        """Method key -> the shown images' deletion and insertion scores and curves."""
        return {k: [img["methods"][k] for img in self.faith["images"]] for k in self.explanations}

    @cached_property
    def distance_set(self) -> torch.Tensor:
        """The images mean attention distance and head importance average over."""
        return self.images if self.distance_images is None else self.distance_images.to(self.device)

    @cached_property
    def distance_layers(self) -> list[tuple[str, str]]:
        return distance_layer_names(self.model)

    @cached_property
    def distances(self) -> torch.Tensor:
        """(layers, heads) mean attention distance in pixels over distance_set."""
        return mean_attention_distance(self.model, self.distance_set, batch_size=self.batch_size)


def inspect_model(model: nn.Module, images: torch.Tensor, out_dir: str | Path, *,
                  image_names: Sequence[str] | None = None, labels: Sequence[int] | None = None,
                  class_names: Sequence[str] | None = None, distance_images: torch.Tensor | None = None,
                  head_fusion: str = "mean", discard_ratio: float = 0.9, batch_size: int = 64,
                  max_head_figures: int = 4, title: str | None = None,
                  faithfulness_images: torch.Tensor | None = None, faithfulness_labels: Sequence[int] | None = None,
                  curve_steps: int = 16, sanity_images: int = 4, importance_images: int = 64,
                  explorer_images: int = 4, objective: nn.Module | None = None) -> Path:
    """Run every applicable analysis on normalised images (B, C, H, W); write the PNGs, faithfulness.json,
    analysis.json and report.html (self-contained, with the interactive explorer) to out_dir.

    distance_images (default: images) are the set the mean attention distance and head importance
    are averaged over; faithfulness_images (default: images) with their labels (default: the
    shown labels, else the model's own prediction) the set the faithfulness scores are measured on.
    objective: a pre-training run's objective around ``model`` (vitlab.pretrain.load_objective), whose section
    draws what it learnt; the sections that read class scores are then skipped.
    Returns the path of report.html. A model without attention (ResNet) raises ValueError; a token model that says
    why it has none (MLP-Mixer's ``no_attention``) gets the sections that need no attention, and a note.
    The report is SECTIONS in order (see sections.py).
    """
    no_attention = getattr(model, "no_attention", "")
    if not no_attention:
        attention_modules(model)  # fails early, and clearly, for a CNN
    r = Inspection(model, images, Path(out_dir), image_names=image_names, labels=labels, class_names=class_names,
                   distance_images=distance_images, faithfulness_images=faithfulness_images,
                   faithfulness_labels=faithfulness_labels, head_fusion=head_fusion, discard_ratio=discard_ratio,
                   batch_size=batch_size, max_head_figures=max_head_figures, curve_steps=curve_steps,
                   sanity_images=sanity_images, importance_images=importance_images, explorer_images=explorer_images,
                   objective=objective)
    if no_attention:
        r.note(f"{ATTENTION_ONLY}: skipped, {no_attention}.")
    r.maps  # the first forward pass, before any figure: outputs that are not numbers are refused here  # noqa: B018
    sections = ATTENTION_FREE_SECTIONS if no_attention else SECTIONS
    with progress_bar(total=len(sections), desc="inspect", unit="section") as bar:  # with its ETA
        for section in sections:
            bar.set_postfix_str(section.__name__, refresh=False)
            section(r)
            bar.update()
    r.summary["predictions"] = r.predictions
    atomic_write_bytes(r.out / "analysis.json", (json.dumps(r.summary, indent=1) + "\n").encode("utf-8"))
    title = title or f"vitlab inspect: {getattr(model, 'arch', None) or type(model).__name__}"
    return write_report(r.out, title, model_header(model, r.class_names), r.predictions, r.sections, r.notes,
                        r.tables, r.explorer)
