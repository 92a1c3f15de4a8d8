"""``vitlab eval`` and ``vitlab predict``: a model on a data set's test split, or on image files."""
from __future__ import annotations

import argparse
import json
import sys

from ..devices import BF16_CPU_MIN_MACS_INFERENCE, PREDICT_BATCH
from . import add_command
from .options import add_option, integer

DATA_HELP = "digits, cifar10, cifar100, an image folder or a .tar.gz"
DEVICE_HELP = "auto: CUDA when present"
AUTO_HELP = ("auto: a run folder's own (its summary's figures), else bf16 where it pays for the model (a GPU that has "
             f"it; a CPU with AMX, from ~{BF16_CPU_MIN_MACS_INFERENCE / 1e9:g} GMACs an image), else fp32")


def register(sub: argparse._SubParsersAction) -> None:
    e = add_command(sub, "eval")
    e.add_argument("model", help="model folder (vitlab run, timm or Hugging Face)")
    add_option(e, "data", default=None, help=DATA_HELP + "; default: a run folder's own data set and split")
    e.add_argument("--out", help="folder for summary.json and confusion.png")
    add_option(e, "batch_size", default=None, help="images per forward pass (default: 64 on a CPU, 256 on a GPU)")
    add_option(e, "precision", default="auto", help=AUTO_HELP)
    add_option(e, "device", help=DEVICE_HELP)
    add_option(e, "cache_dir")
    add_option(e, "download", help="download CIFAR if missing (checksums verified)")
    add_option(e, "tta", help="average each image's logits with its mirror image's")
    add_option(e, "tta_translate")
    add_option(e, "threads")
    e.set_defaults(func=run_eval)

    pr = add_command(sub, "predict")
    pr.add_argument("model", help="model folder (vitlab run, timm or Hugging Face) or hf-hub:ORG/NAME[@REV]")
    pr.add_argument("images", nargs="+", help="image files")
    pr.add_argument("--top-k", type=integer(1), default=5, help="classes shown per image [an integer >= 1; default 5]")
    pr.add_argument("--json", action="store_true", help="print JSON")
    add_option(pr, "device", help=DEVICE_HELP)
    add_option(pr, "batch_size", default=PREDICT_BATCH, help="images per forward pass")
    add_option(pr, "precision", default="auto", help=AUTO_HELP)
    add_option(pr, "threads")
    pr.set_defaults(func=run_predict)


def run_eval(args: argparse.Namespace) -> int:
    from ..infer.eval import evaluate_folder
    result = evaluate_folder(args.model, args.data, out=args.out, batch_size=args.batch_size,
                             precision=args.precision, cache_dir=args.cache_dir, download=args.download,
                             tta=args.tta, device=args.device, tta_translate=args.tta_translate)
    from ..metrics import top_k_text
    for head, m in result["heads"].items():
        print(f"{head:>6}: top-1 {100 * m['top1']:.2f}%  {top_k_text(m['per_class'])} {100 * m['top5']:.2f}%  "
              f"({m['count']} images)")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    from ..infer.predict import predict_files
    results = predict_files(args.model, args.images, top_k=args.top_k, device=args.device,
                            precision=args.precision, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(r["image"] + ("  (not predicted: unreadable)" if "error" in r else ""))
            for p in r.get("top", []):
                print(f"  {100 * p['probability']:6.2f}%  {p['class']}")
    bad = [r for r in results if "error" in r]
    for r in bad:
        print(f"vitlab predict: error: {r['error']}", file=sys.stderr)
    if bad:
        print(f"vitlab predict: {len(bad)} of {len(results)} images could not be read; the others are predicted",
              file=sys.stderr)
    return 1 if bad else 0
