"""The ``vitlab`` command: a thin layer that parses arguments and calls the library."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# options of `vitlab train` that are not recipe fields
TRAIN_SKIP = ("model_args", "augment", "out")


def add_recipe_options(parser: argparse.ArgumentParser) -> None:
    """One option per recipe field (and per augmentation option), generated from their declarations.

    Values stay text here (None = not given): the recipe coerces and checks them, so a bad value on the
    command line gets the same one-line message as in a YAML recipe. Every boolean has --X and --no-X.
    """
    import typing

    import yaml

    from .train.recipe import AUGMENT_FIELDS, FIELDS, accepted

    def is_bool(annotation) -> bool:  # bool, bool | None, or the same as text (a dataclass's annotations)
        return annotation in (bool, "bool", "bool | None") or set(typing.get_args(annotation)) == {bool, type(None)}

    def is_text(annotation) -> bool:  # str, str | None, a choice of words
        return annotation in (str, "str") or str in typing.get_args(annotation) \
            or typing.get_origin(annotation) is typing.Literal

    def scalar(value: str):  # numbers as numbers (so an error shows 0, not '0'); 1e-3 stays text for the recipe
        parsed = yaml.safe_load(value)
        return parsed if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) else value

    def add(name: str, annotation, help_: str, default) -> None:
        flag = "--" + name.replace("_", "-")
        text = f"{help_} [{accepted(name)}; default {default!r}]".replace("%", "%%")  # argparse formats help with %
        if is_bool(annotation):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif "tuple" in str(annotation):
            parser.add_argument(flag, default=None, metavar="A,B", type=lambda v: v.split(","), help=text)
        else:
            parser.add_argument(flag, default=None, metavar=name.upper(), type=None if is_text(annotation) else scalar,
                                help=text)

    for name, info in FIELDS.items():
        if name not in TRAIN_SKIP:
            default = info.default_factory() if info.default_factory else info.default
            add(name, info.annotation, info.description or "", default)
    for name, f in AUGMENT_FIELDS.items():
        add(name, f.type, f.metadata["help"], f.default)


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
    from .train.runfolder import CONFIG_YAML
    if args.resume:
        folder = Path(args.resume)
        if not (folder / CONFIG_YAML).is_file():
            raise FileNotFoundError(f"{folder} is not a run folder: it has no {CONFIG_YAML}")
        recipe = load_recipe(folder / CONFIG_YAML, out=str(folder))
    else:
        from .train.recipe import AUGMENT_FIELDS, FIELDS
        given = {name: getattr(args, name) for name in [*FIELDS, *AUGMENT_FIELDS] if name not in TRAIN_SKIP}
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
                             tta=args.tta, device=args.device)
    for head, m in result["heads"].items():
        print(f"{head:>6}: top-1 {100 * m['top1']:.2f}%  top-5 {100 * m['top5']:.2f}%  ({m['count']} images)")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from .train.predict import predict_files
    results = predict_files(args.model, args.images, top_k=args.top_k, device=args.device)
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


def cmd_study(args: argparse.Namespace) -> int:
    from .train.study import STUDIES, run_study
    if args.list or not args.name:
        for name, s in STUDIES.items():
            print(f"{name:<11} {s.claim} ({s.source})")
        return 0 if args.list else 2
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--seeds {args.seeds!r} is not valid; accepted: integers >= 0 separated by commas, "
                         "e.g. 0,1") from None
    result = run_study(args.name, out=args.out, data=args.data, budget=args.budget, epochs=args.epochs,
                       seeds=seeds, jobs=args.jobs, threads=args.threads, quick=args.quick, cache_dir=args.cache_dir)
    print((Path(args.out) / f"{args.name}.md").read_text())
    print(f"table: {Path(args.out) / (args.name + '.md')}  figure: {Path(args.out) / (args.name + '.png')}")
    return 0 if result else 1


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
    add_recipe_options(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a model on a data set's test split (metrics and plots)")
    e.add_argument("model", help="model folder (vitlab run, timm or Hugging Face)")
    e.add_argument("--data", required=True, help="digits, cifar10, cifar100, an image folder or a .tar.gz")
    e.add_argument("--out", help="folder for summary.json and confusion.png")
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="fp32",
                   help="auto: bf16 on a GPU that supports it, else fp32")
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
    e.add_argument("--cache-dir")
    e.add_argument("--download", action="store_true")
    e.add_argument("--tta", action="store_true", help="average each image's logits with its mirror image's")
    e.set_defaults(func=cmd_eval)

    pr = sub.add_parser("predict", help="top-k classes for image files")
    pr.add_argument("model", help="model folder (vitlab run, timm or Hugging Face) or hf-hub:ORG/NAME[@REV]")
    pr.add_argument("images", nargs="+", help="image files")
    pr.add_argument("--top-k", type=int, default=5)
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
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

    st = sub.add_parser("study", help="a paper's claim as runs that differ in one factor: table, figure, answer",
                        description="Train every arm of a study (skipping finished ones, resuming unfinished "
                        "ones) and write OUT/NAME.md, .json and .png.")
    st.add_argument("name", nargs="?", help="pos-embed, data-scale, hybrid, distill or locality (--list)")
    st.add_argument("--list", action="store_true", help="list the studies and their claims")
    st.add_argument("--data", default="cifar10", help="data set (default cifar10; a .tar.gz or folder works)")
    st.add_argument("--budget", type=float, default=5.0, help="minutes of training per run (default 5)")
    st.add_argument("--epochs", type=int, help="epochs per run instead of a time budget")
    st.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    st.add_argument("--jobs", type=int, default=1, help="runs trained side by side, each on cores/jobs threads")
    st.add_argument("--threads", type=int, help="CPU threads per run (default: cores / jobs)")
    st.add_argument("--out", default="studies", help="folder for the runs and the results (default studies)")
    st.add_argument("--cache-dir", help="where decoded data sets are cached")
    st.add_argument("--quick", action="store_true", help="smoke run: digits, one epoch at 16x16 per run")
    st.set_defaults(func=cmd_study)

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
    except RuntimeError as e:
        if args.command != "study":
            raise
        print(f"vitlab study: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"vitlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"vitlab {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"vitlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
