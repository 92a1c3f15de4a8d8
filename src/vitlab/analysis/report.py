"""One report for one model: every applicable analysis as a PNG, and report.html that explains them."""
from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_write_bytes
from ..progress import progress_bar
from .capture import attention_modules, prefix_token_names
from .inspection import IMPORTANCE_IMAGES, Inspection, Section
from .interactive import EXPLORER_CSS
from .sections import ATTENTION_FREE_SECTIONS, ATTENTION_ONLY, SECTIONS


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


def inspect_model(model: nn.Module, images: torch.Tensor, out_dir: str | Path, *,
                  image_names: Sequence[str] | None = None, labels: Sequence[int] | None = None,
                  class_names: Sequence[str] | None = None, distance_images: torch.Tensor | None = None,
                  head_fusion: str = "mean", discard_ratio: float = 0.9, batch_size: int = 64,
                  max_head_figures: int = 4, title: str | None = None,
                  faithfulness_images: torch.Tensor | None = None, faithfulness_labels: Sequence[int] | None = None,
                  curve_steps: int = 16, sanity_images: int = 4, importance_images: int = IMPORTANCE_IMAGES,
                  explorer_images: int = 4, objective: nn.Module | None = None) -> Path:
    """Run every applicable analysis on normalised images (B, C, H, W); write the PNGs, faithfulness.json,
    analysis.json and report.html (self-contained, with the interactive explorer) to out_dir.

    distance_images (default: images) are the set the mean attention distance and head importance
    are averaged over; faithfulness_images (default: images) with their labels (default: the
    shown labels, else the model's own prediction) the set the faithfulness scores are measured on.
    objective: a pre-training run's objective around ``model`` (vitlab.objectives.load_objective), whose section
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
