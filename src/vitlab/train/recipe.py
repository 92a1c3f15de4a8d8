"""One typed training recipe: defaults, then a YAML file, then command-line options.

Every option is declared once, here (the augmentation options once, in ``AugmentConfig``); the
``vitlab train`` command line is generated from these declarations. Values are coerced to the
declared types (YAML reads ``1e-3`` as text; it becomes the float 0.001) and every value is checked
before any data is read, so a bad value is one line naming the option and what it accepts.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from ..data.augment import AugmentConfig
from ..devices import BF16_CPU_MIN_MACS, Device, Precision
from ..errors import NotFoundError, VitlabError
from ..objectives.objective import check_options
from ..settings import UNSET, Settings

# The choices of the recipe's options (the precision and the device: devices.py, which every command shares).
DistillType = Literal["none", "hard", "soft", "self"]
Log = Literal["none", "tensorboard"]
HeadInit = Literal["auto", "zero", "trunc_normal", "keep"]
Pretrain = Literal["none", "mae", "mpp", "dino", "ibot", "distill"]
Optimizer = Literal["adamw", "sgd"]
Shard = Literal["none", "fsdp"]
AUGMENT_FIELDS = dict(AugmentConfig.model_fields)


class Recipe(Settings):
    """Everything that decides a training run."""

    # what to train
    model: str | None = Field(None, description="registered model name (see `vitlab models`)")
    init: str | None = Field(None, description="fine-tune from anything vitlab.load reads (run, timm or HF folder)")
    freeze_backbone: bool = Field(False, description="train only the head(s): a linear probe")
    layer_decay: float = Field(1.0, gt=0, le=1, description="layer-wise lr decay: the head learns at lr, the last "
                               "block at lr x decay, the embeddings at lr x decay^(depth + 1) (1 = off; BEiT, MAE "
                               "and DeiT III fine-tune at 0.65-0.75)")
    head_init: HeadInit = Field("auto", description="--init's head: auto keeps a head that predicts the data's "
                                "classes and starts any other at zero (timm); zero and trunc_normal (std 2e-5, MAE) "
                                "always start a new one; keep refuses a checkpoint of other classes")
    freeze_blocks: int = Field(0, ge=0, description="with --init: freeze the embeddings and the first N blocks "
                               "(0 = off)")
    lora: int = Field(0, ge=0, description="LoRA rank: train low-rank adapters (Hugging Face peft) on the "
                      "lora_targets layers and the head, the rest frozen; the adapter is merged at the end (0 = off)")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA scale numerator (the update is alpha / rank x BA); "
                                     "default: the rank")
    lora_targets: str = Field("qkv,proj,fc1,fc2", description="comma-separated Linear layer names LoRA adapts (timm's: "
                              "qkv, proj, fc1, fc2)")
    grad_checkpointing: bool = Field(False, description="recompute each block's activations in the backward pass "
                                     "instead of keeping them (timm's set_grad_checkpointing): less memory, more time")
    model_args: dict[str, Any] = Field(default_factory=dict, description="model argument overrides, e.g. {depth: 6}")
    pretrain: Pretrain = Field("none", description="self-supervised pre-training, labels unused: mae (masked "
                               "autoencoder), mpp (the ViT paper's masked patch prediction), dino (self-distillation, "
                               "multi-crop), ibot (dino + masked patch tokens), distill (features of a frozen "
                               "--teacher); none: supervised")
    pretrain_args: dict[str, Any] = Field(default_factory=dict, description="pre-training objective options, e.g. "
                                          "{mask_ratio: 0.75, decoder_depth: 2}")
    img_size: int | None = Field(None, ge=1, description="input size (model and data); default: the model's")
    drop_path: float = Field(0.1, ge=0, lt=1, description="stochastic depth rate of the last block")
    # data
    data: str = Field("digits", description="digits (embedded), cifar10, cifar100, an image folder or a .tar.gz; "
                      "WebDataset shards (streamed): DIR/train-{000000..000099}.tar or wds:DIR")
    test_data: str | None = Field(None, description="the test shards of a shard --data, e.g. "
                                  "DIR/test-{000000..000003}.tar")
    download: bool = Field(False, description="download CIFAR if missing (checksums verified)")
    val_fraction: float = Field(0.2, ge=0, lt=1, description="held-out share when the data has no test split (0, "
                                "pre-training only: none held out, the loss evaluated on the training images)")
    train_fraction: float = Field(1.0, gt=0, le=1, description="train on this share of the training split, the "
                                  "same share of every class (nested: 5% lies inside 10%; the test split is whole)")
    cache_dir: str | None = Field(None, description="where decoded data sets are cached")
    store_size: int | None = Field(None, ge=1, description="photos: store images with the shorter side at this "
                                   "size (centre square); training crops from them (crop: rrc), evaluation "
                                   "resizes and centre-crops (crop_pct)")
    crop_pct: float = Field(0.875, gt=0, le=1, description="evaluation of stored photos: centre crop share "
                            "(timm/DeiT); a pretrained model's own crop_pct wins")
    workers: int | None = Field(None, ge=1, description="processes that decode images into the store, or "
                                "from shards while training (each rank's)")
    # schedule
    epochs: int = Field(30, ge=1, description="epochs to train")
    steps: int | None = Field(None, ge=1, description="optimiser steps to train instead of epochs (the schedule laid "
                              "over them; the last epoch is cut short): the same amount of training whatever loads "
                              "the machine, as a study's arms take it")
    time_budget: float | None = Field(None, gt=0, description="minutes of training: lay the schedule over them")
    budget_counts: Literal["all", "training"] = Field("all", description="what the time budget counts: all (the "
                                                      "run ends within it, evaluations included) or training (the "
                                                      "evaluations after epochs stop the clock, as speed runs time "
                                                      "training; the run then ends later by their time)")
    batch_size: int = Field(128, ge=1, description="global batch (split over processes and micro-batches)")
    accum_steps: int = Field(1, ge=1, description="gradient accumulation: micro-batches per optimiser step")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    min_lr: float = Field(1e-5, ge=0, description="final learning rate of the cosine")
    warmup: float = Field(0.05, ge=0, lt=1, description="share of the schedule spent in linear warmup")
    weight_decay: float = Field(0.05, ge=0, description="AdamW decay (none on norms, biases, embeddings, tokens)")
    optimizer: Optimizer = Field("adamw", description="adamw, or sgd: Nesterov SGD whose lr and weight decay are "
                                 "per 1,024 examples (airbench's decoupled hyperparameters, train/optim.py)")
    momentum: float = Field(0.9, gt=0, lt=1, description="SGD's Nesterov momentum (optimizer: sgd)")
    bn_bias_lr_scale: float = Field(1.0, gt=0, description="learning-rate factor of the BatchNorm biases "
                                    "(airbench: 64; their weight decay per step unchanged)")
    lookahead_every: int = Field(0, ge=0, description="lookahead: every N steps pull the weights toward their slow "
                                 "average and copy it back (airbench: 5; 0 = off)")
    lookahead_decay: float = Field(0.95, gt=0, le=1, description="lookahead: the slow weights keep "
                                   "decay ** N * progress ** 3 of themselves at each pull")
    freeze_stem_after: int = Field(0, ge=0, description="stop training a model's stem (airbench's whitening "
                                   "bias) after N epochs (0 = never)")
    clip_grad: float | None = Field(1.0, ge=0, description="gradient norm clipping (0 or null = off)")
    ema_decay: float = Field(0.0, ge=0, lt=1, description="EMA of the weights (0 = off, e.g. 0.999)")
    ema_start: float = Field(0.0, ge=0, lt=1, description="share of the schedule at which the EMA begins to "
                             "average (before it the copy follows the model; e.g. progressive_until)")
    early_stop: int = Field(0, ge=0, description="stop after N evaluations without improvement (0 = off)")
    plateau_patience: int = Field(0, ge=0, description="scale the lr after N evaluations without improvement (0 = off)")
    plateau_factor: float = Field(0.5, gt=0, lt=1, description="lr factor on a plateau")
    eval_every: int = Field(1, ge=1, description="epochs between evaluations")
    progressive_scale: float = Field(1.0, gt=0, le=1, description="progressive resizing: start at this share of "
                                     "the input size (1 = off)")
    progressive_until: float = Field(0.5, gt=0, le=1, description="share of the schedule by which the input "
                                     "reaches full size")
    tta: bool = Field(False, description="evaluate on each test image and its mirror image (mean logits)")
    tta_translate: int = Field(0, ge=0, description="with tta: also the test images shifted by N pixels up-left and "
                               "down-right (reflected borders), weighted as airbench (1: its level 2)")
    augment: AugmentConfig = Field(default_factory=AugmentConfig, description="batched augmentation")
    # distillation
    teacher: str | None = Field(None, description="teacher model folder for distillation (and for pretrain distill: "
                                "the frozen backbone, anything vitlab.load reads)")
    distill: DistillType = Field("none", description="distillation type: hard or soft (with --teacher); self: soft, "
                                 "from an EMA copy of the student (no --teacher)")
    tau: float = Field(1.0, gt=0, description="soft distillation temperature")
    alpha: float = Field(0.5, ge=0, le=1, description="distillation loss weight")
    teacher_once: bool = Field(False, description="the teacher's predictions on every training image (the mean over "
                               "it and its mirror image) made once before the first step, their time counted as "
                               "training, instead of on every augmented batch: the student trains at its own speed, "
                               "and the teacher does not see its crops")
    # execution
    device: Device = Field("auto", description="auto picks CUDA when PyTorch sees a GPU")
    precision: Precision = Field(
        "auto", description="auto: bf16 on GPUs that support it, and on CPUs with AMX for models of "
        f"~{BF16_CPU_MIN_MACS / 1e9:g} GMACs an image or more (where it pays), else fp32")
    compile: bool = Field(False, description="torch.compile the model")
    shard: Shard = Field("none", description="under torchrun: none (DDP: every rank holds the whole model, its "
                         "gradients and optimizer state) or fsdp (FSDP2: each rank holds 1/N of them, gathered block "
                         "by block; for models that do not fit one device; docs/distributed.md)")
    channels_last: bool | None = Field(None, description="channels-last memory format (default: on CUDA for "
                                       "convolutional stems)")
    data_on_device: bool | None = Field(None, description="keep the training set on the GPU (default: when it fits)")
    max_nonfinite: int = Field(20, ge=1, description="fp16: stop after this many steps with a non-finite loss")
    log: Log = Field("none", description="extra logger besides metrics.jsonl")
    threads: int | None = Field(None, ge=1, description="CPU threads")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="random seed (0 to 2**32 - 1, as NumPy takes)")
    checkpoint_every: int | None = Field(None, ge=1, description="also checkpoint every this many steps within an "
                                         "epoch (epochs mode): a run killed midway resumes at that step (long epochs "
                                         "of shards)")
    out: str | None = Field(None, description="run folder to write")
    auto: dict[str, Any] = Field(default_factory=dict, description="what the automatic choice (no model named) "
                                 "chose and why: the rule table's row, the reason, the measured images a second; "
                                 "written by the run, not given")

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, values: Any) -> Any:
        """Augmentation options may be given at the top level (``hflip: no``) or under ``augment:``; the options
        not given take the defaults of the data set, its model and pre-training (``resolve_defaults``)."""
        if not isinstance(values, dict) or _whole(values):
            return values
        return resolve_defaults(_nested(values))

    @model_validator(mode="after")
    def _check_together(self) -> Recipe:
        if self.min_lr > self.lr:
            raise VitlabError(f"min_lr={self.min_lr!r} is not valid; accepted: a number in [0, lr={self.lr}]")
        if self.steps and self.time_budget:
            raise VitlabError(f"steps={self.steps} is not valid with time_budget={self.time_budget:g}: a run trains "
                              "for a number of steps or for a time; accepted: one of them")
        if self.distill == "self" and self.teacher:
            raise VitlabError("distill='self' takes no --teacher: its teacher is an EMA copy of the student; accepted: "
                              "--distill hard or soft with --teacher")
        if self.distill in ("hard", "soft") and not self.teacher:
            raise VitlabError(f"distill={self.distill!r} needs a teacher: --teacher MODEL_FOLDER")
        if self.teacher and self.distill == "none" and self.pretrain == "none":
            object.__setattr__(self, "distill", "hard")  # DeiT's default; no re-validation loop
        if self.teacher_once:
            check_teacher_once(self)
        check_finetune(self)
        check_pretrain(self)
        if self.tta_translate and not self.tta:
            raise VitlabError(f"tta_translate={self.tta_translate} needs tta: true (--tta); accepted without it: 0")
        if self.ema_start and not self.ema_decay:
            raise VitlabError(f"ema_start={self.ema_start:g} needs an EMA to begin: --ema-decay, e.g. 0.999; "
                              "accepted without it: 0")
        if self.shard == "fsdp":
            check_shard(self)
        if self.batch_size % self.accum_steps:
            raise VitlabError(f"batch_size={self.batch_size} is not valid with accum_steps={self.accum_steps}; "
                              "accepted: a multiple of accum_steps")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as written to the run folder's config.yaml."""
        d = self.model_dump()
        d["augment"]["rrc_scale"] = list(d["augment"]["rrc_scale"])
        return d


