"""How long pre-training needs before its encoder beats an untrained one, from vitlab's own measurements.

``MEASURED`` is the one table of figures, read from knn_measured.json beside this module (which
benchmarks/pretrain_curve.py writes): a pre-training run's weighted 20-NN top-1 on the labelled test split beside
that of an untrained encoder of the same architecture (docs/pretraining.md, where each comes from, with its
commands). ``guidance`` turns it into the line a pre-training run starts with: after how many epochs over the data
the measured encoders first beat an untrained one, and how many images that is for the run's data size.
"""
from __future__ import annotations

import json
from importlib import resources
from typing import NamedTuple


class KnnPoint(NamedTuple):
    """One measured pre-training run, judged by its weighted 20-NN top-1 (%) against an untrained encoder's."""

    method: str
    data: str
    images: int        # unlabelled images pre-trained on
    model: str
    minutes: float     # of pre-training
    rate: float        # images a second it pre-trained at
    knn: float         # top-1 (%) of the pre-trained encoder's features
    untrained: float   # top-1 (%) of the untrained encoder's
    cpu: str = "a 2-core AMD EPYC (Zen 4, AVX-512), one thread per run, float32"  # where it was measured

    @property
    def epochs(self) -> float:
        """Epochs over its images: the images it saw (minutes x rate) over their number."""
        return self.minutes * 60 * self.rate / self.images


NAMES = {"mae": "MAE", "mpp": "MPP", "dino": "DINO", "ibot": "iBOT", "distill": "distillation"}
MEASURED_FILE = "knn_measured.json"  # beside this module; benchmarks/pretrain_curve.py --guidance writes it


def measured() -> tuple[KnnPoint, ...]:
    """The measured runs, from ``MEASURED_FILE`` (docs/pretraining.md says where each comes from)."""
    text = resources.files(__package__).joinpath(MEASURED_FILE).read_text(encoding="utf-8")
    return tuple(KnnPoint(**point) for point in json.loads(text)["points"])


MEASURED: tuple[KnnPoint, ...] = measured()


def first_ahead(points: list[KnnPoint]) -> tuple[KnnPoint | None, KnnPoint | None]:
    """(the longest run still at or below the untrained encoder before any beat it, the first run that beat it)."""
    behind = ahead = None
    for p in sorted(points, key=lambda p: p.epochs):
        if p.knn > p.untrained:
            return behind, p
        behind = p
    return behind, ahead


def guidance(method: str, images: int, planned_images: int | None = None) -> str:
    """The line a pre-training run of ``method`` on ``images`` unlabelled images starts with: when the measured
    encoders first beat an untrained one, in epochs and in images seen for this data size."""
    points = [p for p in MEASURED if p.method == method]
    said = NAMES.get(method, method)
    if not points:
        points, said = [p for p in MEASURED if p.method == "mae"], f"{said} is not measured yet; MAE"
    behind, ahead = first_ahead(points)
    if ahead is None:
        return (f"guidance: {said}'s encoder has not beaten an untrained one's k-NN in any run measured (the longest: "
                f"{behind.minutes:g} min, {behind.epochs:.1f} epochs of {behind.images:,} {behind.data} images on "
                f"{behind.cpu})")
    text = (f"guidance: {said}'s encoder first beat an untrained one's k-NN after {ahead.epochs:.1f} epochs of "
            f"{ahead.images:,} {ahead.data} images ({ahead.minutes:g} min of {ahead.model} on {ahead.cpu}: "
            f"{ahead.knn:.2f}% against {ahead.untrained:.2f}%)")
    if behind is not None:
        text += f" and was below it after {behind.epochs:.1f} ({behind.minutes:g} min: {behind.knn:.2f}%)"
    need = round(ahead.epochs * images)
    text += f"; on these {images:,} images that is about {need:,} images seen"
    if planned_images is not None:
        text += f" (this run plans {planned_images:,}{': likely too few' if planned_images < need else ''})"
    return text + "; the run ends with its encoder's k-NN against an untrained one's where the data has labels"
