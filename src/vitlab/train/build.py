"""The model and the data of a run, sized for each other: the registered model or the one --init names, the data
decoded at its input size, the blocks it freezes, the batches of an epoch."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .. import checkpoint
from ..data.augment import normalize
from ..data.sources import DataBundle, ImageSet, load_data
from ..data.views import Preprocess, stratified_subset
from ..errors import VitlabError
from ..models.groups import patch_embedding
from ..models.registry import accepted_args, check_args, create_model, get_spec
from ..runs.format import PRETRAIN_WEIGHTS
from .distributed import Dist, barrier
from .finetune import freeze_blocks
from .lora import apply_lora
from .recipe import Recipe, default_model

if TYPE_CHECKING:
    from .tasks import Task


def build_model_and_data(recipe: Recipe, dist: Dist, task: Task,
                          log: Callable[[str], None]) -> tuple[nn.Module, DataBundle, Preprocess]:
    """The model the task trains and the data, sized for each other; returns (model, data, the preprocessing the
    data was decoded by: the model's own for --init, else the data's mean and std at its size)."""
    def get_data(img_size, in_chans, fit=None):
        if dist.is_main:
            data = load_data(recipe.data, img_size=img_size, in_chans=in_chans, cache_dir=recipe.cache_dir,
                             download=recipe.download, val_fraction=recipe.val_fraction, seed=recipe.seed, log=log,
                             store_size=recipe.store_size, workers=recipe.workers, fit=fit, test_data=recipe.test_data)
        barrier(dist)  # rank 0 decodes and fills the cache; the others then read it
        if not dist.is_main:
            data = load_data(recipe.data, img_size=img_size, in_chans=in_chans, cache_dir=recipe.cache_dir,
                             download=False, val_fraction=recipe.val_fraction, seed=recipe.seed, log=lambda s: None,
                             store_size=recipe.store_size, workers=recipe.workers, fit=fit, test_data=recipe.test_data)
        if data.shards is not None:
            check_streamable(recipe)
        if recipe.train_fraction < 1:
            keep = stratified_subset(data.train.labels, recipe.train_fraction)
            log(f"training on {len(keep)} of {len(data.train.labels)} images ({100 * recipe.train_fraction:g}% of "
                "every class)")
            data.train = ImageSet(data.train.images[keep], data.train.labels[keep])
        if data.unlabelled and task.labels:
            raise VitlabError(f"{recipe.data} is a folder of unlabelled images (no class folders): supervised training "
                              "needs <root>/<class>/<image>; accepted without labels: vitlab pretrain --method "
                              "mae|mpp|dino|ibot|distill")
        return data

    if recipe.init:
        return _from_init(recipe, task, get_data, log)
    name = recipe.model or default_model(recipe.data)
    spec = get_spec(name)
    check_args(spec.cls, recipe.model_args)  # before any data is read
    task.check_model(spec.cls)  # before any data is read
    args = {**spec.args, **recipe.model_args}
    in_chans = args.get("in_chans", 3)
    img_size = recipe.img_size or args.get("img_size", 224)
    check_size(name, img_size, args, recipe, log)
    data = get_data(img_size, in_chans)
    overrides = dict(recipe.model_args, num_classes=task.num_classes(data.classes))
    if "img_size" in accepted_args(spec.cls):
        overrides["img_size"] = tuple(data.img_size)
    if "drop_path_rate" in accepted_args(spec.cls):
        overrides.setdefault("drop_path_rate", recipe.drop_path)
    model = create_model(name, **overrides)
    return model, data, Preprocess(tuple(data.img_size), mean=tuple(data.mean), std=tuple(data.std))


def check_streamable(recipe: Recipe) -> None:
    """Refuse (one line) what needs every training image at hand, which a run streaming shards does not have."""
    asked = [flag for flag, on in (("--train-fraction", recipe.train_fraction < 1),
                                   ("--teacher-once", recipe.teacher_once),
                                   ("--repeated-aug", recipe.augment.repeated_aug > 1)) if on]
    if asked:
        raise VitlabError(f"{', '.join(asked)} needs the training images in a store; a run from shards streams them "
                          f"({recipe.data}); accepted: a run without {' and '.join(asked)}, or --data naming a "
                          "folder or a store (vitlab data unpack writes shards back as a folder)")


def _from_init(recipe: Recipe, task: Task, get_data: Callable,
               log: Callable[[str], None]) -> tuple[nn.Module, DataBundle, Preprocess]:
    """A run from --init: at the checkpoint's size unless --img-size says otherwise, its images resized by the
    checkpoint's own rule and interpolation (a position table resampled only for another size)."""
    base = checkpoint.load(recipe.init)
    task.check_model(base)  # before any data is read
    check_named_model(recipe, base)
    in_chans = base.pretrained_cfg["input_size"][0]
    own = tuple(base.pretrained_cfg["input_size"][1:])
    size = (recipe.img_size, recipe.img_size) if recipe.img_size else own
    embed = patch_embedding(base)
    patch = recipe.model_args.get("patch_size") or (embed.patch_size if embed is not None else None)
    patch = (patch, patch) if isinstance(patch, int) else tuple(patch) if patch else None
    if patch and (size[0] % patch[0] or size[1] % patch[1]):
        raise VitlabError(f"img_size {size[0]}x{size[1]} is not divisible by the patch size {patch[0]}x{patch[1]} of "
                          f"{recipe.init}; accepted: multiples of it, e.g. --img-size "
                          f"{max(patch[0], size[0] // patch[0] * patch[0])}")
    prep = Preprocess.from_cfg(base.pretrained_cfg).at(size)
    why = "--img-size" if recipe.img_size else f"the input size of {recipe.init}"
    source = base.pretrained_cfg.get("preprocess_from") or f"{recipe.init}'s config"
    log(f"training at {size[0]}x{size[1]} ({why}); images are decoded as {source} says: {prep.describe()}, mean "
        f"{', '.join(f'{v:g}' for v in prep.mean)}, std {', '.join(f'{v:g}' for v in prep.std)}")
    data = get_data(size, in_chans, prep.fit)
    overrides = dict(recipe.model_args)
    if "drop_path_rate" in accepted_args(type(base)):
        overrides.setdefault("drop_path_rate", recipe.drop_path)
    if embed is not None and tuple(embed.img_size) != size:
        overrides["img_size"] = size
        log(f"resampling the position embedding from {tuple(embed.img_size)} to {size}")
    model = checkpoint.load(recipe.init, **overrides)
    if recipe.model:  # the architecture of --init under the name --model gives it (check_named_model)
        model.arch = recipe.model
    loaded = model.state_dict()  # held: a new head's tensors cannot take the place of the ones it replaces
    task.fit_init_head(model, data.classes)
    log(describe_init(recipe.init, loaded, model))
    return model, data, prep