FIELDS = dict(Recipe.model_fields)
# The recipe's sections, as `vitlab train --help` groups its options: every option in one of them.
SECTIONS: dict[str, tuple[str, ...]] = {
    "what to train": ("model", "auto", "model_args", "img_size", "drop_path", "pretrain", "pretrain_args"),
    "fine-tuning": ("init", "head_init", "freeze_backbone", "freeze_blocks", "layer_decay", "lora", "lora_alpha",
                    "lora_targets", "grad_checkpointing"),
    "data": ("data", "test_data", "download", "val_fraction", "train_fraction", "cache_dir", "store_size", "crop_pct",
             "workers"),
    "schedule": ("epochs", "steps", "time_budget", "budget_counts", "batch_size", "accum_steps", "warmup",
                 "early_stop", "plateau_patience", "plateau_factor", "progressive_scale", "progressive_until"),
    "optimiser": ("optimizer", "lr", "min_lr", "weight_decay", "momentum", "bn_bias_lr_scale", "clip_grad",
                  "lookahead_every", "lookahead_decay", "freeze_stem_after", "ema_decay", "ema_start"),
    "augmentation": tuple(AUGMENT_FIELDS),
    "evaluation": ("eval_every", "tta", "tta_translate"),
    "distillation": ("teacher", "distill", "tau", "alpha", "teacher_once"),
    "execution": ("device", "precision", "compile", "shard", "channels_last", "data_on_device", "max_nonfinite", "log",
                  "threads", "seed", "checkpoint_every", "out"),
}


