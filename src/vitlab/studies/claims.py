"""The papers' claims, each a family of arms (training runs that differ in one factor) and the measured answer.

A new study is one ``Study`` entry in ``STUDIES``: its claim and source, its arms (recipe values that
differ from the base recipe), and a function that reads the aggregated rows and says whether the claim
held. ``vitlab study NAME`` trains it (runner.py) and writes its table and figure (report.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from ..errors import NotFoundError, VitlabError

# Every arm starts from the 30-minute CIFAR recipe's optimiser and augmentation, read from that recipe, and trains
# with the speed runs' progressive resizing (24x24 inputs for the first half, then 32x32) under a budget that counts
# training only; no compile (its warm-up would eat a short budget) or TTA, one evaluation at the end.
BASE_RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "cifar10_hybrid_30min.yaml"
BASE_KEYS = ("batch_size", "lr", "min_lr", "warmup", "weight_decay", "drop_path", "clip_grad", "crop", "padding",
             "hflip", "auto_augment", "random_erasing", "mixup", "cutmix", "label_smoothing", "progressive_until",
             "precision")
BASE_OVERRIDES: dict[str, Any] = {"eval_every": 10_000, "progressive_scale": 0.75, "budget_counts": "training"}
# A pre-training arm shares the optimiser's values (one lr for every arm, above MAE's rule of 1.5e-4 per 256
# images, which suits thousands of epochs); its augmentation and the rest are pre-training's defaults.
PRETRAIN_BASE_KEYS = ("batch_size", "lr", "min_lr", "warmup", "weight_decay", "clip_grad", "precision", "eval_every",
                      "budget_counts")
# A teacher trains with its own recipe's values but these, which the study sets (its inputs keep their size).
OWN_RECIPE_SKIP = ("data", "epochs", "time_budget", "eval_every", "tta", "tta_translate", "compile", "out")
OWN_RECIPE_OVERRIDES: dict[str, Any] = {"eval_every": 10_000, "budget_counts": "training"}
# --quick: a smoke run at 16x16. The arms keep the base recipe's crop ('pad', or the teacher's own recipe's), which
# the digits' defaults (no crop) do not override, so the padding below is live: shifts of up to 1 pixel on 16x16
# images, a quarter of a 4-pixel patch (the base's 4 would move whole patches at this size). Pre-training arms crop
# with rrc, where it does nothing.
QUICK: dict[str, Any] = dict(data="digits", img_size=16, epochs=1, time_budget=None, batch_size=32, padding=1,
                             hflip=False, precision="fp32")
QUICK_SHARE = 0.2  # --quick trains every arm on a fifth of its training images (data-scale: 2% to 20%)
SEEDS = (0, 1, 2)  # three seeds per arm by default: the spread a verdict reads a difference against
AGREES, DISAGREES, NOT_SEPARATED = "agrees", "disagrees", "not separated"
INCOMPLETE = "incomplete"  # an arm the answer reads has not been trained (a study run with --arm)


def recipe_values(path: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A recipe file's values (only ``keys`` when given)."""
    if not path.is_file():
        raise NotFoundError(f"the studies start from {path.name}, which is not at {path}: run them from a "
                            "vitlab source checkout (git clone), where recipes/ holds it")
    recipe = yaml.safe_load(path.read_text()) or {}
    return {k: recipe[k] for k in keys} if keys is not None else recipe


def base_values(path: Path = BASE_RECIPE) -> dict[str, Any]:
    """The recipe values every arm shares: the 30-minute recipe's BASE_KEYS, then BASE_OVERRIDES."""
    return {**recipe_values(path, BASE_KEYS), **BASE_OVERRIDES}


VIT, CONVIT, DEIT_DISTILLED, HYBRID = ("vit_nano_patch4_32", "convit_nano_patch4_32",
                                       "deit_nano_distilled_patch4_32", "vit_nano_r18_32")
