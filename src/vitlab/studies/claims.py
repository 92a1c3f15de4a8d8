"""The papers' claims, each a family of arms (training runs that differ in one factor) and the measured answer.

A new study is one ``Study`` entry in ``STUDIES``: its claim and source, its arms (recipe values that
differ from the base recipe), and a function that reads the aggregated rows and says whether the claim
held. ``vitlab study NAME`` trains it (runner.py) and writes its table and figure (report.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Every arm starts from the 30-minute CIFAR recipe's optimiser and augmentation, read from that recipe; no
# compile (its warm-up would eat a short budget), no progressive resizing or TTA, one evaluation at the end.
BASE_RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "cifar10_hybrid_30min.yaml"
BASE_KEYS = ("batch_size", "lr", "min_lr", "warmup", "weight_decay", "drop_path", "clip_grad", "crop", "padding",
             "hflip", "auto_augment", "random_erasing", "mixup", "cutmix", "label_smoothing", "precision")
BASE_OVERRIDES: dict[str, Any] = {"eval_every": 10_000}
# A pre-training arm shares the optimiser's values (one lr for every arm, above MAE's rule of 1.5e-4 per 256
# images, which suits thousands of epochs); its augmentation and the rest are pre-training's defaults.
PRETRAIN_BASE_KEYS = ("batch_size", "lr", "min_lr", "warmup", "weight_decay", "clip_grad", "precision", "eval_every")
QUICK: dict[str, Any] = dict(data="digits", img_size=16, epochs=1, time_budget=None, batch_size=32, padding=1,
                             hflip=False, precision="fp32")
QUICK_SHARE = 0.2  # --quick trains every arm on a fifth of its training images (data-scale: 1% to 20%)


def base_values(path: Path = BASE_RECIPE) -> dict[str, Any]:
    """The recipe values every arm shares: the 30-minute recipe's BASE_KEYS, then BASE_OVERRIDES."""
    if not path.is_file():
        raise FileNotFoundError(f"the studies start from {path.name}, which is not at {path}: run them from a "
                                "vitlab source checkout (git clone), where recipes/ holds it")
    recipe = yaml.safe_load(path.read_text()) or {}
    return {**{k: recipe[k] for k in BASE_KEYS}, **BASE_OVERRIDES}


VIT, CONVIT, DEIT_DISTILLED, HYBRID = ("vit_nano_patch4_32", "convit_nano_patch4_32",
                                       "deit_nano_distilled_patch4_32", "vit_nano_r18_32")
HYBRID_BIT = "vit_nano_r5_s4_32"  # the paper's kind: a BiT ResNetV2 stem and bottleneck block
RESNET = {"model": "resnet10_32", "model_args": {"widths": [32, 64, 128, 256]}}
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
TEACHER = "teacher"  # the value of ``teacher`` that stands for the study's teacher arm
PRETRAINED = "pretrained:"  # ``init: pretrained:mae`` stands for the study's MAE pre-training run


@dataclass
class Arm:
    label: str  # what the table calls it
    values: dict[str, Any]  # recipe values that differ from the base values
    group: str = ""  # one line of a line figure (data-scale, locality)
    teacher: bool = False  # the teacher of the distillation arms: trained first, not a result
    pretraining: bool = False  # a self-supervised run other arms start from: trained first, judged by its probe


@dataclass
class Study:
    name: str
    claim: str  # the paper's claim, in a sentence
    source: str  # where the paper makes it
    arms: list[Arm]
    answer: Callable[[list[dict[str, Any]]], str]  # the measured answer, from the aggregated rows
    x: str | None = None  # line figure: the x axis (training images); None: bars
    heads: bool = False  # distilled students: report the class and distillation heads too
    probe: tuple[float, ...] = ()  # linear probes of each pre-training arm (and a random encoder): label shares
    notes: list[str] = field(default_factory=list)


def _row(rows, label):
    return next(r for r in rows if r["label"] == label)


def _points(rows, label):
    return _row(rows, label)["top1_mean"]


def _gap_text(a: float, b: float) -> str:
    return f"{100 * (a - b):+.1f} points"


def _clear(rows, a: str, b: str) -> bool:
    """Is the gap between two arms' means larger than either arm's spread over seeds?"""
    ra, rb = _row(rows, a), _row(rows, b)
    spread = max(ra["top1_spread"] or 0.0, rb["top1_spread"] or 0.0)
    return abs(ra["top1_mean"] - rb["top1_mean"]) > spread


def _versus(rows, a: str, b: str) -> str:
    """'a vs b: +x.x points (clear|within the seeds' spread)'."""
    gap = _gap_text(_points(rows, a), _points(rows, b))
    seeds = len(_row(rows, a)["top1"])
    how = "" if seeds < 2 else (", clear of the seeds' spread" if _clear(rows, a, b) else
                                ", within the seeds' spread")
    return f"{a} vs {b}: {gap}{how}"