class _Null:
    """An override that sets a field to None (``--time-budget null``): None itself means "not given"."""

    def __repr__(self) -> str:
        return "null"


NULL = _Null()


def check_shard(recipe: Recipe) -> None:
    """What --shard fsdp does not combine with yet (a second whole copy of the model, a compiled sharded one, or a
    sharded stem frozen midway): one line naming it."""
    clash = [flag for flag, on in (("--ema-decay", recipe.ema_decay > 0), ("--lookahead-every", recipe.lookahead_every),
                                   ("--compile", recipe.compile), ("--freeze-stem-after", recipe.freeze_stem_after),
                                   ("--pretrain", recipe.pretrain != "none"),
                                   ("--distill", recipe.distill != "none")) if on]
    if clash:
        raise VitlabError(f"shard='fsdp' does not combine with {', '.join(clash)} (a second whole copy of the model, "
                          "or a compiled sharded one); accepted: shard='none' (DDP) with them, or fsdp without them")


def check_finetune(recipe: Recipe) -> None:
    """Fine-tuning options that make no sense together (or without --init): one line naming them."""
    if not recipe.init and (recipe.head_init != "auto" or recipe.freeze_blocks):
        option = (f"head_init={recipe.head_init!r}" if recipe.head_init != "auto"
                  else f"freeze_blocks={recipe.freeze_blocks}")
        raise VitlabError(f"{option} applies to a pretrained model: give --init MODEL (a new model's head and "
                          "blocks start as the model initialises them)")
    if recipe.lora and not recipe.init and recipe.pretrain == "none":
        raise VitlabError(f"lora={recipe.lora} adapts a pretrained model: give --init MODEL (on a new model its "
                          "adapters would train beside a random backbone that never learns)")
    if recipe.lora and (recipe.freeze_backbone or recipe.freeze_blocks):
        raise VitlabError(f"lora={recipe.lora} is not valid with freeze_backbone or freeze_blocks: LoRA freezes every "
                          "layer but its adapters and the head; accepted with lora: neither")
    if recipe.lora_alpha is not None and not recipe.lora:
        raise VitlabError(f"lora_alpha={recipe.lora_alpha:g} needs LoRA: --lora RANK, e.g. 4")
    if recipe.freeze_backbone and recipe.freeze_blocks:
        raise VitlabError(f"freeze_blocks={recipe.freeze_blocks} is not valid with freeze_backbone, which freezes "
                          "every block already; accepted: one of them")
    if recipe.freeze_backbone and recipe.layer_decay < 1:
        raise VitlabError(f"layer_decay={recipe.layer_decay:g} is not valid with freeze_backbone: only the head "
                          "trains, at the full lr; accepted with freeze_backbone: layer_decay 1")