ARCH_FREE = ("num_classes", "drop_path_rate")  # arguments that --init's model takes from the run, not the name


def check_named_model(recipe: Recipe, base: nn.Module) -> None:
    """A run from --init trains the model --init holds: a --model beside it must name that architecture (the same
    class and arguments, under the same or another registered name); refused in one line otherwise."""
    arch = getattr(base, "arch", None)
    if not recipe.model or recipe.model == arch:
        return
    spec, given = get_spec(recipe.model), dict(getattr(base, "model_args", {}) or {})
    if spec.cls is not type(base) or built_with(spec.cls, spec.args, given) != built_with(
            type(base), registered_args(arch), given):
        raise VitlabError(f"--model {recipe.model} is not the model of --init {recipe.init}, which holds "
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


def check_size(name: str, img_size: int | tuple, args: dict, recipe: Recipe, log: Callable[[str], None]) -> None:
    """Before any data is decoded: refuse a size the model's patches do not tile; say when a built-in data set is
    scaled up to the model's default size."""
    patch = args.get("patch_size")
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if isinstance(patch, int) and any(s % patch for s in size):
        raise VitlabError(f"img_size {size[0]}x{size[1]} is not divisible by the patch size {patch} of {name}; "
                          f"accepted: a multiple of {patch} (e.g. --img-size {max(patch, size[0] // patch * patch)})")
    native = NATIVE_SIZE.get(recipe.data)
    if recipe.img_size is None and native and size != (native, native):
        multiple = patch if isinstance(patch, int) else 1
        log(f"warning: {name} takes {size[0]}x{size[1]} images and {recipe.data}'s are {native}x{native}: they are "
            f"scaled to {size[0]}x{size[1]} ({size[0] * size[1] / native ** 2:.0f}x the pixels to compute on); choose "
            f"the size with --img-size (a multiple of {multiple}, e.g. {-(-native // multiple) * multiple})")


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


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier head(s): a linear probe."""
    for name, p in model.named_parameters():
        p.requires_grad = name.split(".")[0] in model.classifier_names


def freeze(model: nn.Module, recipe: Recipe, log: Callable[[str], None]) -> None:
    """Freeze what the recipe says (the backbone, the embeddings and the first blocks, or all but LoRA adapters) and
    say what; checkpoint the blocks' activations where the recipe asks."""
    if recipe.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if recipe.lora:
        apply_lora(model, recipe, log)
    elif recipe.freeze_backbone:
        freeze_backbone(model)
    elif recipe.freeze_blocks:
        names = freeze_blocks(model, recipe.freeze_blocks)
        frozen = sum(p.numel() for n, p in model.named_parameters() if n in set(names))
        total = sum(p.numel() for p in model.parameters())
        log(f"frozen: the embeddings and the first {recipe.freeze_blocks} blocks ({frozen / 1e6:.2f}M of "
            f"{total / 1e6:.2f}M parameters)")
