"""What a run is built from: the model and data sized for each other, the optimiser, the precision."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .. import checkpoint
from ..data.augment import BatchAugment, normalize
from ..data.sources import DataBundle, ImageSet, load_data
from ..data.views import Preprocess, stratified_subset
from ..devices import auto_precision
from ..models.registry import accepted_args, check_args, create_model, get_spec
from ..runs.format import PRETRAIN_WEIGHTS
from .distributed import Dist, barrier, broadcast_flag
from .finetune import freeze_blocks
from .recipe import Recipe, default_model

if TYPE_CHECKING:
    from .tasks import Task


def build_model_and_data(r: Recipe, d: Dist, task: Task,
                          log: Callable[[str], None]) -> tuple[nn.Module, DataBundle, tuple, tuple]:
    """The model the task trains and the data, sized for each other; returns (model, data, mean, std). The model's
    pretrained_cfg records the preprocessing the run applies (``views.Preprocess``): what eval, predict and the
    exports apply."""
    def get_data(img_size, in_chans, fit=None):
        if d.is_main:
            data = load_data(r.data, img_size=img_size, in_chans=in_chans, cache_dir=r.cache_dir,
                             download=r.download, val_fraction=r.val_fraction, seed=r.seed, log=log,
                             store_size=r.store_size, workers=r.workers, fit=fit)
        barrier(d)  # rank 0 decodes and fills the cache; the others then read it
        if not d.is_main:
            data = load_data(r.data, img_size=img_size, in_chans=in_chans, cache_dir=r.cache_dir,
                             download=False, val_fraction=r.val_fraction, seed=r.seed, log=lambda s: None,
                             store_size=r.store_size, workers=r.workers, fit=fit)
        if r.train_fraction < 1:
            keep = stratified_subset(data.train.labels, r.train_fraction)
            log(f"training on {len(keep)} of {len(data.train.labels)} images ({100 * r.train_fraction:g}% of "
                "every class)")
            data.train = ImageSet(data.train.images[keep], data.train.labels[keep])
        if data.unlabelled and task.labels:
            raise ValueError(f"{r.data} is a folder of unlabelled images (no class folders): supervised training "
                             "needs <root>/<class>/<image>; accepted without labels: vitlab pretrain --method mae|mpp")
        return data

    if r.init:
        return _from_init(r, task, get_data, log)
    name = r.model or default_model(r.data)
    spec = get_spec(name)
    check_args(spec.cls, r.model_args)  # before any data is read
    task.check_model(spec.cls)  # before any data is read
    args = {**spec.args, **r.model_args}
    in_chans = args.get("in_chans", 3)
    img_size = r.img_size or args.get("img_size", 224)
    check_size(name, img_size, args, r, log)
    data = get_data(img_size, in_chans)
    overrides = dict(r.model_args, num_classes=task.num_classes(data.classes))
    if "img_size" in accepted_args(spec.cls):
        overrides["img_size"] = tuple(data.img_size)
    if "drop_path_rate" in accepted_args(spec.cls):
        overrides.setdefault("drop_path_rate", r.drop_path)
    model = create_model(name, **overrides)
    mean, std = tuple(data.mean), tuple(data.std)
    model.pretrained_cfg.update(applied(r, Preprocess(tuple(data.img_size), mean=mean, std=std)).to_cfg())
    return model, data, mean, std


def applied(r: Recipe, prep: Preprocess) -> Preprocess:
    """The preprocessing a run applies to an image file when its images are decoded by ``prep``'s rule: with
    --store-size, the shorter side to store_size and evaluation's centre crop (bicubic) instead."""
    if r.store_size is None:
        return prep
    return replace(prep, crop_mode="center", crop_pct=prep.crop_pct if r.init else r.crop_pct, interpolation="bicubic")