def check_teacher_once(recipe: Recipe) -> None:
    """A teacher whose predictions are made once needs a fixed teacher and unmixed images: one line otherwise."""
    if recipe.distill not in ("hard", "soft"):
        raise VitlabError(f"teacher_once needs a teacher model (--teacher MODEL_FOLDER, --distill hard or soft), not "
                          f"distill={recipe.distill!r}; accepted without one: teacher_once false")
    mixed = [f"{k} {v:g}" for k, v in (("mixup", recipe.augment.mixup), ("cutmix", recipe.augment.cutmix)) if v]
    if mixed:
        raise VitlabError(f"teacher_once predicts each training image once, not the images that {' and '.join(mixed)} "
                          "mix; accepted with it: mixup 0 and cutmix 0")


def check_pretrain(recipe: Recipe) -> None:
    """Pre-training options: the objective's, checked and coerced; supervised-only options refused in one line."""
    if recipe.pretrain == "none":
        if recipe.pretrain_args:
            raise VitlabError(f"pretrain_args {recipe.pretrain_args} need a pre-training objective: pretrain mae, mpp, "
                              "dino, ibot or distill")
        if recipe.val_fraction == 0:
            raise VitlabError("val_fraction=0 holds no image out, and a supervised run needs test images to score; "
                              "accepted: a number in (0, 1), or 0 with a pretrain method")
        return
    object.__setattr__(recipe, "pretrain_args", check_options(recipe.pretrain, recipe.pretrain_args))
    if recipe.pretrain == "distill" and not recipe.teacher:
        raise VitlabError("pretrain distill needs a teacher to distil: --teacher MODEL (anything vitlab.load reads: a "
                          "model or run folder, a timm or Hugging Face folder)")
    if recipe.teacher and recipe.pretrain != "distill":
        raise VitlabError(f"teacher={recipe.teacher!r} is not valid with pretrain={recipe.pretrain!r}, which learns "
                          "without a teacher; accepted: pretrain distill with --teacher, or this method without it")
    values = {**recipe.model_dump(exclude={"augment"}), **recipe.augment.model_dump()}
    supervised = [name for name in SUPERVISED_ONLY if name not in ("mix_prob", "switch_prob")  # inert without mixing
                  and name not in PRETRAIN_TAKES.get(recipe.pretrain, ()) and values[name] != field_default(name)]
    if supervised:
        raise VitlabError(f"{', '.join(supervised)}: not valid with pretrain={recipe.pretrain!r}, which uses no "
                          "labels; accepted: these options with pretrain none")


