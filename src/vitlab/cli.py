"""The ``vitlab`` command: a thin layer that parses arguments and calls the library."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# train options -> Recipe fields (None = not given, so a --config recipe or the default decides)
TRAIN_OPTIONS = [
    ("--model", str, "registered model name (see `vitlab models`)"),
    ("--init", str, "fine-tune from a model folder (vitlab run, timm or Hugging Face)"),
    ("--data", str, "digits (embedded), cifar10, cifar100, an image folder or a .tar.gz of one"),
    ("--epochs", int, "epochs to train"),
    ("--time-budget", float, "minutes: lay the schedule out over wall-clock time and end within it"),
    ("--batch-size", int, "global batch size"),
    ("--lr", float, "peak learning rate"),
    ("--min-lr", float, "final learning rate of the cosine"),
    ("--warmup", float, "share of the schedule spent in linear warmup"),
    ("--weight-decay", float, "AdamW weight decay (not on norms, biases, position embeddings, tokens)"),
    ("--clip-grad", float, "gradient norm clipping (0 = off)"),
    ("--drop-path", float, "stochastic depth rate"),
    ("--ema-decay", float, "EMA of the weights (0 = off, e.g. 0.999)"),
    ("--early-stop", int, "stop after N evaluations without improvement (0 = off)"),
    ("--plateau-patience", int, "halve the lr after N evaluations without improvement (0 = off)"),
    ("--plateau-factor", float, "lr factor on a plateau"),
    ("--eval-every", int, "epochs between evaluations"),
    ("--img-size", int, "input size (model and data)"),
    ("--progressive-scale", float, "progressive resizing: start at this share of the input size (1 = off)"),
    ("--progressive-until", float, "share of the schedule by which the input grows to full size"),
    ("--crop", str, "pad | rrc | none"),
    ("--padding", int, "padding of the random crop"),
    ("--auto-augment", str, "trivial | rand | none"),
    ("--random-erasing", float, "random erasing probability"),
    ("--mixup", float, "mixup alpha (0 = off)"),
    ("--cutmix", float, "cutmix alpha (0 = off)"),
    ("--label-smoothing", float, "label smoothing"),
    ("--repeated-aug", int, "repeated augmentation count (1 = off)"),
    ("--teacher", str, "teacher model folder for distillation"),
    ("--distill", str, "hard | soft (with --teacher)"),
    ("--tau", float, "soft distillation temperature"),
    ("--alpha", float, "distillation loss weight"),
    ("--precision", str, "auto | bf16 | fp32"),
    ("--device", str, "auto | cpu | cuda"),
    ("--threads", int, "CPU threads"),
    ("--seed", int, "random seed"),
    ("--cache-dir", str, "where decoded data sets are cached"),
    ("--val-fraction", float, "held-out share for data without a test split"),
]
TRAIN_FLAGS = [("--hflip", "random horizontal flips"), ("--download", "download CIFAR if missing"),
               ("--freeze-backbone", "train only the head(s): a linear probe"), ("--compile", "torch.compile"),
               ("--tta", "test-time augmentation: evaluate on each image and its mirror image")]


def parse_model_args(items: list[str]) -> dict:
    """KEY=VALUE strings, values read as YAML (numbers, lists, booleans), into a dict."""
    import yaml
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-arg {item!r} is not KEY=VALUE (e.g. depth=6)")
        out[key.strip()] = yaml.safe_load(value)
    return out


def cmd_models(args: argparse.Namespace) -> int:
    from .models.summary import model_table
    print(model_table(args.pattern))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train import load_recipe, train
    from .train.trainer import CONFIG_YAML
    if args.resume:
        folder = Path(args.resume)
        if not (folder / CONFIG_YAML).is_file():
            raise FileNotFoundError(f"{folder} is not a run folder: it has no {CONFIG_YAML}")
        recipe = load_recipe(folder / CONFIG_YAML, out=str(folder))
    else:
        given = {o[0][2:].replace("-", "_"): getattr(args, o[0][2:].replace("-", "_")) for o in TRAIN_OPTIONS}
        given.update({f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_")) for f, _ in TRAIN_FLAGS})
        if args.model_arg:
            given["model_args"] = parse_model_args(args.model_arg)
        recipe = load_recipe(args.config, out=args.out, **given)
    summary = train(recipe, resume=bool(args.resume))
    if summary:
        print(f"test top-1 {100 * summary['top1']:.2f}%  top-5 {100 * summary['top5']:.2f}%  "
              f"{summary['wall_seconds']:.0f} s  -> {recipe.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .train.predict import evaluate_folder
    result = evaluate_folder(args.model, args.data, out=args.out, batch_size=args.batch_size,
                             precision=args.precision, cache_dir=args.cache_dir, download=args.download,
                             tta=args.tta)
    for head, m in result["heads"].items():
        print(f"{head:>6}: top-1 {100 * m['top1']:.2f}%  top-5 {100 * m['top5']:.2f}%  ({m['count']} images)")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from .train.predict import predict_files
    results = predict_files(args.model, args.images, top_k=args.top_k)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(r["image"])
            for p in r["top"]:
                print(f"  {100 * p['probability']:6.2f}%  {p['class']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export
    path = export(args.model, args.to, args.out, check=not args.no_check)
    print(f"{args.model} -> {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .train.compare import compare, format_table
    rows = compare(args.runs, out=args.out)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "history"} for r in rows], indent=2))
    else:
        print(format_table(rows))
        print(f"curves: {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="vitlab", description="Build, train, distil and understand Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vitlab {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    m = sub.add_parser("models", help="list models with parameters and GFLOPs")
    m.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'vit_*' or cifar")
    m.set_defaults(func=cmd_models)

    t = sub.add_parser("train", help="train (or fine-tune, or distil) a model and write a run folder",
                       description="Train a model; options override the --config recipe, which overrides defaults.")
    t.add_argument("--config", help="YAML recipe (see recipes/)")
    t.add_argument("--out", help="run folder to write")
    t.add_argument("--resume", metavar="DIR", help="continue the unfinished run in DIR")
    t.add_argument("--model-arg", action="append", metavar="KEY=VALUE", default=None,
                   help="model argument override, repeatable (e.g. depth=6, widths=[32,64,128,256])")
    for flag, typ, help_ in TRAIN_OPTIONS:
        t.add_argument(flag, type=typ, default=None, help=help_)
    for flag, help_ in TRAIN_FLAGS:
        t.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a model on a data set's test split (metrics and plots)")
    e.add_argument("model", help="model folder (vitlab run, timm or Hugging Face)")
    e.add_argument("--data", required=True, help="digits, cifar10, cifar100, an image folder or a .tar.gz")
    e.add_argument("--out", help="folder for summary.json and confusion.png")
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="fp32")
    e.add_argument("--cache-dir")
    e.add_argument("--download", action="store_true")
    e.add_argument("--tta", action="store_true", help="average each image's logits with its mirror image's")
    e.set_defaults(func=cmd_eval)

    pr = sub.add_parser("predict", help="top-k classes for image files")
    pr.add_argument("model", help="model folder (vitlab run, timm or Hugging Face) or hf-hub:ORG/NAME[@REV]")
    pr.add_argument("images", nargs="+", help="image files")
    pr.add_argument("--top-k", type=int, default=5)
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.set_defaults(func=cmd_predict)

    x = sub.add_parser("export", help="write a model as ONNX, a timm Hub folder or a Hugging Face folder")
    x.add_argument("model", help="anything vitlab.load reads: a model folder, a run folder or hf-hub:ORG/NAME")
    x.add_argument("--to", required=True, choices=("onnx", "timm", "hf"), help="the format to write")
    x.add_argument("--out", required=True, help="folder to write")
    x.add_argument("--no-check", action="store_true", help="ONNX: skip the onnxruntime comparison with PyTorch")
    x.set_defaults(func=cmd_export)

    c = sub.add_parser("compare", help="a table of run folders and their curves in one figure")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders (finished or not)")
    c.add_argument("--out", default="compare.png", help="figure to write (default: compare.png here)")
    c.add_argument("--json", action="store_true", help="print the table as JSON")
    c.set_defaults(func=cmd_compare)

    from .analysis.command import register as register_inspect
    register_inspect(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"vitlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