HYBRID_BIT = "vit_nano_r5_s4_32"  # the paper's kind: a BiT ResNetV2 stem and bottleneck block
HYBRID_CNN, HYBRID_BIT_ARM = "CNN tokens (hybrid)", "BiT ResNetV2 tokens (the paper's hybrid)"
RESNET = {"model": "resnet10_32", "model_args": {"widths": [32, 64, 128, 256]}}
AIRBENCH_RECIPE = "cifar10_airbench.yaml"  # the distillation's teacher: airbench's CNN with its own recipe
FRACTIONS = (0.1, 0.25, 0.5, 1.0)
# The distillation's students train at full size, the size their teacher was trained at, as DeiT's students do (the
# teacher sees the very crops a student sees, Beyer et al. 2022, at that size under progressive resizing too).
FULL_SIZE: dict[str, Any] = {"progressive_scale": 1.0}
TEACHER = "teacher"  # the value of ``teacher`` that stands for the study's teacher arm
PRETRAINED = "pretrained:"  # ``init: pretrained:mae:3`` stands for the study's MAE pre-training run of 3 budgets


@dataclass
class Arm:
    label: str  # what the table calls it
    values: dict[str, Any]  # recipe values that differ from the base values
    group: str = ""  # one line of a line figure (data-scale, locality, pretrain)
    teacher: bool = False  # the teacher of the distillation arms: trained first, not a result
    pretraining: bool = False  # a self-supervised run other arms start from: trained first, judged by its probe
    scale: float = 1.0  # its budget (minutes or epochs) in units of the study's per-run budget
    time_share: float = 1.0  # a time budget's further factor (a share of the data trains as many epochs)
    recipe: str | None = None  # a recipe file in recipes/ whose values replace the base values (a teacher's own)
    x: float | None = None  # its place on the line figure's x axis, in budgets (pretrain); None: training images
    panel: str = ""  # the line figure's panel (pretrain: the share of the labels)
    step_args: dict[str, float] = field(default_factory=dict)  # pretrain_args set to these shares of its steps


@dataclass
class Study:
    name: str
    claim: str  # the paper's claim, in a sentence
    source: str  # where the paper makes it
    arms: list[Arm]
    answer: Callable[[list[dict[str, Any]]], tuple[str, str]]  # (verdict, the measured answer) from the rows
    x: str | None = None  # line figure: the x axis' name; None: bars
    heads: bool = False  # distilled students: report the class and distillation heads too
    probe: tuple[float, ...] = ()  # linear probes of each pre-training arm (and a random encoder): label shares
    notes: list[str] = field(default_factory=list)
    paper: str = ""  # the paper's own numbers for the claim
    minutes: float = 10.0  # the default per-run budget: the study fits 90 minutes with --jobs 2 and three seeds
    gap: tuple[str, str] | None = None  # line figure: also draw group a minus group b against the x axis


def _row(rows, label):
    return next(r for r in rows if r["label"] == label)


def _points(rows, label):
    return _row(rows, label)["top1_mean"]


def _gap_text(a: float, b: float) -> str:
    return f"{100 * (a - b):+.1f} points"


def contrast(rows, weights: dict[str, float]) -> tuple[float, float | None]:
    """A weighted sum of arms' mean top-1 (a - b: {a: 1, b: -1}) and its spread: sqrt(sum w^2 std^2), the
    standard deviation over seeds of one seed's value of the sum (None when an arm has fewer than two seeds)."""
    value = sum(w * _points(rows, label) for label, w in weights.items())
    stds = [_row(rows, label)["top1_std"] for label in weights]
    spread = None if any(s is None for s in stds) else sum((w * s) ** 2 for w, s in zip(weights.values(), stds)) ** 0.5
    return value, spread


def separated(value: float, spread: float | None) -> int:
    """+1 or -1: the sign of a difference that is at least twice its spread; 0: not separated (or one seed)."""
    if spread is None or abs(value) < 2 * spread:
        return 0
    return 1 if value > 0 else -1


def _text(value: float, spread: float | None) -> str:
    """'+3.1 +/- 0.8 points (separated)'."""
    how = "one seed" if spread is None else ("separated" if separated(value, spread) else "not separated")
    return f"{100 * value:+.1f}" + ("" if spread is None else f" +/- {100 * spread:.1f}") + f" points ({how})"