# The options only a supervised run uses (labels, a classifier head, a teacher): `vitlab pretrain` does not list them
# and refuses them given, and a pre-training recipe that sets them is refused.
SUPERVISED_ONLY = ("head_init", "freeze_backbone", "freeze_blocks", "layer_decay", "tta", "tta_translate", "teacher",
                   "distill", "tau", "alpha", "teacher_once", "mixup", "cutmix", "mix_prob", "switch_prob",
                   "label_smoothing", "lora", "lora_alpha", "lora_targets")


# The options of SUPERVISED_ONLY that one pre-training method takes (distillation's frozen backbone).
PRETRAIN_TAKES: dict[str, tuple[str, ...]] = {"distill": ("teacher",)}


def field_default(name: str) -> Any:
    """The default of a recipe or augmentation field, with pre-training's where it has one (no mixing, say)."""
    if name in PRETRAIN_DEFAULTS.get("augment", {}):
        return PRETRAIN_DEFAULTS["augment"][name]
    return (FIELDS.get(name) or AUGMENT_FIELDS[name]).get_default(call_default_factory=True)


# Pre-training defaults (MAE's): random resized crops of 20-100% of the image and flips, no other augmentation,
# no label mixing or smoothing, no stochastic depth, cosine to 0; lr by MAE's rule, 1.5e-4 x batch_size / 256.
PRETRAIN_DEFAULTS: dict[str, Any] = {
    "drop_path": 0.0, "min_lr": 0.0, "weight_decay": 0.05,
    "augment": {"crop": "rrc", "rrc_scale": (0.2, 1.0), "hflip": True, "auto_augment": "none", "random_erasing": 0.0,
                "mixup": 0.0, "cutmix": 0.0, "label_smoothing": 0.0, "repeated_aug": 1}}
