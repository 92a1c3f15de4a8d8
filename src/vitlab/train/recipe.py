"""One typed training recipe: defaults, then a YAML file, then command-line options."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

PRECISIONS = ("auto", "bf16", "fp32")
DISTILL_TYPES = ("none", "hard", "soft")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Recipe:
    # what to train
    model: str | None = None              # registered name; default per data set (trainer.default_model)
    init: str | None = None               # start from anything vitlab.load reads (fine-tuning)
    freeze_backbone: bool = False         # train only the head(s): a linear probe
    model_args: dict[str, Any] = field(default_factory=dict)  # overrides, e.g. {depth: 6}
    img_size: int | None = None           # input size (model and data); default: the model's
    drop_path: float = 0.1                # stochastic depth rate of the last block
    # data
    data: str = "digits"
    download: bool = False
    val_fraction: float = 0.2             # held-out share when the data has no test split
    cache_dir: str | None = None
    # schedule
    epochs: int = 30
    time_budget: float | None = None      # minutes; lays the schedule out over wall-clock time
    batch_size: int = 128                 # global batch (split across torchrun processes)
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup: float = 0.05                  # share of the schedule spent warming up
    weight_decay: float = 0.05
    clip_grad: float | None = 1.0
    ema_decay: float = 0.0                # 0 = no EMA of the weights
    early_stop: int = 0                   # stop after this many evaluations without improvement (0 = off)
    plateau_patience: int = 0             # reduce the lr after this many evaluations without improvement (0 = off)
    plateau_factor: float = 0.5
    eval_every: int = 1                   # epochs between evaluations
    progressive_scale: float = 1.0        # progressive resizing: start at this share of the input size (1 = off)
    progressive_until: float = 0.5        # ... and grow to the full size by this share of the schedule
    tta: bool = False                     # evaluate on each test image and its mirror image (mean logits)
    # augmentation (see vitlab.data.augment.AugmentConfig)
    crop: str = "pad"
    padding: int = 4
    hflip: bool = True
    auto_augment: str = "trivial"
    ra_num_ops: int = 2
    ra_magnitude: int = 9
    random_erasing: float = 0.25
    mixup: float = 0.8
    cutmix: float = 1.0
    mix_prob: float = 1.0
    label_smoothing: float = 0.1
    repeated_aug: int = 1
    # distillation
    teacher: str | None = None
    distill: str = "none"                 # none | hard | soft
    tau: float = 1.0
    alpha: float = 0.5
    # execution
    precision: str = "auto"
    compile: bool = False
    device: str = "auto"
    threads: int | None = None
    seed: int = 0
    out: str | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first bad value and what is accepted."""
        def bad(name, accepted):
            raise ValueError(f"{name}={getattr(self, name)!r} is not valid; accepted: {accepted}")
        if self.precision not in PRECISIONS:
            bad("precision", ", ".join(PRECISIONS))
        if self.distill not in DISTILL_TYPES:
            bad("distill", ", ".join(DISTILL_TYPES))
        if self.device not in DEVICES:
            bad("device", ", ".join(DEVICES))
        if self.epochs < 1:
            bad("epochs", "an integer >= 1")
        if self.time_budget is not None and self.time_budget <= 0:
            bad("time_budget", "minutes > 0")
        if self.batch_size < 1:
            bad("batch_size", "an integer >= 1")
        if not self.lr > 0:
            bad("lr", "a number > 0")
        if self.min_lr < 0 or self.min_lr > self.lr:
            bad("min_lr", f"a number in [0, lr={self.lr}]")
        if not 0 <= self.warmup < 1:
            bad("warmup", "a share of the schedule in [0, 1)")
        if self.weight_decay < 0:
            bad("weight_decay", "a number >= 0")
        if not 0 <= self.drop_path < 1:
            bad("drop_path", "a rate in [0, 1)")
        if not 0 <= self.ema_decay < 1:
            bad("ema_decay", "0 (off) or a decay in (0, 1), e.g. 0.999")
        if not 0 < self.val_fraction < 1:
            bad("val_fraction", "a share in (0, 1)")
        if not 0 < self.plateau_factor < 1:
            bad("plateau_factor", "a factor in (0, 1)")
        if self.eval_every < 1:
            bad("eval_every", "an integer >= 1")
        if not 0 < self.progressive_scale <= 1:
            bad("progressive_scale", "a share of the input size in (0, 1]; 1 = off")
        if not 0 < self.progressive_until <= 1:
            bad("progressive_until", "a share of the schedule in (0, 1]")
        if self.tau <= 0:
            bad("tau", "a temperature > 0")
        if not 0 <= self.alpha <= 1:
            bad("alpha", "a weight in [0, 1]")
        if self.distill != "none" and not self.teacher:
            raise ValueError(f"distill={self.distill!r} needs a teacher: --teacher MODEL_FOLDER")
        if self.teacher and self.distill == "none":
            self.distill = "hard"
        if self.img_size is not None and self.img_size < 1:
            bad("img_size", "a positive integer")
        if not isinstance(self.model_args, dict):
            bad("model_args", "a mapping of model argument names to values")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in fields(Recipe)}

# Defaults that suit a data set better than the general ones; options given explicitly win.
# Digits are small, centred and not mirror-symmetric: no flips, light cropping, no mixing.
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"epochs": 150, "batch_size": 32, "lr": 5e-3, "warmup": 0.05, "weight_decay": 0.05,
               "drop_path": 0.0, "crop": "pad", "padding": 1, "hflip": False, "auto_augment": "none",
               "random_erasing": 0.0, "mixup": 0.0, "cutmix": 0.0, "label_smoothing": 0.1},
}


def load_recipe(path: str | Path | None = None, **overrides: Any) -> Recipe:
    """A Recipe from a YAML file (optional) updated by overrides; unknown keys are an error."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"recipe {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"recipe {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"recipe {p} must be a mapping of option: value")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown recipe option(s) {', '.join(unknown)}; accepted: {', '.join(FIELDS)}")
    if not values.get("init"):
        for key, value in DATA_DEFAULTS.get(str(values.get("data", Recipe.data)), {}).items():
            values.setdefault(key, value)
    recipe = Recipe(**values)
    recipe.validate()
    return recipe