def _from_init(r: Recipe, task: Task, get_data: Callable,
               log: Callable[[str], None]) -> tuple[nn.Module, DataBundle, tuple, tuple]:
    """A run from --init: at the checkpoint's size unless --img-size says otherwise, its images resized by the
    checkpoint's own rule and interpolation (a position table resampled only for another size)."""
    base = checkpoint.load(r.init)
    task.check_model(base)  # before any data is read
    check_named_model(r, base)
    in_chans = base.pretrained_cfg["input_size"][0]
    own = tuple(base.pretrained_cfg["input_size"][1:])
    size = (r.img_size, r.img_size) if r.img_size else own
    embed = getattr(base, "patch_embed", None)
    patch = r.model_args.get("patch_size") or (embed.patch_size if embed is not None else None)
    patch = (patch, patch) if isinstance(patch, int) else tuple(patch) if patch else None
    if patch and (size[0] % patch[0] or size[1] % patch[1]):
        raise ValueError(f"img_size {size[0]}x{size[1]} is not divisible by the patch size {patch[0]}x{patch[1]} of "
                         f"{r.init}; accepted: multiples of it, e.g. --img-size "
                         f"{max(patch[0], size[0] // patch[0] * patch[0])}")
    prep = Preprocess.from_cfg(base.pretrained_cfg).at(size)
    why = "--img-size" if r.img_size else f"the input size of {r.init}"
    source = base.pretrained_cfg.get("preprocess_from") or f"{r.init}'s config"
    log(f"training at {size[0]}x{size[1]} ({why}); images are decoded as {source} says: {prep.describe()}, mean "
        f"{', '.join(f'{v:g}' for v in prep.mean)}, std {', '.join(f'{v:g}' for v in prep.std)}")
    data = get_data(size, in_chans, prep.fit)
    overrides = dict(r.model_args)
    if "drop_path_rate" in accepted_args(type(base)):
        overrides.setdefault("drop_path_rate", r.drop_path)
    if embed is not None and tuple(embed.img_size) != size:
        overrides["img_size"] = size
        log(f"resampling the position embedding from {tuple(embed.img_size)} to {size}")
    model = checkpoint.load(r.init, **overrides)
    if r.model:  # the architecture of --init under the name --model gives it (check_named_model)
        model.arch = r.model
    loaded = model.state_dict()  # held: a new head's tensors cannot take the place of the ones it replaces
    task.fit_init_head(model, data.classes)
    log(describe_init(r.init, loaded, model))
    model.pretrained_cfg.update(applied(r, prep).to_cfg())
    mean, std = tuple(model.pretrained_cfg["mean"]), tuple(model.pretrained_cfg["std"])
    return model, data, mean, std


ARCH_FREE = ("num_classes", "drop_path_rate")  # arguments that --init's model takes from the run, not the name


def check_named_model(r: Recipe, base: nn.Module) -> None:
    """A run from --init trains the model --init holds: a --model beside it must name that architecture (the same
    class and arguments, under the same or another registered name); refused in one line otherwise."""
    arch = getattr(base, "arch", None)
    if not r.model or r.model == arch:
        return
    spec, given = get_spec(r.model), dict(getattr(base, "model_args", {}) or {})
    if spec.cls is not type(base) or built_with(spec.cls, spec.args, given) != built_with(
            type(base), registered_args(arch), given):
        raise ValueError(f"--model {r.model} is not the model of --init {r.init}, which holds "
                         f"{arch or type(base).__name__}: a run from --init trains the model it holds; accepted: "
                         f"no --model{f', or --model {arch}' if arch else ''} (or another --init)")


def registered_args(name: str | None) -> dict:
    """A registered name's arguments ({} for a model without one, or a name vitlab does not register)."""
    try:
        return get_spec(name).args if name else {}
    except ValueError:
        return {}


def built_with(cls: type, args: dict, given: dict) -> dict:
    """Every argument ``cls`` is built with from a name's ``args`` and the overrides ``given`` (the class's defaults
    filled in), less ARCH_FREE."""
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {k: v for k, v in {**defaults, **args, **given}.items() if k not in ARCH_FREE}


def describe_init(source: str, loaded: dict[str, torch.Tensor], model: nn.Module) -> str:
    """The line that says what --init took from ``source`` (``loaded``: the model's state as read) and what is new."""
    state = model.state_dict()
    new = [k for k, v in state.items() if k not in loaded or v.data_ptr() != loaded[k].data_ptr()]
    kept = len(state) - len(new)
    pretrained = (Path(source) / PRETRAIN_WEIGHTS).is_file()
    return (f"--init {source}: loaded {kept} {'encoder ' if pretrained else ''}tensors"
            f"{f' (its decoder, {PRETRAIN_WEIGHTS}, is not used)' if pretrained else ''}; "
            f"new: {', '.join(new) if new else 'none'}")


NATIVE_SIZE = {"digits": 8, "cifar10": 32, "cifar100": 32}  # the built-in data sets' image sizes


def check_size(name: str, img_size: int | tuple, args: dict, r: Recipe, log: Callable[[str], None]) -> None:
    """Before any data is decoded: refuse a size the model's patches do not tile; say when a built-in data set is
    scaled up to the model's default size."""
    patch = args.get("patch_size")
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if isinstance(patch, int) and any(s % patch for s in size):
        raise ValueError(f"img_size {size[0]}x{size[1]} is not divisible by the patch size {patch} of {name}; "
                         f"accepted: a multiple of {patch} (e.g. --img-size {max(patch, size[0] // patch * patch)})")
    native = NATIVE_SIZE.get(r.data)
    if r.img_size is None and native and size != (native, native):
        multiple = patch if isinstance(patch, int) else 1
        log(f"warning: {name} takes {size[0]}x{size[1]} images and {r.data}'s are {native}x{native}: they are scaled "
            f"to {size[0]}x{size[1]} ({size[0] * size[1] / native ** 2:.0f}x the pixels to compute on); choose the "
            f"size with --img-size (a multiple of {multiple}, e.g. {-(-native // multiple) * multiple})")