PRETRAIN_BASE_LR = 1.5e-4  # per 256 images of batch
# DINO's own (and iBOT's, which keeps them): lr 5e-4 per 256 images (Caron et al. 2021), and no crop of the batch,
# whose objective cuts its own global and local crops from the whole image.
DINO_BASE_LR = 5e-4


def pretrain_defaults(values: dict[str, Any]) -> None:
    """Fill in PRETRAIN_DEFAULTS where ``values`` leave an option unset, and the lr from the batch size."""
    dino = values.get("pretrain") in ("dino", "ibot")
    if dino:
        values["augment"] = {"crop": "none", **values["augment"]}
    for key, value in PRETRAIN_DEFAULTS.items():
        if key == "augment":
            values["augment"] = {**value, **values["augment"]}
        else:
            values.setdefault(key, value)
    data = str(values.get("data", FIELDS["data"].default))
    batch = values.get("batch_size", DATA_DEFAULTS.get(data, {}).get("batch_size", FIELDS["batch_size"].default))
    try:
        values.setdefault("lr", (DINO_BASE_LR if dino else PRETRAIN_BASE_LR) * float(batch) / 256)
    except (TypeError, ValueError):
        pass  # the recipe names the bad batch_size

# Defaults that suit a data set better than the general ones; options given explicitly win.
# Digits are small, centred and not mirror-symmetric: no flips, no colour or erasing. No crops either: a shift by one
# pixel moves the content of every 2x2 patch, and the model then needs several times the epochs; unshifted it is held
# back from overfitting by weight decay 0.3 and cutmix on half the batches, whose mixed targets already soften the
# labels (label smoothing on top cost the lowest seed). 50 epochs, not 40: float32 rounds otherwise on another CPU,
# and 40 left a seed short there. The measurements behind each choice: docs/training.md, "The digits recipe".
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"epochs": 50, "batch_size": 32, "warmup": 0.05, "weight_decay": 0.3,
               "drop_path": 0.0, "augment": {"crop": "none", "hflip": False, "auto_augment": "none",
                                             "random_erasing": 0.0, "mixup": 0.0, "cutmix": 1.0, "mix_prob": 0.5,
                                             "label_smoothing": 0.0}},
}
# The model a data set trains when none is named, and defaults that suit that model only: another model on
# the same data keeps the general ones. (lr 5e-3 suits the 8x8 vit_micro_patch2_8, not a 32x32 DeiT student on the
# digits: docs/training.md, "The digits recipe".)
DEFAULT_MODELS: dict[str, str] = {"digits": "vit_micro_patch2_8"}
GENERAL_DEFAULT_MODEL = "vit_tiny_patch4_32"
MODEL_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {("digits", "vit_micro_patch2_8"): {"lr": 5e-3}}