def _versus(rows, a: str, b: str) -> tuple[int, str]:
    """(+1/0/-1, 'a vs b: +x.x +/- s points (separated)')."""
    value, spread = contrast(rows, {a: 1.0, b: -1.0})
    return separated(value, spread), f"{a} vs {b}: {_text(value, spread)}"


def verdict(for_claim: list[int], against: list[int]) -> str:
    """agrees: every part of the claim separated the paper's way; disagrees: a part separated the other way;
    not separated otherwise. ``for_claim``: signs that should be +1; ``against``: signs that should be 0."""
    if any(s < 0 for s in for_claim) or any(s != 0 for s in against):
        return DISAGREES
    return AGREES if all(s > 0 for s in for_claim) else NOT_SEPARATED


def _answer_pos_embed(rows) -> tuple[str, str]:
    (s1, t1), (s2, t2) = _versus(rows, "learned 1D", "none"), _versus(rows, "fixed 2D sin-cos", "none")
    s3, t3 = _versus(rows, "learned 1D", "fixed 2D sin-cos")
    return verdict([s1, s2], [s3]), f"{t1}; {t2}; {t3}."


def _by_group(rows) -> dict[str, dict[int, str]]:
    """group -> training images -> the arm's label."""
    out: dict[str, dict[int, str]] = {}
    for r in rows:
        out.setdefault(r["group"], {})[r["train_images"]] = r["label"]
    return out


def _trend(rows, a: str, b: str) -> tuple[int, int, str]:
    """Group a minus group b on the smallest and the whole set: (sign on the smallest, sign of the change from the
    smallest to the whole set, text)."""
    g = _by_group(rows)
    sizes = sorted(g[a])
    small, large = sizes[0], sizes[-1]
    gaps = {n: contrast(rows, {g[a][n]: 1.0, g[b][n]: -1.0}) for n in sizes}
    change = contrast(rows, {g[a][small]: 1.0, g[b][small]: -1.0, g[a][large]: -1.0, g[b][large]: 1.0})
    text = (f"{a} minus {b} by training images: " + ", ".join(f"{n:,}: {_text(*gaps[n])}" for n in sizes)
            + f"; the smallest set's gap minus the whole set's: {_text(*change)}.")
    return separated(*gaps[small]), separated(*change), text


def _answer_data_scale(rows) -> tuple[str, str]:
    lead, narrows, text = _trend(rows, "ResNet", "ViT")
    return verdict([lead, narrows], []), text


def _answer_hybrid(rows) -> tuple[str, str]:
    """Agrees when a hybrid (either kind) is separated above patch tokens; disagrees when both are below."""
    (s1, t1), (s2, t2) = _versus(rows, HYBRID_CNN, "patch tokens"), _versus(rows, HYBRID_BIT_ARM, "patch tokens")
    return verdict([max(s1, s2)], []), f"{t1}; {t2}."


def _answer_distill(rows) -> tuple[str, str]:
    alone, soft, hard = "no teacher", "soft", "hard"
    (s1, t1), (s2, t2), (s3, t3) = _versus(rows, soft, alone), _versus(rows, hard, soft), _versus(rows, hard, alone)
    _, t4 = _versus(rows, hard, HARD_CLASS_TOKEN)
    p = {k: _points(rows, k) for k in (alone, soft, hard)}
    order = " > ".join(sorted(p, key=p.get, reverse=True))
    return verdict([s1, s2, s3], []), f"{t1}; {t2}; {t3}; {t4}. Order of the means: {order}."


def _answer_locality(rows) -> tuple[str, str]:
    helps, shrinks, text = _trend(rows, "ConViT", "DeiT")
    return verdict([helps, shrinks], []), text


