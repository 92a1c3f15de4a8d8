"""``vitlab inspect MODEL``: the ViT paper's analyses of any model, as figures and one report.html."""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..analysis.rollout import HEAD_FUSIONS
from ..data.augment import normalize
from ..data.sources import read_image
from ..data.views import Preprocess, balanced_order
from ..errors import VitlabError
from . import add_command
from .options import add_option


def _load_test_split(source: str, input_size: Sequence[int], args: argparse.Namespace, fit: str = "squash"):
    """(uint8 images, labels, class names) of a data set's test split, at the model's input size, by its rule."""
    from ..data import load_data
    from ..runs.format import read_split
    from ..runs.identity import check_data

    C, H, W = input_size
    split = {k: v for k, v in read_split(args.model).items()  # a run folder: its own test split
             if k != "data" and not (k == "test_data" and args.data)}
    bundle = load_data(source, img_size=(H, W), in_chans=C, cache_dir=args.cache_dir, download=args.download,
                       fit=fit, **split)
    check_data(args.model, bundle.identity, "inspect", own=args.data is None)
    if len(bundle.test.images) == 0:
        raise VitlabError(f"the test split of {source!r} is empty")
    return bundle.test.images, bundle.test.labels, list(bundle.classes)


def _pretraining_objective(folder: str):
    """A pre-training run's objective (encoder + decoder), or None for any other model folder."""
    from ..runs.format import PRETRAIN_WEIGHTS, read_config
    folder_path = Path(folder)
    if not folder_path.is_dir() or (read_config(folder_path).get("pretrain") in (None, "none")
                                    and not (folder_path / PRETRAIN_WEIGHTS).is_file()):
        return None
    from ..objectives import load_objective
    return load_objective(folder)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` sub-command to a ``vitlab`` sub-parser set."""
    p = add_command(
        subparsers, "inspect",
        description="Write figures (attention per block and head, raw attention, rollout, gradient rollout and "
                    "relevance maps with their faithfulness scores, a parameter-randomisation sanity check, head "
                    "importance, mean attention distance, position-embedding similarity, patch-filter components, "
                    "ConViT gates, CaiT class attention), faithfulness.json and one self-contained, interactive "
                    "report.html for a model.")
    p.add_argument("model", help="a model folder vitlab.load reads: vitlab (config.json + model.safetensors, "
                                 "e.g. a training run), timm or Hugging Face")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--images", nargs="+", metavar="FILE", help="image files to analyse (any format Pillow reads)")
    add_option(src, "data", default=None, metavar="SET",
               help="a data set whose test split is analysed: digits, cifar10, an image folder or a .tar.gz "
                    "(default: a run folder's own data set and split)")
    p.add_argument("--num-images", type=int, default=8, help="images shown in the figures (default 8)")
    p.add_argument("--distance-images", type=int, default=512,
                   help="images of --data the mean attention distance averages over (default 512)")
    p.add_argument("--faithfulness-images", type=int, default=0, metavar="N",
                   help="measure deletion/insertion and the perturbation test over N images of --data's "
                        "test split, against their labels, with a progress bar (default 0: the shown images only)")
    p.add_argument("--curve-steps", type=int, default=16,
                   help="points of the deletion and insertion curves after the first (default 16)")
    p.add_argument("--explorer-images", type=int, default=4,
                   help="images embedded in report.html's interactive attention explorer (default 4)")
    p.add_argument("--out", default=None, help="output folder (default: inspect_<model folder name>)")
    p.add_argument("--head-fusion", choices=HEAD_FUSIONS, default="mean", help="how rollout fuses heads")
    p.add_argument("--discard-ratio", type=float, default=0.9,
                   help="fraction of the weakest attention per row that rollout drops (default 0.9)")
    add_option(p, "batch_size", default=64, help="images per forward pass")
    add_option(p, "cache_dir", help="where --data sets are cached")
    add_option(p, "download", help="let --data download a missing data set")
    add_option(p, "device", help="auto: CUDA when present")
    add_option(p, "precision", default="auto", help="the forward passes' precision (auto: a run folder's own, else "
               "bf16 where it pays for the model, as `vitlab eval` chooses)")
    add_option(p, "threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Claim the output folder (runs.folder.claim_folder), then analyse the model into it."""
    if args.num_images < 1:
        raise VitlabError(f"--num-images must be at least 1, got {args.num_images}")
    if not 0.0 <= args.discard_ratio < 1.0:
        raise VitlabError(f"--discard-ratio must lie in [0, 1), got {args.discard_ratio}")
    if args.faithfulness_images < 0:
        raise VitlabError(f"--faithfulness-images must be 0 or more, got {args.faithfulness_images}")
    if args.faithfulness_images and not args.data:
        raise VitlabError("--faithfulness-images needs --data SET: the perturbation test runs over a test split")
    if args.curve_steps < 1:
        raise VitlabError(f"--curve-steps must be at least 1, got {args.curve_steps}")
    if args.explorer_images < 1:
        raise VitlabError(f"--explorer-images must be at least 1, got {args.explorer_images}")
    from ..runs.folder import claim_folder
    out = Path(args.out) if args.out else Path(f"inspect_{Path(args.model).resolve().name}")
    with claim_folder(out, "inspect"):
        return _run(args, out)


def _run(args: argparse.Namespace, out: Path) -> int:
    """Load the model and the images, run every applicable analysis, write the figures and report.html."""
    started = time.time() - 1  # the files written from here on (mtimes of whole seconds included)
    from .. import load
    from ..analysis.capture import attention_modules
    from ..analysis.report import inspect_model
    from ..devices import autocast, resolve_device
    from ..infer.precision import inference_precision
    from ..runs.folder import check_model_written
    device = resolve_device(args.device)
    check_model_written(args.model)
    objective = _pretraining_objective(args.model)  # a pre-training run: its encoder, and its own section
    model = load(args.model).to(device) if objective is None else objective.to(device).encoder
    try:
        if not getattr(model, "no_attention", ""):
            attention_modules(model)
    except ValueError as e:
        raise VitlabError(f"{args.model}: {e}") from None
    cfg = model.pretrained_cfg
    input_size = tuple(int(s) for s in cfg["input_size"])
    mean, std = cfg["mean"], cfg["std"]
    fit = Preprocess.from_cfg(cfg).fit  # images are prepared by the model's own rule, as predict does

    labels = class_names = faith_set = faith_labels = None
    if args.images:
        C, H, W = input_size
        dist_set = torch.stack([read_image(f, (H, W), C, fit) for f in args.images])
        shown = dist_set[:args.num_images]
        names = [Path(f).name for f in args.images[:args.num_images]]
    else:
        from ..runs.format import read_split
        source = args.data or read_split(args.model).get("data")
        if source is None:
            if input_size != (1, 8, 8):
                raise VitlabError(f"{args.model} takes {'x'.join(map(str, input_size))} images: give --images FILE... "
                                  "or --data SET (digits, cifar10, an image folder or a .tar.gz)")
            source = "digits"  # the embedded 8x8 digits fit a 1-channel 8x8 model
        test_images, all_labels, class_names = _load_test_split(source, input_size, args, fit)
        if args.faithfulness_images > len(test_images):
            raise VitlabError(f"--faithfulness-images {args.faithfulness_images} is more than the "
                              f"{len(test_images)} test images of {source!r}")
        # test splits are often sorted by class: take the images with the classes in turn (a seeded order)
        pick = balanced_order(all_labels)[:max(args.faithfulness_images, args.distance_images, args.num_images)]
        rows, where = pick.sort()  # read the rows in file order (a mapped store), then put them in pick's order
        test_images, all_labels = test_images[rows][torch.argsort(where)], all_labels[pick]
        if args.faithfulness_images:
            faith_set = normalize(test_images[:args.faithfulness_images], mean, std)
            faith_labels = all_labels[:args.faithfulness_images].tolist()
        dist_set, all_labels = test_images[:args.distance_images], all_labels[:args.distance_images]
        shown, labels = dist_set[:args.num_images], all_labels[:args.num_images].tolist()
        names = [f"{Path(str(source)).name} test #{int(i)}" for i in pick[:len(shown)]]  # short, for figure titles
    if class_names is not None and len(class_names) != model.num_classes:
        class_names = None  # the data set's classes are not the model's
    precision = inference_precision(model, args.precision, device, args.model if objective is None else None)
    with autocast(device, precision):  # a bf16 model's report shows what that model computes
        report = inspect_model(model, normalize(shown, mean, std), out, image_names=names, labels=labels,
                               class_names=class_names, distance_images=normalize(dist_set, mean, std),
                               head_fusion=args.head_fusion, discard_ratio=args.discard_ratio,
                               batch_size=args.batch_size,
                               faithfulness_images=faith_set, faithfulness_labels=faith_labels,
                               curve_steps=args.curve_steps, explorer_images=args.explorer_images, objective=objective,
                               title=f"vitlab inspect: {Path(args.model).resolve().name}"
                                     + (f" ({model.arch})" if getattr(model, "arch", None) else ""))
    written = [p.name for p in sorted(out.glob("*.json")) if p.stat().st_mtime >= started]  # not an earlier run's
    print(f"vitlab inspect: wrote {report} ({report.stat().st_size / 1e6:.1f} MB, self-contained), "
          f"{', '.join(written)} and {len(list(out.glob('*.png')))} figures in {out}")
    return 0