def _answer_pos_embed(rows) -> str:
    none, learn, sincos = "none", "learned 1D", "fixed 2D sin-cos"
    worst = _points(rows, none) < min(_points(rows, learn), _points(rows, sincos))
    clearly = worst and _clear(rows, none, learn) and _clear(rows, none, sincos)
    alike = not _clear(rows, learn, sincos)
    return (f"{_versus(rows, none, learn)}; {_versus(rows, none, sincos)}; {_versus(rows, learn, sincos)}. "
            + ("No position embedding is clearly the worst, as the paper says" if clearly else
               "No position embedding is not clearly worse than both embeddings here")
            + ("; 1D and 2D hardly differ, as the paper says." if alike else
               "; 1D and 2D do differ here, unlike the paper's long schedules."))


def _by_group(rows) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        out.setdefault(r["group"], {})[r["train_images"]] = r["top1_mean"]
    return out


NOISE = 0.02  # a change of up to 2 points between single-seed runs is not read as a trend


def _answer_data_scale(rows) -> str:
    g = _by_group(rows)
    sizes = sorted(g["ViT"])
    parts = []
    for n in sizes:
        best = max(g, key=lambda k: g[k][n])
        parts.append(f"{n:,} images: {best} best (ViT {100 * g['ViT'][n]:.1f}%, ResNet {100 * g['ResNet'][n]:.1f}%, "
                     f"ConViT {100 * g['ConViT'][n]:.1f}%)")
    gaps = [g["ResNet"][n] - g["ViT"][n] for n in sizes]
    trend = gaps[0] - gaps[-1]
    return ("; ".join(parts) + f". The ResNet's lead over the ViT is {_gap_text(gaps[0], 0)} on the smallest set and "
            f"{_gap_text(gaps[-1], 0)} on the whole set: "
            + ("it narrows with data, as in the paper's curves (a ViT overtaking a CNN needs far more data than "
               "CIFAR-10)." if trend > NOISE else
               "it grows with data, unlike the paper's curves." if trend < -NOISE else
               f"it does not change by more than {100 * NOISE:.0f} points with data at this budget."))


def _answer_hybrid(rows) -> str:
    patch, cnn, bit = "patch tokens", "CNN tokens (hybrid)", "BiT ResNetV2 tokens (the paper's hybrid)"
    best = max((cnn, bit), key=lambda arm: _points(rows, arm))
    better = _points(rows, best) > _points(rows, patch)
    return (f"{_versus(rows, cnn, patch)}; {_versus(rows, bit, patch)}. "
            + ("Agrees: a hybrid is better for this small model" if better and _clear(rows, best, patch) else
               "A hybrid is ahead, but not clearly" if better else "Does not agree: no hybrid is better here")
            + ".")


def _answer_distill(rows) -> str:
    alone, soft, hard = "no teacher", "soft", "hard"
    p = {k: _points(rows, k) for k in (alone, soft, hard)}
    order = " > ".join(sorted(p, key=p.get, reverse=True))
    agrees = p[hard] > p[soft] > p[alone]
    return (f"{_versus(rows, soft, alone)}; {_versus(rows, hard, alone)}; {_versus(rows, hard, soft)}. "
            f"Order: {order}. " + ("The same order as DeiT Table 3." if agrees else
                                   "Not the order of DeiT Table 3 (hard > soft > no teacher)."))


def _answer_locality(rows) -> str:
    g = _by_group(rows)
    sizes = sorted(g["DeiT"])
    gains = {n: g["ConViT"][n] - g["DeiT"][n] for n in sizes}
    text = ", ".join(f"{n:,}: {_gap_text(gains[n], 0)}" for n in sizes)
    small, large = gains[sizes[0]], gains[sizes[-1]]
    agrees = small > NOISE and small - large > NOISE
    return (f"ConViT minus DeiT by training images: {text}. "
            + ("Agrees: the locality prior helps most when data is scarce." if agrees else
               f"Not clear at this budget: the gain on the smallest set ({_gap_text(small, 0)}) is not more than "
               f"{100 * NOISE:.0f} points above both zero and the gain on the whole set ({_gap_text(large, 0)})."))


PRETRAIN_FRACTIONS = (0.1, 1.0)
PRETRAIN_METHODS = {"mpp": "MPP", "mae": "MAE"}
SCRATCH = "no pre-training"
RANDOM_ENCODER = "random encoder"


def _labels(fraction: float) -> str:
    return f"{100 * fraction:g}% labels"


def probe_label(encoder: str, fraction: float) -> str:
    """The table's name of a linear probe of an encoder ('MAE', 'random encoder') on a share of the labels."""
    return f"linear probe: {encoder}, {_labels(fraction)}"


def _pretrain_arms() -> list[Arm]:
    arms = [Arm(f"{name} pre-training", {"model": VIT, "pretrain": method}, pretraining=True)
            for method, name in PRETRAIN_METHODS.items()]
    for name, init in [(SCRATCH, None), *((n, f"{PRETRAINED}{m}") for m, n in PRETRAIN_METHODS.items())]:
        for f in PRETRAIN_FRACTIONS:
            values = {"model": VIT, **({"init": init} if init else {}), **({"train_fraction": f} if f < 1 else {})}
            arms.append(Arm(f"{name}, {_labels(f)}", values, group=name))
    return arms