def default_model(data: str) -> str:
    return DEFAULT_MODELS.get(data, GENERAL_DEFAULT_MODEL)


def default_words(name: str) -> str:
    """An option's default in words, with what a data set, a model on it and pre-training give it instead:
    ``default 30; per data set (digits: 50)``."""
    if name == "model":
        per_data = ", ".join(f"{data}: {model}" for data, model in DEFAULT_MODELS.items())
        return f"default: per data set ({per_data}; others: {GENERAL_DEFAULT_MODEL})"
    info = FIELDS.get(name) or AUGMENT_FIELDS[name]
    general = info.get_default(call_default_factory=True)

    def of(values: dict[str, Any]) -> Any:
        return values.get("augment", {}).get(name, UNSET) if name in AUGMENT_FIELDS else values.get(name, UNSET)

    said = [f"default {general!r}"]
    per_data = [f"{data}: {of(values)!r}" for data, values in DATA_DEFAULTS.items() if of(values) is not UNSET]
    per_model = [f"{data} with {model}: {of(values)!r}" for (data, model), values in MODEL_DEFAULTS.items()
                 if of(values) is not UNSET]
    said += [f"per data set ({', '.join(per_data)})"] if per_data else []
    said += [f"per model ({', '.join(per_model)})"] if per_model else []
    if name == "lr":
        said.append(f"pre-training: {PRETRAIN_BASE_LR:g} x batch_size / 256")
    elif of(PRETRAIN_DEFAULTS) is not UNSET:
        said.append(f"pre-training: {of(PRETRAIN_DEFAULTS)!r}")
    return "; ".join(said)


