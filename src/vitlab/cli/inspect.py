"""``vitlab inspect MODEL``: the ViT paper's analyses of any model, as figures and one report.html."""
from __future__ import annotations

import argparse

from ..analysis.inspect_api import DISTANCE_IMAGES, IMPORTANCE_IMAGES, NUM_IMAGES, inspect
from ..analysis.rollout import HEAD_FUSIONS
from . import add_command
from .options import add_option, integer


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
    p.add_argument("--num-images", type=integer(1), default=NUM_IMAGES,
                   help=f"images shown in the figures (default {NUM_IMAGES})")
    p.add_argument("--distance-images", type=integer(1), default=DISTANCE_IMAGES,
                   help=f"images of --data the mean attention distance averages over (default {DISTANCE_IMAGES})")
    p.add_argument("--importance-images", type=integer(1), default=IMPORTANCE_IMAGES,
                   help="of those, the images head importance averages over, a pass per head each "
                        f"(default {IMPORTANCE_IMAGES})")
    p.add_argument("--faithfulness-images", type=integer(0), default=0, metavar="N",
                   help="measure deletion/insertion and the perturbation test over N images of --data's "
                        "test split, against their labels, with a progress bar (default 0: the shown images only)")
    p.add_argument("--curve-steps", type=integer(1), default=16,
                   help="points of the deletion and insertion curves after the first (default 16)")
    p.add_argument("--explorer-images", type=integer(1), default=4,
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
    """Analyse the model into its output folder (vitlab.inspect, which checks the options and claims the folder)."""
    found = inspect(args.model, args.data, images=args.images, out=args.out, num_images=args.num_images,
                    distance_images=args.distance_images, importance_images=args.importance_images,
                    faithfulness_images=args.faithfulness_images,
                    curve_steps=args.curve_steps, explorer_images=args.explorer_images, head_fusion=args.head_fusion,
                    discard_ratio=args.discard_ratio, batch_size=args.batch_size, precision=args.precision,
                    device=args.device, cache_dir=args.cache_dir, download=args.download)
    figures = sum(f.endswith(".png") for f in found.files)
    print(f"vitlab inspect: wrote {found.report} ({found.report.stat().st_size / 1e6:.1f} MB, self-contained), "
          f"{', '.join(f for f in found.files if f.endswith('.json'))} and {figures} figures in {found.out}")
    return 0