def _answer_pretrain(rows) -> str:
    parts, gains = [], {}
    for f in PRETRAIN_FRACTIONS:
        scratch = f"{SCRATCH}, {_labels(f)}"
        for name in PRETRAIN_METHODS.values():
            gains[name, f] = _points(rows, f"{name}, {_labels(f)}") - _points(rows, scratch)
            parts.append(_versus(rows, f"{name}, {_labels(f)}", scratch))
    probes = {n: _points(rows, probe_label(n, 1.0)) for n in (*PRETRAIN_METHODS.values(), RANDOM_ENCODER)}
    mae_small, mae_all = gains["MAE", PRETRAIN_FRACTIONS[0]], gains["MAE", 1.0]
    return ("; ".join(parts) + ". "
            + ("MAE pre-training helps, and more with fewer labels, as in the published small-data figures"
               if mae_small > NOISE and mae_small >= mae_all else
               "MAE pre-training helps" if mae_small > NOISE or mae_all > NOISE else
               f"MAE pre-training does not gain more than {100 * NOISE:.0f} points at this budget")
            + ". Linear probes on all labels: " + ", ".join(f"{n} {100 * v:.1f}%" for n, v in probes.items())
            + (": the pre-trained features beat random ones." if min(probes["MAE"], probes["MPP"]) >
               probes[RANDOM_ENCODER] + NOISE else ": pre-training did not make clearly better features than "
               "a random encoder at this budget."))


def _scale_arms(models: dict[str, dict[str, Any]]) -> list[Arm]:
    return [Arm(f"{name} {100 * f:g}%", {**values, **({"train_fraction": f} if f < 1 else {})}, group=name)
            for name, values in models.items() for f in FRACTIONS]  # 100%: the same run as the other studies'



STUDIES: dict[str, Study] = {s.name: s for s in [
    Study("pos-embed", "No position embedding is clearly worse; learned 1D and 2D embeddings hardly differ.",
          "ViT, appendix D.4 (Table 8)",
          [Arm("learned 1D", {"model": VIT}),
           Arm("none", {"model": VIT, "model_args": {"pos_embed": "none"}}),
           Arm("fixed 2D sin-cos", {"model": VIT, "model_args": {"pos_embed": "sincos"}})],
          _answer_pos_embed),
    Study("data-scale", "ViTs need more data than CNNs: on small sets the CNN wins, the ViT catches up with data.",
          "ViT, Figures 3 and 4",
          _scale_arms({"ViT": {"model": VIT}, "ResNet": RESNET, "ConViT": {"model": CONVIT}}),
          _answer_data_scale, x="train_images"),
    Study("hybrid", "At equal compute a hybrid (CNN feature maps as tokens) beats patch tokens for small models.",
          "ViT, Figure 5",
          [Arm("patch tokens", {"model": VIT}), Arm("CNN tokens (hybrid)", {"model": HYBRID}),
           Arm("BiT ResNetV2 tokens (the paper's hybrid)", {"model": HYBRID_BIT})],
          _answer_hybrid),
    Study("distill", "Distilling from a CNN through a distillation token beats training alone; hard beats soft.",
          "DeiT, Table 3",
          [Arm("teacher (ResNet)", RESNET, teacher=True),
           Arm("no teacher", {"model": DEIT_DISTILLED}),
           Arm("soft", {"model": DEIT_DISTILLED, "teacher": TEACHER, "distill": "soft", "tau": 3.0, "alpha": 0.5}),
           Arm("hard", {"model": DEIT_DISTILLED, "teacher": TEACHER, "distill": "hard", "alpha": 0.5})],
          _answer_distill, heads=True,
          notes=["The teacher is trained first, under the same budget as each student; a distilled student also runs "
                 "the teacher on every batch inside its budget, so it sees fewer images."]),
    Study("locality", "GPSA's convolutional prior helps most when data is scarce; the gain shrinks with data.",
          "ConViT, Figures 1 and 6",
          _scale_arms({"DeiT": {"model": VIT}, "ConViT": {"model": CONVIT}}),
          _answer_locality, x="train_images"),
    Study("pretrain", "Self-supervised pre-training on the training images (MAE; the ViT paper's masked patch "
          "prediction) then fine-tuning beats training from scratch, most when labels are few.",
          "ViT, section 4.6 and appendix B.1.2; MAE (He et al. 2022)",
          _pretrain_arms(), _answer_pretrain, probe=PRETRAIN_FRACTIONS,
          notes=["Each pre-training run uses the whole training split without its labels, under the same budget as "
                 "each fine-tuning run; a pre-trained arm has therefore had twice the compute of its scratch arm, "
                 "as in the papers. Fine-tuning starts from the pre-trained encoder with a new head and the same "
                 "recipe as training from scratch. A linear probe is a logistic regression (L-BFGS) on the "
                 "frozen encoder's features of the labelled share of the training split, scored on the test split; "
                 "the random encoder is the same architecture untrained (seed 0)."]),
]}