def resolve_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (augmentation nested) with the options they leave out filled in: pre-training's defaults (with
    ``pretrain``), then, for a new model (no ``init``), the data set's model and the defaults of the data set and
    of that model on it. Options given, even as None, stay as given (a ``model`` of None is the data set's)."""
    values = {**values, "augment": dict(values.get("augment") or {})}
    if values.get("pretrain", "none") != "none":
        pretrain_defaults(values)
    if values.get("init"):
        return values
    data = str(values.get("data", FIELDS["data"].default))
    if values.get("model") is None:
        values["model"] = default_model(data)
    for key, value in {**DATA_DEFAULTS.get(data, {}), **MODEL_DEFAULTS.get((data, str(values["model"])), {})}.items():
        if key == "augment":
            values["augment"] = {**value, **values["augment"]}
        else:
            values.setdefault(key, value)
    return values


def make_recipe(values: dict[str, Any]) -> Recipe:
    """A checked Recipe from plain values; ValueError (one line) on the first bad one."""
    return Recipe(**values)


# option -> (whether a recipe uses it, the options that decide it, what it needs to be used): an option given that
# the run would not use is refused, never recorded and ignored
USED_ONLY: dict[str, tuple[Callable[[Recipe], bool], tuple[str, ...], str]] = {
    "epochs": (lambda r: not r.steps and not r.time_budget, ("steps", "time_budget"), "a run of --steps or "
               "--time-budget trains for those, whatever its epochs"),
    "budget_counts": (lambda r: bool(r.time_budget), ("time_budget",), "it says what a --time-budget counts"),
    "lora_targets": (lambda r: bool(r.lora), ("lora",), "it names the layers --lora adapts"),
    "lookahead_decay": (lambda r: bool(r.lookahead_every), ("lookahead_every",), "lookahead runs with "
                        "--lookahead-every N"),
    "plateau_factor": (lambda r: bool(r.plateau_patience), ("plateau_patience",), "the lr is scaled on a plateau "
                       "with --plateau-patience N"),
    "progressive_until": (lambda r: r.progressive_scale < 1, ("progressive_scale",), "progressive resizing runs "
                          "with --progressive-scale below 1"),
}


def check_used(recipe: Recipe, layers: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse (one line) an option given in one of ``layers`` ((where, values): a recipe file, then the command line
    or the API's keywords) that ``recipe`` would not use. An option of a recipe file turned off by a later layer
    (the file's epochs beside a --time-budget given, its lookahead_decay beside --lookahead-every 0) is the user's
    override, not a mistake."""
    for n, (where, values) in enumerate(layers):
        later = {k for _, v in layers[n + 1:] for k in v}
        for option, (used, deciders, why) in USED_ONLY.items():
            if values.get(option) is None or used(recipe) or later & set(deciders):
                continue
            raise VitlabError(f"{option}={values[option]!r}{where} is given but would not be used: {why}; accepted: "
                              "leave it out, or give what it needs")


def load_recipe(path: str | Path | None = None, *, strict: bool = False, **overrides: Any) -> Recipe:
    """A Recipe from a YAML file (optional) updated by overrides (None = not given, ``NULL`` = set to None);
    unknown keys are an error. ``strict`` (a user's command line or keywords): an option given that the run
    would not use is refused (``check_given``)."""
    recipe = make_recipe(recipe_values(path, **overrides))
    if strict:
        check_given(recipe, path, overrides)
    return recipe


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """A recipe file's values (augmentation nested); one line for a file that is missing or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"recipe {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise VitlabError(f"recipe {p} is not valid YAML: {e}") from None
    except RecursionError:
        raise VitlabError(f"recipe {p} nests its YAML values deeper than vitlab reads; accepted: a mapping of "
                          "option: value") from None
    if not isinstance(loaded, dict):
        raise VitlabError(f"recipe {p} must be a mapping of option: value")
    return _nested(loaded)


def given_values(overrides: dict[str, Any]) -> dict[str, Any]:
    """The options given (None = not given, ``NULL`` = set to None), augmentation nested."""
    return _nested({k: None if v is NULL else v for k, v in overrides.items() if v is not None})


def recipe_values(path: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """The values a Recipe is made from (augmentation nested): a YAML file (optional) updated by overrides (None =
    not given, ``NULL`` = set to None); unknown keys are an error."""
    values = read_recipe_file(path) if path is not None else {}
    given = given_values(overrides)
    file_args, given_args = values.get("model_args"), given.get("model_args")
    values = {**values, **given, "augment": {**values.get("augment", {}), **given.get("augment", {})}}
    if isinstance(file_args, dict) and isinstance(given_args, dict):
        values["model_args"] = {**file_args, **given_args}  # --model-arg adds to (or overrides) the recipe's
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise VitlabError(f"unknown recipe option(s) {', '.join(unknown)}; accepted: "
                          f"{', '.join([*FIELDS, *AUGMENT_FIELDS])}")
    return values


def check_given(recipe: Recipe, path: str | Path | None, overrides: dict[str, Any]) -> None:
    """Refuse an option of the recipe file ``path`` or of ``overrides`` (a user's command line or keywords) that
    ``recipe`` would not use (``check_used``); a run's own config.yaml, every option written out, is not held to
    it, only the options given beside it."""
    file_values = read_recipe_file(path) if path is not None else {}
    written = path is not None and set(FIELDS) - {"out"} <= set(file_values)  # a run's config.yaml
    given = {k: v for k, v in given_values(overrides).items() if k != "augment"}
    check_used(recipe, ([] if written or path is None else [(f" in recipe {path}", file_values)]) + [("", given)])


def _whole(values: dict[str, Any]) -> bool:
    """Every option present, augmentation as an AugmentConfig (as pydantic hands an assignment's values): nothing to
    fill in or nest."""
    return isinstance(values.get("augment"), AugmentConfig) and values.keys() == FIELDS.keys()


def _nested(values: dict[str, Any]) -> dict[str, Any]:
    """Move top-level augmentation options under ``augment``."""
    nested = values.get("augment") or {}
    if isinstance(nested, AugmentConfig):
        nested = nested.model_dump(exclude_unset=True)  # the options it was given: the others take the defaults
    if not isinstance(nested, dict):
        raise VitlabError(f"augment={nested!r} is not valid; accepted: a mapping of augmentation options")
    flat = {k: v for k, v in values.items() if k in AUGMENT_FIELDS}
    rest = {k: v for k, v in values.items() if k not in AUGMENT_FIELDS and k != "augment"}
    return {**rest, "augment": {**flat, **nested}}
