"""``vitlab export``: a model as ONNX, a timm Hub folder or a Hugging Face folder."""
from __future__ import annotations

import argparse

from . import add_command
from .options import add_option


def register(sub: argparse._SubParsersAction) -> None:
    x = add_command(sub, "export")
    x.add_argument("model", help="anything vitlab.load reads: a model folder, a run folder or hf-hub:ORG/NAME")
    x.add_argument("--to", required=True, choices=("onnx", "timm", "hf"), help="the format to write")
    x.add_argument("--out", required=True, help="folder to write")
    x.add_argument("--no-check", action="store_true", help="ONNX: skip the onnxruntime comparison with PyTorch")
    add_option(x, "threads")
    x.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..export import export
    from ..runs.folder import claim_folder
    with claim_folder(args.out, "export"):
        path = export(args.model, args.to, args.out, check=not args.no_check, log=print)
    print(f"{args.model} -> {path}")
    return 0
