"""torch.compile (inductor) against eager on this CPU: a training step and inference, at 1 and 2 threads.

Models: ViT-S/16 at 224x224 (batch 8: what a CPU fine-tune takes) and the speed run's hybrid
(recipes/cifar10_hybrid_speedrun.yaml's model_args on vit_nano_airbench_32, 32x32, batch 128). The training step is
forward, cross-entropy, backward and AdamW on pre-made float tensors; inference is a forward pass without
gradients in eval mode. The compiled model's first call at each thread count is timed apart (the compile time:
dynamo guards on the thread count, so another count compiles again), then eager and compiled calls are
interleaved round by round in this one process and the median ratio is reported, because the machine is shared
and noisy. Break-even: the steps after which the compiled run has paid back its
compile time; "x after compile" is eager's time over compiled's time plus one compile, for a training run of
``--run-steps`` and for inference over ``--eval-images`` (CIFAR-10's test split: one ``vitlab eval``).

    python benchmarks/compile_speed.py [--rounds 5] [--threads 1 2] [--run-steps 1960 300] [--eval-images 10000]
        [--only CASE]
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import vitlab

HYBRID_ARGS = {"stem_widths": [64, 256, 256], "stem_pad": False, "depth": 2, "embed_dim": 256, "num_heads": 4}
CASES = {  # name: (model, its arguments, batch)
    "speed-run hybrid 32": ("vit_nano_airbench_32", HYBRID_ARGS, 128),
    "ViT-S/16 224": ("vit_small_patch16_224", {"num_classes": 10}, 8),
}


def cpu_name() -> str:
    try:
        line = next(s for s in Path("/proc/cpuinfo").read_text().splitlines() if s.startswith("model name"))
        flags = next(s for s in Path("/proc/cpuinfo").read_text().splitlines() if s.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown CPU"
    return f"{line.split(':', 1)[1].strip()}, amx={'yes' if 'amx_tile' in flags else 'no'}"


def steps(model: torch.nn.Module, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """(a training step, an inference pass) of ``net`` (``model``, compiled or not)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train():
        model.train()
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    @torch.no_grad()
    def infer():
        model.eval()
        net(x)
    return train, infer


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--run-steps", type=int, nargs="+", default=[1960, 300],
                    help="a default-length run's training steps for each case (the hybrid recipe: 10 epochs of 196; "
                         "ViT-S/16: a fine-tune of 300 steps)")
    ap.add_argument("--eval-images", type=int, default=10_000,
                    help="images an inference run passes (default: CIFAR-10's test split)")
    ap.add_argument("--only", choices=list(CASES), default=None)
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}, torch {torch.__version__}; eager and compiled interleaved, medians of {args.rounds}")
    print(f"{'case':<22}{'pass':<7}{'thr':>4}{'eager s':>9}{'compiled s':>11}{'ratio':>7}{'compile s':>10}"
          f"{'break-even':>11}{'run':>6}{'x after compile':>16}")
    for (name, (arch, kwargs, batch)), run_steps in zip(CASES.items(), args.run_steps):
        if args.only and name != args.only:
            continue
        torch.manual_seed(0)
        model = vitlab.create_model(arch, **kwargs)
        twin = copy.deepcopy(model)
        c, h, w = model.pretrained_cfg["input_size"]
        x, y = torch.randn(batch, c, h, w), torch.randint(0, model.num_classes, (batch,))
        compiled = torch.compile(twin, dynamic=False)
        eager_fns, compiled_fns = steps(model, model, x, y), steps(twin, compiled, x, y)
        for kind, e_fn, c_fn in zip(("train", "infer"), eager_fns, compiled_fns):
            length = run_steps if kind == "train" else math.ceil(args.eval_images / batch)
            for threads in args.threads:
                torch.set_num_threads(threads)  # dynamo guards on the thread count: another count compiles again
                compile_s = timed(c_fn)  # the first call at this count compiles (forward and backward, for training)
                print(f"# {name} {kind}, {threads} threads: first compiled call {compile_s:.1f} s", flush=True)
                e_fn(), c_fn()  # warm-up
                e_t, c_t = [], []
                for _ in range(args.rounds):
                    e_t.append(timed(e_fn))
                    c_t.append(timed(c_fn))
                e, cm = statistics.median(e_t), statistics.median(c_t)
                gain = e - cm
                even = f"{compile_s / gain:.0f}" if gain > 0 else "never"
                after = length * e / (length * cm + compile_s)
                print(f"{name:<22}{kind:<7}{threads:>4}{e:>9.3f}{cm:>11.3f}{e / cm:>7.2f}{compile_s:>10.1f}"
                      f"{even:>11}{length:>6}{after:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
