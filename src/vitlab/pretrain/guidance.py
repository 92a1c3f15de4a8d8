"""How long pre-training needs before its encoder beats an untrained one, from vitlab's own measurements.

``MEASURED`` is the one table of figures: a pre-training run's weighted 20-NN top-1 on the labelled test split beside
that of an untrained encoder of the same architecture (docs/pretraining.md, where each comes from, with its
commands). ``guidance`` turns it into the line a pre-training run starts with: after how many epochs over the data
the measured encoders first beat an untrained one, and how many images that is for the run's data size.
"""
from __future__ import annotations

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
XEON = "a 2-core Intel Xeon with AMX, one thread per run, float32"
# (minutes, 20-NN top-1 %, the untrained encoder's) on the AMX Xeon, 10% of CIFAR-10's labels (docs/pretraining.md)
DINO_KNN = ((1.5, 24.64, 27.31), (3, 24.66, 27.31), (6, 25.77, 27.31), (9, 26.11, 27.31), (15, 26.26, 27.25),
            (30, 27.80, 27.25), (60, 29.04, 27.25))
IBOT_KNN = ((1.5, 26.76, 27.25), (4.5, 25.56, 27.25), (15, 27.55, 27.25))
DISTILL_KNN = ((1.5, 30.17, 27.25), (4.5, 39.30, 27.25), (15, 42.70, 27.25))
MEASURED: tuple[KnnPoint, ...] = (
    # docs/pretraining.md (`vitlab study pretrain`, vit_nano_patch4_32): the curve at 1.5, 4.5 and 15 minutes, at 3
    # and 9 minutes and the 118.5-minute point, CIFAR-10's 50,000 training images; 20-NN on every label. The rates are
    # the runs' own where the docs give them (MAE 444 img/s at 15 minutes, 422 in the 3-and-9-minute study, 400 on the
    # 2-hour box; MPP 183 and 172), the nearest measured one elsewhere.
    KnnPoint("mae", "CIFAR-10", 50_000, "vit_nano_patch4_32", 1.5, 444, 24.81, 29.45),
    KnnPoint("mae", "CIFAR-10", 50_000, "vit_nano_patch4_32", 3, 422, 28.49, 29.45),
    KnnPoint("mae", "CIFAR-10", 50_000, "vit_nano_patch4_32", 4.5, 444, 32.35, 29.45),
    KnnPoint("mae", "CIFAR-10", 50_000, "vit_nano_patch4_32", 9, 422, 33.00, 29.45),
    KnnPoint("mae", "CIFAR-10", 50_000, "vit_nano_patch4_32", 15, 444, 36.68, 29.45),
    KnnPoint("mae", "CIFAR-10", 50_000, "vit_nano_patch4_32", 118.5, 400, 47.21, 29.45),
    KnnPoint("mpp", "CIFAR-10", 50_000, "vit_nano_patch4_32", 1.5, 183, 28.09, 29.45),
    KnnPoint("mpp", "CIFAR-10", 50_000, "vit_nano_patch4_32", 3, 183, 34.28, 29.45),
    KnnPoint("mpp", "CIFAR-10", 50_000, "vit_nano_patch4_32", 4.5, 183, 35.96, 29.45),
    KnnPoint("mpp", "CIFAR-10", 50_000, "vit_nano_patch4_32", 15, 183, 29.86, 29.45),
    KnnPoint("mpp", "CIFAR-10", 50_000, "vit_nano_patch4_32", 118.5, 172, 32.22, 29.45),
    # DINO, iBOT and distillation on the AMX Xeon in calibrated minutes: the rate is the method's calibrated images a
    # minute over 60, so minutes x rate is the images the run saw. Distillation's teacher: the same ViT trained with
    # labels on five of CIFAR-10's ten classes (its figures depend on the teacher as much as on the minutes).
    *(KnnPoint("dino", "CIFAR-10", 50_000, "vit_nano_patch4_32", m, 1770 / 60, k, u, XEON) for m, k, u in DINO_KNN),
    *(KnnPoint("ibot", "CIFAR-10", 50_000, "vit_nano_patch4_32", m, 1151 / 60, k, u, XEON) for m, k, u in IBOT_KNN),
    *(KnnPoint("distill", "CIFAR-10", 50_000, "vit_nano_patch4_32 from a teacher trained on five of its classes", m,
               4175 / 60, k, u, XEON) for m, k, u in DISTILL_KNN),
)


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