PRETRAIN_FRACTIONS = (0.1, 1.0)
# Every pre-training method the study can train: its name in the table, and the recipe values its arm sets besides
# ``pretrain`` (DINO, and iBOT, DINO plus a masked-patch loss, at DINO's lr of 5e-4: the study's 1.5e-3, 12 times
# DINO's rule at this batch, is MAE's here; its teacher's momentum reaches 1 and its temperature warm-up ends at
# these shares of the run's steps, DINO's own schedule shape, which its step defaults fit only to runs of thousands
# of steps).
PRETRAIN_METHODS = {"mpp": "MPP", "mae": "MAE", "dino": "DINO", "ibot": "iBOT"}
_DINO_STEPS = {"momentum_steps": 1.0, "teacher_temp_steps": 0.3}
PRETRAIN_VALUES: dict[str, dict[str, Any]] = {"dino": {"lr": 5e-4}, "ibot": {"lr": 5e-4}}
PRETRAIN_STEP_ARGS: dict[str, dict[str, float]] = {"dino": _DINO_STEPS, "ibot": _DINO_STEPS}
DEFAULT_METHODS = ("mae", "dino")  # the study's own two (fits 90 minutes); --methods chooses others
PRETRAIN_SCALES = (1, 3)  # pre-training budgets, in fine-tuning budgets: the curve's points besides 0
# A pre-trained encoder is fine-tuned with MAE's layer-wise lr decay (the head at the full lr, each block below at
# 0.75 times the one above): with one lr on every layer the short fine-tune washes out what pre-training learned.
FINETUNE_LAYER_DECAY = 0.75
SCRATCH = "no pre-training"
SCRATCH_EQUAL = "no pre-training, same total time"
RANDOM_ENCODER = "random encoder"
HARD_CLASS_TOKEN = "hard, class token only"


def _labels(fraction: float) -> str:
    return f"{100 * fraction:g}% labels"


def probe_label(encoder: str, fraction: float) -> str:
    """The table's name of a linear probe of an encoder ('MAE 3x', 'random encoder') on a share of the labels."""
    return f"linear probe: {encoder}, {_labels(fraction)}"


def pretrain_label(name: str, scale: float) -> str:
    """A pre-training arm's label: 'MAE pre-training, 3x'."""
    return f"{name} pre-training, {scale:g}x"


def encoder_name(label: str) -> str:
    """A pre-training arm's encoder as the probes name it: 'MAE pre-training, 3x' -> 'MAE 3x'."""
    return label.replace(" pre-training,", "").removesuffix(" pre-training")


def _finetune_label(name: str, scale: float, fraction: float) -> str:
    return f"{name} {scale:g}x, {_labels(fraction)}"


def _scratch_label(scale: float, fraction: float) -> str:
    return f"{SCRATCH}, {scale:g}x, {_labels(fraction)}"


def _pretrain_arms(scales: tuple[float, ...] = PRETRAIN_SCALES,
                   methods: tuple[str, ...] = DEFAULT_METHODS) -> list[Arm]:
    names = {m: PRETRAIN_METHODS[m] for m in methods}
    arms = [Arm(pretrain_label(name, p), {"model": VIT, "pretrain": method, **PRETRAIN_VALUES.get(method, {})},
                pretraining=True, scale=p, step_args=PRETRAIN_STEP_ARGS.get(method, {}))
            for method, name in names.items() for p in scales]
    for f in PRETRAIN_FRACTIONS:
        share = {"train_fraction": f} if f < 1 else {}
        arms.append(Arm(_scratch_label(1, f), {"model": VIT, **share}, group=SCRATCH, x=0, panel=_labels(f)))
        for p in scales:
            arms += [Arm(_finetune_label(name, p, f), {"model": VIT, "init": f"{PRETRAINED}{m}:{p:g}",
                                                       "layer_decay": FINETUNE_LAYER_DECAY, **share},
                         group=name, x=p, panel=_labels(f)) for m, name in names.items()]
            arms.append(Arm(_scratch_label(1 + p, f), {"model": VIT, **share}, group=SCRATCH_EQUAL, scale=1 + p,
                            x=p, panel=_labels(f)))
    return arms


