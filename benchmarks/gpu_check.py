"""GPU check: correctness and speed of vitlab on a CUDA machine, in one table.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--data ../shared/data/cifar10-jpg.tar.gz] [--skip-cifar]
        [--only tests smoke torchrun cifar throughput] [--models NAME ...] [--work DIR]

1. the device tests (tests/test_device.py) and a real CUDA smoke test: train (bf16, fp16 with its
   gradient scaler, gradient accumulation with torch.compile), evaluate and predict on the GPU;
2. a one-GPU torchrun training (NCCL for the data, gloo for the control messages);
3. the GPU CIFAR-10 recipe (recipes/cifar10_gpu.yaml): time to 90% and 94% test top-1, final top-1;
4. training throughput and model FLOP utilisation (MFU) of ViT-S/16 and ViT-B/16 at 224x224, bf16,
   batch 256, eager and compiled, beside timm's on the same weights when timm is installed.

--only runs the named checks in that order (a short lease: the ones that matter first). Measured: docs/gpu.md.
Exits 1 when any check fails (after printing the table); on a machine without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from the tree: the throughput check imports vitlab itself
# dense bf16 peak (TFLOP/s) by device name; --peak-tflops overrides
PEAK_BF16 = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
             "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0}


CHECKS = ("tests", "smoke", "torchrun", "cifar", "throughput")


def vitlab_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitlab", *args]


def tree_env(**env: str) -> dict[str, str]:
    """The environment with the tree's src first on the path (and whatever PYTHONPATH already held)."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1", **env}


