"""What a report's sections read and add to: an ``Inspection`` of one model on a few images (each shared result
computed once, on first use), and the ``Section`` each figure becomes. report.py runs the sections on it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..finite import check_finite
from ..progress import progress_bar
from . import plots
from .capture import capture_attention, prefix_token_names
from .distance import distance_layer_names, mean_attention_distance
from .explain import explain, explanation_methods, method_key
from .faithfulness import faithfulness, normalisation

IMPORTANCE_IMAGES = 32  # head importance zeroes every head in turn: a pass per head over this sample


@dataclass
class Section:
    """One figure of the report: its PNG file name (next to report.html), heading and caption."""

    file: str
    title: str
    caption: str


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
    importance_images: int = IMPORTANCE_IMAGES
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
        self.mean, self.std = normalisation(self.model, self.images.shape[1])
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
        maps = {}
        with progress_bar(total=len(self.pairs), desc="explanations", unit="method") as bar:
            for m, t in self.pairs:
                maps[method_key(m, t)] = explain(self.model, self.images, m, pred, token=t,
                                                 head_fusion=self.head_fusion, discard_ratio=self.discard_ratio)
                bar.update()
        return maps

    @cached_property
    def faith(self) -> dict:
        """faithfulness() over the faithfulness set (default: the shown images), with the shown images' curves."""
        kw = dict(methods=self.pairs, batch_size=self.batch_size, curve_steps=self.curve_steps,
                  head_fusion=self.head_fusion, discard_ratio=self.discard_ratio)
        B = len(self.images)
        if self.faithfulness_images is None:  # the shown images: their maps are drawn already
            labels = None if self.labels is None else torch.as_tensor(list(self.labels))
            return faithfulness(self.model, self.images, labels, keep_images=B, progress=True, maps=self.explanations,
                                **kw)
        labels = None if self.faithfulness_labels is None else torch.as_tensor(list(self.faithfulness_labels))
        faith = faithfulness(self.model, self.faithfulness_images.to(self.device), labels, keep_images=0,
                             progress=True, **kw)
        faith["images"] = faithfulness(self.model, self.images, keep_images=B, progress=True, maps=self.explanations,
                                       **kw)["images"]
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
        return mean_attention_distance(self.model, self.distance_set, batch_size=self.batch_size, progress=True)