def _answer_pretrain(rows, scales: tuple[float, ...] = PRETRAIN_SCALES,
                     methods: tuple[str, ...] = DEFAULT_METHODS) -> tuple[str, str]:
    """Each method against scratch for the same total time at the longest pre-training, on both label shares: the
    claim holds for a method when both are separated ahead; the study agrees when it holds for one method, disagrees
    when every method is separated behind on a share."""
    p, parts, verdicts = max(scales), [], []
    for m in methods:
        name, signs = PRETRAIN_METHODS[m], []
        for f in PRETRAIN_FRACTIONS:
            sign, text = _versus(rows, _finetune_label(name, p, f), _scratch_label(1 + p, f))
            parts.append(text)
            signs.append(sign)
        verdicts.append(verdict(signs, []))
    best = next((v for v in (AGREES, NOT_SEPARATED) if v in verdicts), DISAGREES)
    probes = [(r["encoder"], r["top1_mean"], r.get("knn")) for r in rows if r["group"] == "linear probe"
              and r["label"].endswith(_labels(1.0))]
    return (best,
            "At the longest pre-training, against training from scratch for the same total time: " + "; ".join(parts)
            + ". Frozen features, every label (linear probe / k-NN): "
            + ", ".join(f"{e} {100 * t:.1f}% / " + (f"{100 * k:.1f}%" if k is not None else "-") for e, t, k in probes)
            + ".")


def _scale_arms(models: dict[str, dict[str, Any]]) -> list[Arm]:
    """One arm per model and share of the training images; a share trains for that share of the time budget, so
    every share sees about as many epochs (100%: the same run as the other studies')."""
    return [Arm(f"{name} {100 * f:g}%", {**values, **({"train_fraction": f} if f < 1 else {})}, group=name,
                time_share=f) for name, values in models.items() for f in FRACTIONS]


STUDIES: dict[str, Study] = {s.name: s for s in [
    Study("pos-embed", "No position embedding is clearly worse; learned 1D and 2D embeddings hardly differ.",
          "ViT, appendix D.4 (Table 8)",
          [Arm("learned 1D", {"model": VIT}),
           Arm("none", {"model": VIT, "model_args": {"pos_embed": "none"}}),
           Arm("fixed 2D sin-cos", {"model": VIT, "model_args": {"pos_embed": "sincos"}})],
          _answer_pos_embed, minutes=16,
          paper="ViT-B/16, ImageNet 5-shot linear: none 61.4%, learned 1D 64.2%, 2D 64.0%, relative 64.0%"),
    Study("data-scale", "ViTs need more data than CNNs: on small sets the CNN wins, the ViT catches up with data.",
          "ViT, Figures 3 and 4",
          _scale_arms({"ViT": {"model": VIT}, "ResNet": RESNET, "ConViT": {"model": CONVIT}}),
          _answer_data_scale, x="training images", minutes=8.5, gap=("ResNet", "ViT"),
          paper="ImageNet (1.3M) pre-training: BiT ResNets ahead of ViT-L/16; JFT subsets (Fig. 4, 5-shot): "
                "ResNet152x2 ahead of ViT-B/32 on 9M images, the ViT ahead from 90M"),
    Study("hybrid", "At equal compute a hybrid (CNN feature maps as tokens) beats patch tokens for small models.",
          "ViT, Figure 5",
          [Arm("patch tokens", {"model": VIT}), Arm(HYBRID_CNN, {"model": HYBRID}),
           Arm(HYBRID_BIT_ARM, {"model": HYBRID_BIT})],
          _answer_hybrid, minutes=16,
          paper="hybrids above ViTs of equal pre-training compute at the small end (Fig. 5, transfer averaged over "
                "5 data sets); the gap vanishes for the largest models"),
    Study("distill", "Distilling from a CNN through a distillation token beats training alone; hard beats soft.",
          "DeiT, Table 3",
          [Arm("teacher (airbench CNN)", {"model": "airbench_32"}, teacher=True, scale=2, recipe=AIRBENCH_RECIPE),
           Arm("no teacher", {"model": DEIT_DISTILLED, **FULL_SIZE}),
           Arm("soft", {"model": DEIT_DISTILLED, "teacher": TEACHER, "distill": "soft", "tau": 3.0, "alpha": 0.5,
                        **FULL_SIZE}),
           Arm("hard", {"model": DEIT_DISTILLED, "teacher": TEACHER, "distill": "hard", "alpha": 0.5, **FULL_SIZE}),
           Arm(HARD_CLASS_TOKEN, {"model": VIT, "teacher": TEACHER, "distill": "hard", "alpha": 0.5, **FULL_SIZE})],
          _answer_distill, heads=True, minutes=10,
          paper="DeiT-B, ImageNet top-1 (RegNetY-16GF teacher, 82.9%): no distillation 81.8%, soft 81.8%, hard "
                "83.0%, hard through the distillation token (class + distillation heads) 83.4%",
          notes=["The teacher is airbench's CNN with its own recipe (SGD, lookahead), trained first for twice a "
                 "student's budget; a distilled student also runs the teacher on every batch inside its budget, "
                 "so it sees fewer images. The students train at full size, without progressive resizing: the "
                 "size the teacher was trained at, as DeiT's students do. 'hard, "
                 "class token only' is the same-size ViT without a distillation token, its class head learning "
                 "from both the labels and the teacher (DeiT's 'hard distillation' row)."]),
    Study("locality", "GPSA's convolutional prior helps most when data is scarce; the gain shrinks with data.",
          "ConViT, Figures 1 and 6",
          _scale_arms({"DeiT": {"model": VIT}, "ConViT": {"model": CONVIT}}),
          _answer_locality, x="training images", minutes=8.5, gap=("ConViT", "DeiT"),
          paper="DeiT-S / ConViT-S on ImageNet shares (Table 4): 5% 34.8 / 47.8%, 10% 48.0 / 59.6%, 30% 66.1 / "
                "73.7%, 50% 74.6 / 78.2%, 100% 79.9 / 81.4%"),
    Study("pretrain", "Self-supervised pre-training on the training images (MAE, DINO; the ViT paper's masked patch "
          "prediction) then fine-tuning beats training from scratch, most when labels are few.",
          "ViT, section 4.6 and appendix B.1.2; MAE (He et al. 2022); DINO (Caron et al. 2021)",
          _pretrain_arms(), _answer_pretrain, probe=PRETRAIN_FRACTIONS, x="pre-training budget", minutes=1.5,
          paper="ViT-B/16 on ImageNet: masked patch prediction 79.9%, 2 points above training from scratch; MAE on "
                "CIFAR-10 (small ViTs, 400-2,000 epochs): 74-78% from scratch to 89-90%",
          notes=["Each pre-training run (MAE and DINO; --methods chooses among MPP, MAE, DINO and iBOT) uses the whole "
                 "training split without its labels, for 1x or 3x the fine-tuning budget (--pretrain-budgets sets "
                 "others), trained as the steps its own method takes in those minutes (each method's rate is "
                 "measured once, as the study's); each pre-trained arm is fine-tuned for 1x, "
                 "and compared with training from scratch for the same total time (its pre-training budget plus "
                 "1x) and for 1x. Fine-tuning starts from the pre-trained encoder with a new head and the recipe "
                 f"of training from scratch plus MAE's layer-wise lr decay of {FINETUNE_LAYER_DECAY:g}. A linear "
                 "probe is a "
                 "logistic regression (L-BFGS) on the frozen encoder's features of the labelled share of the "
                 "training split, scored on the test split; the random encoder is the same architecture untrained "
                 "(seed 0)."]),
]}