def run(cmd: list[str], timeout: float, **env: str) -> str:
    """Run a command from the project root with src on the path; raise with its output's tail when it fails."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=tree_env(**env))
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def summary_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def check_device_tests() -> str:
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device.py"], 900)
    return out.strip().splitlines()[-1]


def check_cuda_smoke(tmp: Path, device: str, epochs: int) -> str:
    """Real runs on the GPU of every path the fake-device tests cover piece by piece."""
    common = ["--data", "digits", "--device", device, "--cache-dir", str(tmp / "cache"), "--threads", "4",
              "--epochs", str(epochs)]
    variants = [("bf16", ["--precision", "bf16"]), ("fp16", ["--precision", "fp16"]),
                ("accum+compile", ["--accum-steps", "2", "--compile", "--ema-decay", "0.99"])]
    results = []
    for name, extra in variants if device == "cuda" else variants[:1]:
        out = tmp / f"smoke-{name}"
        run(vitlab_cmd("train", *common, *extra, "--out", str(out)), 900)
        s = summary_of(out)
        if not s["device"].startswith(device) or s["top1"] < 0.8:
            raise RuntimeError(f"{name}: expected a {device} run over 80% on digits, got {s['device']} {s['top1']:.3f}")
        results.append(f"{name} {100 * s['top1']:.1f}%")
    ev = tmp / "smoke-eval"
    run(vitlab_cmd("eval", str(tmp / "smoke-bf16"), "--data", "digits", "--device", device, "--precision", "auto",
                   "--cache-dir", str(tmp / "cache"), "--out", str(ev)), 300)
    e = summary_of(ev)
    if abs(e["top1"] - summary_of(tmp / "smoke-bf16")["top1"]) > 0.02:
        raise RuntimeError(f"eval on the GPU gives {e['top1']:.4f}, the run's own figure was different")
    from PIL import Image
    img = tmp / "digit.png"
    Image.new("L", (8, 8), 128).save(img)
    proc = subprocess.run(vitlab_cmd("predict", str(tmp / "smoke-bf16"), str(img), "--json", "--device", device),
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=tree_env())
    top = json.loads(proc.stdout)[0]["top"] if proc.returncode == 0 else None
    probs = [p["probability"] for p in top] if top else []
    if not probs or probs != sorted(probs, reverse=True) or not 0 < sum(probs) <= 1 + 1e-3:
        raise RuntimeError(f"predict on the GPU failed or gave no probabilities:\n{proc.stderr[-2000:]}")
    run(vitlab_cmd("inspect", str(tmp / "smoke-bf16"), "--data", "digits", "--device", device, "--num-images", "4",
                   "--distance-images", "64", "--faithfulness-images", "64", "--cache-dir", str(tmp / "cache"),
                   "--out", str(tmp / "smoke-inspect")), 900)
    if not (tmp / "smoke-inspect" / "report.html").is_file():
        raise RuntimeError("inspect on the GPU wrote no report.html")
    return ", ".join(results) + f"; eval {100 * e['top1']:.1f}%; predict top-1 {top[0]['class']}; inspect ok"


def check_torchrun(tmp: Path, device: str) -> str:
    out = tmp / "torchrun"
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "vitlab", "train",
         "--data", "digits", "--device", device, "--time-budget", "0.5",
         "--cache-dir", str(tmp / "cache"), "--out", str(out)], 900)
    s = summary_of(out)
    if s["processes"] != 1 or not s["replicas_in_sync"]:
        raise RuntimeError(f"torchrun summary: {s}")
    return f"{'NCCL' if device == 'cuda' else 'gloo'}, 1 process, {100 * s['top1']:.1f}% in {s['train_seconds']:.0f} s"


def check_cifar(tmp: Path, data: str, device: str) -> str:
    out = tmp / "cifar10-gpu"
    t0 = time.perf_counter()
    dry = [] if device == "cuda" else ["--device", "cpu", "--time-budget", "1", "--no-compile", "--eval-every", "1"]
    run(vitlab_cmd("train", "--config", "recipes/cifar10_gpu.yaml", "--data", data, "--cache-dir",
                   str(tmp / "cache"), "--out", str(out), *dry), 1800)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    s = summary_of(out)

    def time_to(target: float) -> str:
        hit = next((r for r in rows if r.get("test_top1", 0) >= target), None)
        return f"{hit['elapsed_seconds']:.0f} s" if hit else "not reached"
    text = (f"final {100 * s['top1']:.2f}% in {s['train_seconds']:.0f} s of training ({wall:.0f} s wall); "
            f"to 90%: {time_to(0.90)}; to 94%: {time_to(0.94)}; {s['images_per_second']:.0f} img/s")
    if s["train_seconds"] > 300 or s["top1"] < 0.94:
        raise RuntimeError("target 94% within 300 s not met: " + text)
    return text


def step_throughput(model: torch.nn.Module, batch: int, compiled: bool, steps: int) -> float:
    """Training images/s: bf16 autocast, fused AdamW, synthetic data already on the GPU."""
    model = model.cuda().train()
    net = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t)


def check_throughput(peak_tflops: float, names: list[str], steps: int) -> list[tuple[str, str, str]]:
    import vitlab
    from vitlab.models.summary import count_flops
    try:
        import timm
    except ImportError:
        timm = None
    rows = []
    for name in names:
        flops = 3 * count_flops(vitlab.create_model(name), (3, 224, 224))  # forward + backward (2x forward)
        reference = vitlab.create_model(name)
        for mode in ("eager", "compiled"):
            cells = []
            for impl in ("vitlab", "timm"):
                if impl == "timm" and timm is None:
                    cells.append("timm not installed")
                    continue
                if impl == "vitlab":
                    model = vitlab.create_model(name)
                else:
                    model = timm.create_model(name)
                model.load_state_dict(reference.state_dict())  # the same weights (timm's key names)
                rate = step_throughput(model, 256, mode == "compiled", steps)
                cells.append(f"{impl} {rate:,.0f} img/s, MFU {100 * rate * flops / (peak_tflops * 1e12):.1f}%")
                del model
                torch.cuda.empty_cache()
            rows.append((f"{name} train {mode}", "ok", "; ".join(cells)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "cifar10-jpg.tar.gz"))
    ap.add_argument("--skip-cifar", action="store_true", help="skip the CIFAR-10 recipe (minutes)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS),
                    help="run only these checks, in this order (a short lease: the ones that matter first)")
    ap.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "vit_base_patch16_224"],
                    help="models of the throughput check")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each throughput measurement")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of the script itself (smoke runs only, no throughput)")
    ap.add_argument("--smoke-epochs", type=int, default=60, help="epochs of each digits smoke run")
    ap.add_argument("--work", type=Path, help="keep the checks' runs in this folder (default: a temporary one)")
    args = ap.parse_args()
    if args.device == "cpu":
        args.skip_throughput = True
    elif not torch.cuda.is_available():
        print(f"no CUDA device visible to PyTorch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}); "
              "nothing to check here")
        return 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16.items() if k in name), None)
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"bf16 peak {peak or '?'} TFLOP/s{'' if args.peak_tflops else ' (by name)'}", flush=True)
    rows: list[tuple[str, str, str]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="vitlab-gpu-check-") as tmp_name:
        tmp = Path(tmp_name) if args.work is None else args.work
        tmp.mkdir(parents=True, exist_ok=True)
        every = {"tests": ("device tests", check_device_tests),
                 "smoke": ("train/eval/predict", lambda: check_cuda_smoke(tmp, args.device, args.smoke_epochs)),
                 "torchrun": ("torchrun", lambda: check_torchrun(tmp, args.device)),
                 "cifar": ("CIFAR-10 recipe", lambda: check_cifar(tmp, args.data, args.device)),
                 "throughput": ("throughput", lambda: check_throughput(peak or float("nan"), args.models, args.steps))}
        skipped = {k for k, skip in (("cifar", args.skip_cifar), ("throughput", args.skip_throughput)) if skip}
        for key in [k for k in args.only if k not in skipped]:
            label, fn = every[key]
            t = time.perf_counter()
            try:
                result = fn()  # one detail, or rows of their own (the throughput's, a row per model and mode)
                seconds = time.perf_counter() - t
                new = result if isinstance(result, list) else [(label, "ok", f"{result} [{seconds:.0f} s]")]
            except Exception as e:  # noqa: BLE001 - every failure goes into the table, then exit 1
                failed = True
                new = [(label, "FAILED", str(e).strip().splitlines()[0][:300])]
                traceback.print_exc()
            rows += new
            for row in new:
                print(f"{row[0]}: {row[1]} {row[2]}", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  {'result':<6}  detail")
    for label, result, detail in rows:
        print(f"{label:<{width}}  {result:<6}  {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
