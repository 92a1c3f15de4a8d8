"""What the attention explorer costs in report.html: bytes per image for a 14x14-patch, 12-block, 12-head model.

    python benchmarks/report_size.py [--model vit_base_patch16_224] [--width 192] [--images 4] [--checkpoint FOLDER]

Random weights by default (attention close to uniform; a trained model's peaked attention
compresses better, so this is the harder case). Prints a table.
"""
from __future__ import annotations

import argparse
import base64
import time

import torch

import vitlab
from vitlab.analysis import attention_maps, explain, explanation_methods
from vitlab.analysis.faithfulness import method_key
from vitlab.analysis.interactive import explorer_data, explorer_html
from vitlab.analysis.plots import display_images


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--checkpoint", default=None, help="a model folder vitlab.load reads, instead of random weights")
    p.add_argument("--width", type=int, default=None,
                   help="embedding width instead of the model's (the attention's size does not depend on it)")
    p.add_argument("--images", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    kw = {"embed_dim": args.width} if args.width else {}
    model = (vitlab.load(args.checkpoint) if args.checkpoint else vitlab.create_model(args.model, **kw)).eval()
    C, H, W = model.pretrained_cfg["input_size"]
    x = torch.randn(args.images, C, H, W)
    t0 = time.perf_counter()
    maps = attention_maps(model, x)
    pred = model(x).argmax(-1)
    methods = {method_key(m, t): (f"{m} {t}", explain(model, x, m, pred, token=t))
               for m, t in explanation_methods(model)}
    shown = display_images(x, (0.5,) * C, (0.5,) * C)
    data = {bits: explorer_data(maps, shown, [f"image {i}" for i in range(len(x))], [""] * len(x), methods,
                                bits=bits) for bits in (8, 4)}
    seconds = time.perf_counter() - t0
    b = maps[0]
    name = args.checkpoint or args.model + (f" (width {args.width})" if args.width else "")
    print(f"model {name}: {len(maps)} blocks x {b.num_heads} heads, "
          f"{b.grid_size[0]}x{b.grid_size[1]} patches + {b.num_prefix} prefix token(s), {len(x)} images, "
          f"built in {seconds:.1f} s")
    values = sum(m.attn[0].numel() for m in maps)
    maxima = sum(4 * m.attn.shape[1] * m.attn.shape[2] for m in maps)  # float32 row maxima
    print("| per image (bytes) | 8 bits | 4 bits |")
    print("| --- | ---: | ---: |")
    print(f"| float32 attention (what the model holds) | {4 * values:,} | {4 * values:,} |")
    print(f"| quantised rows + float32 row maxima | {values + maxima:,} | {(values + 1) // 2 + maxima:,} |")
    packed = {bits: [len(base64.b64decode(a)) for a in d["attention"]] for bits, d in data.items()}
    print(f"| zlib-compressed (mean of {len(x)}) | {sum(packed[8]) // len(x):,} | {sum(packed[4]) // len(x):,} |")
    print("| base64 in the page (mean) | "
          + " | ".join(f"{sum(map(len, data[bits]['attention'])) // len(x):,}" for bits in (8, 4)) + " |")
    print(f"| the whole explorer section, {len(x)} images, maps, script | "
          + " | ".join(f"{len(explorer_html(data[bits]).encode()):,}" for bits in (8, 4)) + " |")


if __name__ == "__main__":
    main()
