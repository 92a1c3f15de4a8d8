"""bf16 autocast against float32 per model on this machine: training-step and inference images a second.

The models span the work per image that decides whether bf16 pays on a CPU (`--precision auto`'s rule in
vitlab.devices): the 8x8 digits model of `make run`, a ViT-Ti/4 at 32x32, the CIFAR speed run's hybrid
(recipes/cifar10_hybrid_speedrun.yaml), ViT-S/16 and ViT-B/16 at 224. A training step is forward, cross-entropy,
backward and AdamW on the same weights and batch; inference is the eval-mode forward without gradients. The two
precisions are interleaved in one process, round after round, and the median of the rounds is printed with the
bf16/float32 ratio (above 1: bf16 is faster), because a shared machine is noisy.

    python benchmarks/bench_precision.py [--rounds 5] [--threads 2] [--only vit_base_patch16_224 ...]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import vitlab
from vitlab.devices import BF16_CPU_FLAG, autocast, cpu_flags, cpu_name
from vitlab.models.summary import matmul_macs

SPEEDRUN_HYBRID = dict(stem_widths=(64, 256, 256), stem_pad=False, depth=2, embed_dim=256, num_heads=4)


@dataclass
class Case:
    label: str
    model: str
    batch: int  # the training batch; inference runs twice as many images a pass
    steps: int  # training steps (and inference passes) a round
    args: dict = field(default_factory=dict)


CASES = [
    Case("digits (vit_micro_patch2_8, 8x8)", "vit_micro_patch2_8", 128, 8),
    Case("ViT-Ti/4 at 32 (vit_tiny_patch4_32)", "vit_tiny_patch4_32", 64, 3),
    Case("speed-run hybrid (vit_nano_airbench_32)", "vit_nano_airbench_32", 64, 3, SPEEDRUN_HYBRID),
    Case("ViT-S/16 at 224 (vit_small_patch16_224)", "vit_small_patch16_224", 8, 1),
    Case("ViT-B/16 at 224 (vit_base_patch16_224)", "vit_base_patch16_224", 8, 1),
]


def timed(fn: Callable[[str], None], precision: str, images: int) -> float:
    """Images a second of one call of ``fn`` in ``precision`` that handles ``images`` images."""
    t = time.perf_counter()
    fn(precision)
    return images / (time.perf_counter() - t)


def measure(case: Case, rounds: int) -> dict[str, float]:
    """Median images a second of each (kind, precision), the precisions interleaved round by round."""
    torch.manual_seed(0)
    model = vitlab.create_model(case.model, **case.args)
    c, h, w = model.pretrained_cfg["input_size"]
    x, y = torch.randn(case.batch, c, h, w), torch.randint(0, model.num_classes, (case.batch,))
    x_eval = torch.randn(2 * case.batch, c, h, w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    device = x.device

    def train(precision: str) -> None:
        model.train()
        for _ in range(case.steps):
            with autocast(device, precision):
                loss = F.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    @torch.no_grad()
    def infer(precision: str) -> None:
        model.eval()
        for _ in range(case.steps):
            with autocast(device, precision):
                model(x_eval)

    kinds = {"train": (train, case.batch * case.steps), "infer": (infer, 2 * case.batch * case.steps)}
    rates: dict[str, list[float]] = {f"{k} {p}": [] for k in kinds for p in ("fp32", "bf16")}
    for p in ("fp32", "bf16"):  # warm-up: the first calls allocate and pick kernels
        for fn, _ in kinds.values():
            fn(p)
    for _ in range(rounds):
        for k, (fn, n) in kinds.items():
            for p in ("fp32", "bf16"):
                rates[f"{k} {p}"].append(timed(fn, p, n))
    result = {key: statistics.median(v) for key, v in rates.items()}
    result["gmacs"] = matmul_macs(model) / 1e9
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is printed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", metavar="MODEL", help="measure only these registered names")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    amx = "AMX (amx_bf16)" if BF16_CPU_FLAG in cpu_flags() else "no AMX"
    print(f"CPU: {cpu_name()}, {amx}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds; img/s, bf16/float32 ratio")
    header = ("model", "GMACs/img", "batch", "train fp32", "train bf16", "ratio", "infer fp32", "infer bf16", "ratio")
    rows = [header]
    for case in CASES:
        if args.only and case.model not in args.only:
            continue
        r = measure(case, args.rounds)
        rows.append((case.label, f"{r['gmacs']:.3g}", str(case.batch),
                     f"{r['train fp32']:.3g}", f"{r['train bf16']:.3g}", f"{r['train bf16'] / r['train fp32']:.2f}x",
                     f"{r['infer fp32']:.3g}", f"{r['infer bf16']:.3g}", f"{r['infer bf16'] / r['infer fp32']:.2f}x"))
        print(" | ".join(rows[-1]), flush=True)
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
