"""Pre-training throughput: MAE (and masked patch prediction) against supervised training of the same encoder.

Every variant runs the same step on the same batch: forward, loss, backward, AdamW. Supervised is
the plain model with cross-entropy on labels; MAE runs the encoder on the visible patches only
(a quarter of them at the default 75% masking) and a light decoder on all of them; MPP runs the
encoder on every patch, as the ViT paper's objective does. Variants are interleaved, after a few
warm-up steps, and the median of the timed rounds is reported, because the machine may be shared.

    python benchmarks/bench_pretrain.py [--models vit_tiny_patch4_32:64,vit_small_patch16_224:8] [--rounds 7]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import vitlab
from vitlab.objectives import create_objective


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or what platform knows)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def step_fn(module: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One training step: forward + loss, backward, AdamW."""
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.05)

    def step() -> None:
        loss = loss_of()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def variants(name: str, batch: int, mask_ratio: float,
             decoders: list[tuple[float, int]]) -> dict[str, Callable[[], None]]:
    """Step functions by label, each on its own copy of the encoder (same seed), sharing one batch.

    ``decoders``: extra MAE decoders to time besides the default, as (width / encoder width, depth).
    """
    torch.manual_seed(0)
    model = vitlab.create_model(name).train()
    x = torch.randn(batch, *model.pretrained_cfg["input_size"])
    labels = torch.randint(0, model.num_classes, (batch,))
    out = {"supervised": step_fn(model, lambda: F.cross_entropy(model(x), labels))}
    for width, depth in [(None, None), *decoders]:
        torch.manual_seed(0)
        dim = None if width is None else int(model.embed_dim * width) // 32 * 32
        mae = create_objective("mae", vitlab.create_model(name), mask_ratio=mask_ratio, decoder_dim=dim,
                               decoder_depth=depth).train()
        label = f"mae, decoder {mae.decoder.embed.out_features}x{len(mae.decoder.blocks)}"
        out[label + (" (default)" if width is None else "")] = step_fn(mae, lambda mae=mae: mae(x).loss)
    torch.manual_seed(0)
    mpp = create_objective("mpp", vitlab.create_model(name)).train()
    out["mpp"] = step_fn(mpp, lambda: mpp(x).loss)
    return out


def measure(steps: dict[str, Callable[[], None]], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each variant, rounds interleaved."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit_tiny_patch4_32:64,vit_small_patch16_224:8",
                    help="comma-separated MODEL:BATCH pairs")
    ap.add_argument("--mask-ratio", type=float, default=0.75)
    ap.add_argument("--decoders", default="1x2,1x4",
                    help="extra MAE decoders to time, as WIDTH_FACTORxDEPTH (width relative to the encoder's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    decoders = [(float(w), int(d)) for w, d in (spec.split("x") for spec in args.decoders.split(",") if spec)]
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; float32; "
          f"mask ratio {args.mask_ratio}; median of {args.rounds} steps after {args.warmup} warm-up")
    print(f"{'model':<24} {'batch':>5}  {'objective':<32} {'ms/step':>9} {'img/s':>8} {'vs supervised':>14}")
    for spec in args.models.split(","):
        name, batch = spec.split(":")
        secs = measure(variants(name, int(batch), args.mask_ratio, decoders), args.rounds, args.warmup)
        base = secs["supervised"]
        for label, s in secs.items():
            print(f"{name:<24} {batch:>5}  {label:<32} {s * 1e3:>9.1f} {int(batch) / s:>8.1f} {base / s:>13.2f}x")


if __name__ == "__main__":
    main()
