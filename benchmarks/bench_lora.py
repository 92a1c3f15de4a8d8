"""Fine-tuning step cost: full fine-tuning against LoRA against LoRA + gradient checkpointing (peak memory, img/s).

Each arm runs in a fresh subprocess (random weights, float32, AdamW, batch of random images at the model's size), so
the peak resident memory (``resource.getrusage`` maxrss) is the arm's own. img/s is the median over the timed steps,
after one warm-up step.

    python benchmarks/bench_lora.py [--models vit_base_patch16_224 vit_large_patch16_dinov3] [--batch 8] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import vitlab
from vitlab.devices import cpu_name
from vitlab.train.lora import apply_lora
from vitlab.train.recipe import load_recipe

ARMS = {"full": (0, False), "LoRA r8": (8, False), "LoRA r8 + checkpointing": (8, True)}


def arm(model_name: str, rank: int, checkpointing: bool, batch: int, steps: int) -> dict:
    """One arm in this process: the step's median img/s, the trainable parameters and the peak resident memory."""
    torch.manual_seed(0)
    model = vitlab.create_model(model_name, num_classes=10).train()
    if checkpointing:
        model.set_grad_checkpointing(True)
    if rank:
        apply_lora(model, load_recipe(None, lora=rank), lambda line: None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randn(batch, *model.pretrained_cfg["input_size"])
    y = torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"img_s": batch / statistics.median(times[1:]), "trainable": sum(p.numel() for p in params),
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["vit_base_patch16_224", "vit_large_patch16_dinov3"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm and print its JSON
    a = ap.parse_args()
    if a.arm:
        name, rank, ckpt = json.loads(a.arm)
        print(json.dumps(arm(name, rank, ckpt, a.batch, a.steps)))
        return
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; float32, batch {a.batch}, "
          f"median of {a.steps} steps after one warm-up, random weights")
    print("| model | arm | trainable parameters | peak memory (MiB) | img/s |\n|---|---|---:|---:|---:|")
    for name in a.models:
        for label, (rank, ckpt) in ARMS.items():
            out = subprocess.run([sys.executable, __file__, "--arm", json.dumps([name, rank, ckpt]), "--batch",
                                  str(a.batch), "--steps", str(a.steps)], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {name} | {label} | {r['trainable']:,} | {r['peak_mib']:,.0f} | {r['img_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