def pretrain_study(scales: tuple[float, ...] = PRETRAIN_SCALES, methods: tuple[str, ...] = DEFAULT_METHODS) -> Study:
    """The pretrain study with pre-training runs of ``scales`` fine-tuning budgets (the curve's points besides 0)
    instead of 1x and 3x, by ``methods`` (PRETRAIN_METHODS' keys) instead of MAE and DINO; each point adds its
    fine-tunes and its scratch run of the same total time."""
    if not scales or any(not isinstance(p, (int, float)) or not p > 0 for p in scales):
        raise VitlabError(f"pretrain budgets {list(scales)!r} are not valid; accepted: numbers > 0 (fine-tuning "
                          "budgets of pre-training), e.g. 1,3,10")
    wrong = [m for m in methods if m not in PRETRAIN_METHODS]
    if not methods or wrong:
        raise VitlabError(f"pretrain methods {list(methods)!r} are not valid; accepted: one or more of "
                          f"{', '.join(PRETRAIN_METHODS)}, e.g. dino,mae")
    scales, methods = tuple(sorted(set(scales))), tuple(dict.fromkeys(methods))
    return replace(STUDIES["pretrain"], arms=_pretrain_arms(scales, methods),
                   answer=partial(_answer_pretrain, scales=scales, methods=methods))