def prepare_model(model: nn.Module, train_images: torch.Tensor, mean, std, log: Callable[[str], None],
                  n: int = 5000) -> None:
    """A fresh run of a model that initialises from data (``init_from_data``): give it the first ``n`` training
    images, normalised."""
    if hasattr(model, "init_from_data"):
        images = normalize(train_images[:n].to(next(model.parameters()).device), mean, std)
        if model.init_from_data(images):
            log(f"initialised {type(model).__name__} from {len(images)} training images")


def epoch_plan(n: int, batch_size: int, unit: int) -> tuple[int, int]:
    """(largest batch, steps per epoch) for ``n`` training images: every image once an epoch, in batches of near-equal
    size (they differ by one image at most) no larger than ``batch_size``, each of ``unit`` images (processes x
    micro-batches) or more where the set allows; a set smaller than the batch is one step."""
    steps = max(1, min(-(-n // batch_size), n // unit))
    return -(-n // steps), steps


def describe_plan(n: int, batch_size: int, largest: int, steps: int) -> str | None:
    """The line that says how the epoch's batches were chosen, when they are not all ``batch_size``; else None."""
    if largest == batch_size and n == steps * batch_size:
        return None
    if steps == 1:
        return (f"batch_size {batch_size} is larger than the {n} training images: each step uses the whole "
                "training set")
    smallest = n // steps
    sizes = f"{smallest}-{largest}" if smallest < largest else f"{largest}"
    return (f"batches of {sizes} images, {steps} steps an epoch: every one of the {n} training images is used every "
            f"epoch (batch_size {batch_size} at most)")


def check_groups(optimizer: torch.optim.Optimizer, ckpt: dict, path, model: nn.Module) -> None:
    """Refuse a checkpoint of this model whose optimizer groups (their sizes and lr scales) are not the ones this
    run builds; another model's checkpoint is left to the state's loading, which names both models."""
    saved, weights = ckpt.get("optimizer"), ckpt.get("model")
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) or not isinstance(weights, dict):
        return  # the state's own loading says what is missing
    own = model.state_dict()
    if set(weights) != set(own) or any(getattr(weights[k], "shape", None) != v.shape for k, v in own.items()):
        return
    ours = [(len(g["params"]), round(g.get("lr_scale", 1.0), 9)) for g in optimizer.param_groups]
    theirs = [(len(g.get("params", ())), round(g.get("lr_scale", 1.0), 9)) for g in saved["param_groups"]
              if isinstance(g, dict)]
    if ours != theirs:
        raise ValueError(f"{path} holds an optimizer of {len(theirs)} parameter groups that the run's recipe does not "
                         f"make ({len(ours)} groups: layer_decay, freeze_blocks and freeze_backbone decide them); "
                         "accepted: a checkpoint of this run")


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier head(s): a linear probe."""
    for name, p in model.named_parameters():
        p.requires_grad = name.split(".")[0] in model.classifier_names


def freeze(model: nn.Module, r: Recipe, log: Callable[[str], None]) -> None:
    """Freeze what the recipe says (the backbone, or the embeddings and the first blocks) and say what."""
    if r.freeze_backbone:
        freeze_backbone(model)
    elif r.freeze_blocks:
        names = freeze_blocks(model, r.freeze_blocks)
        frozen = sum(p.numel() for n, p in model.named_parameters() if n in set(names))
        total = sum(p.numel() for p in model.parameters())
        log(f"frozen: the embeddings and the first {r.freeze_blocks} blocks ({frozen / 1e6:.2f}M of "
            f"{total / 1e6:.2f}M parameters)")


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 7919 + rank * 104_729) % (2 ** 31)


def set_fast_math(device: torch.device) -> None:
    """TF32 matmuls and convolutions on GPUs that have them (float32 runs; autocast regions use bf16/fp16)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


def choose_precision(r: Recipe, model: nn.Module, augment: BatchAugment, images: torch.Tensor,
                     labels: torch.Tensor, d: Dist, log: Callable[[str], None]) -> str:
    """'fp32', 'bf16' or 'fp16'. 'auto' is bf16 where the hardware computes in it fast (a GPU that supports it,
    a CPU with AMX), else fp32: decided from the hardware, never from a timing (see devices.auto_precision)."""
    if r.precision != "auto":
        if r.precision == "bf16" and d.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"precision='bf16' is not supported by {torch.cuda.get_device_name(d.device)}; "
                             "accepted here: fp16, fp32, auto")
        if r.precision == "fp16" and d.device.type != "cuda":
            raise ValueError("precision='fp16' needs a GPU (a gradient scaler on the CPU is of no use); "
                             "accepted on the CPU: auto, bf16, fp32")
        return r.precision
    precision, why = auto_precision(d.device)
    precision = "bf16" if broadcast_flag(precision == "bf16", d) else "fp32"  # rank 0's hardware decides
    log(f"precision auto: {'bf16' if precision == 'bf16' else 'float32'} ({why})")
    return precision
