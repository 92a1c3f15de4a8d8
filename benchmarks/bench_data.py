"""Data at scale: build a store from a generated image folder larger than 2 GB decoded, then train from it.

Prints: the store build's images/s; batch gathers (random rows) from the mapped store against the
same rows held in an in-memory tensor; and the training process's peak private memory (RssAnon in
/proc/PID/status, sampled every 20 ms; pages of the mapped store are the OS's cache and count as
RssFile, not RssAnon) over a few training steps (random resized crop to the training size,
forward, backward, AdamW), against the store's size. With --procs 2 the training runs under
torchrun (gloo on the CPU, NCCL on GPUs): every rank maps the same store file and the table adds
the ranks' combined peak.

    python benchmarks/bench_data.py [--images 11000] [--side 256] [--train-size 224] [--workers 2]
        [--steps 5] [--batch 64] [--procs 1|2] [--device cpu|cuda] [--root /tmp/vitlab-bench-data] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch


def rss_anon_kib(pid: int | str = "self") -> int:
    """RssAnon of a process in KiB (private memory, not the mapped file's pages)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class PeakSampler:
    """Samples this process's RssAnon every ``interval`` seconds in a thread; ``peak`` in bytes."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_kib() * 1024)
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_kib() * 1024)


def _write_images(job: tuple[str, int, int, int, int]) -> int:
    """Write images lo..hi-1 of the synthetic set: smooth colour fields with noise, JPEG, some not square."""
    from PIL import Image

    folder, lo, hi, side, classes = job
    rng = np.random.default_rng(lo)
    for i in range(lo, hi):
        cls = i % classes
        w = side + (side // 4 if i % 3 == 0 else 0)  # every third image wider: exercises the centre crop
        yy, xx = np.mgrid[0:side, 0:w].astype(np.float32)
        base = np.stack([np.sin(xx / (7 + cls) + i) * 60, np.cos(yy / (5 + cls)) * 60, (xx + yy) / (w + side) * 80],
                        -1) + 120
        img = (base + rng.normal(0, 20, base.shape)).clip(0, 255).astype(np.uint8)
        d = Path(folder) / f"class{cls:02d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(d / f"{i:06d}.jpg", quality=90)
    return hi - lo


def make_folder(root: Path, n: int, side: int, classes: int, workers: int) -> None:
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == n:
        return
    shutil.rmtree(root, ignore_errors=True)
    step = 500
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write_images, [(str(root), lo, min(lo + step, n), side, classes) for lo in range(0, n, step)]))
    done.write_text(str(n))


def gather_rates(sets: list[torch.Tensor], batch: int, rounds: int, repeats: int = 5) -> list[float]:
    """Median images/s of random-row gathers of ``batch`` rows from each set, the sets interleaved."""
    g = torch.Generator().manual_seed(0)
    times: list[list[float]] = [[] for _ in sets]
    for _ in range(repeats):
        idx = [torch.randint(0, len(sets[0]), (batch,), generator=g) for _ in range(rounds)]
        for k, images in enumerate(sets):
            t0 = time.perf_counter()
            for i in idx:
                images[i]
            times[k].append(time.perf_counter() - t0)
    return [batch * rounds / statistics.median(t) for t in times]


def train_main(args) -> None:
    """The training process (or torchrun rank): map the store, a few training steps, report peak RssAnon."""
    import torch.distributed as dist

    import vitlab
    from vitlab.data import load_data
    from vitlab.data.augment import AugmentConfig, BatchAugment
    from vitlab.train.tasks.supervised import soft_target_cross_entropy

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    with PeakSampler() as sampler:
        before = rss_anon_kib() * 1024
        data = load_data(str(args.root / "images"), img_size=args.train_size, store_size=args.side,
                         cache_dir=args.root / "cache", log=lambda s: None)
        data_private = rss_anon_kib() * 1024 - before  # what mapping the store cost in private memory
        model = vitlab.create_model(args.model, num_classes=len(data.classes), img_size=data.img_size).to(device)
        net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        aug = BatchAugment(AugmentConfig(crop="rrc", rrc_scale=(0.08, 1.0)), data.img_size, data.mean, data.std,
                           len(data.classes)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_x, train_y = data.train.images, data.train.labels
        if device.type == "cuda" and args.whole_to_gpu:
            train_x, train_y = train_x.to(device), train_y.to(device)  # a set that fits goes to the GPU whole
        g = torch.Generator().manual_seed(rank)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            idx = torch.randint(0, len(train_x), (args.batch // world,), generator=g)
            x, y = aug(train_x[idx.to(train_x.device)].to(device), train_y[idx.to(train_y.device)].to(device))
            loss = soft_target_cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if line.rstrip().endswith("images.u8")})
    report = {"rank": rank, "peak_rss_anon": sampler.peak, "data_rss_anon": data_private,
              "store_bytes": (data.store / "images.u8").stat().st_size,
              "mapped": maps, "steps_per_s": args.steps / seconds}
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, report)
        dist.destroy_process_group()
    else:
        reports = [report]
    if rank == 0:
        print("REPORT " + json.dumps(reports), flush=True)


def run_training(args) -> list[dict]:
    cmd = [sys.executable, __file__, "--train-only", "--root", str(args.root), "--side", str(args.side),
           "--train-size", str(args.train_size), "--steps", str(args.steps), "--batch", str(args.batch),
           "--model", args.model, "--device", args.device] + (["--whole-to-gpu"] if args.whole_to_gpu else [])
    if args.procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.procs),
               *cmd[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("REPORT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=11000)
    ap.add_argument("--side", type=int, default=256, help="stored side (shorter side resized, centre crop)")
    ap.add_argument("--train-size", type=int, default=224)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--workers", type=int, default=None, help="decoding processes (default: one per CPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="(a 224 ViT's activations dominate the peak: keep it small)")
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--procs", type=int, default=1, help="training processes (torchrun) for the memory check")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--whole-to-gpu", action="store_true", help="copy the whole train split to the GPU first")
    ap.add_argument("--root", type=Path, default=Path("/tmp/vitlab-bench-data"))
    ap.add_argument("--keep", action="store_true", help="keep the generated folder and store")
    ap.add_argument("--train-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train_only:
        return train_main(args)

    from vitlab.data import load_data
    from vitlab.data.decode import default_workers

    workers = args.workers or default_workers()
    t0 = time.perf_counter()
    make_folder(args.root / "images", args.images, args.side, args.classes, workers)
    print(f"generated {args.images} JPEG files in {time.perf_counter() - t0:.0f} s "
          f"({sum(f.stat().st_size for f in (args.root / 'images').rglob('*.jpg')) / 2**20:.0f} MiB)", flush=True)
    shutil.rmtree(args.root / "cache", ignore_errors=True)
    t0 = time.perf_counter()
    data = load_data(str(args.root / "images"), img_size=args.train_size, store_size=args.side,
                     cache_dir=args.root / "cache", workers=workers, log=lambda s: print(s, flush=True))
    build = time.perf_counter() - t0
    store_bytes = (data.store / "images.u8").stat().st_size
    n = len(data.train.labels) + len(data.test.labels)

    in_memory = data.train.images.clone()  # the same rows held in RAM, as before the store
    from_store, from_memory = gather_rates([data.train.images, in_memory], args.batch, rounds=20)
    del in_memory, data

    reports = run_training(args)
    peak = max(r["peak_rss_anon"] for r in reports)
    combined = sum(r["peak_rss_anon"] for r in reports)
    one_file = len({tuple(r["mapped"]) for r in reports}) == 1 and len(reports[0]["mapped"]) == 1

    gib = 2**30
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu
    print(f"\n{n} images stored at {args.side}x{args.side} (trained at {args.train_size}), {workers} decoding "
          f"workers, {device}, torch {torch.__version__}\n")
    rows = [
        ("store size (images.u8)", f"{store_bytes / gib:.2f} GiB"),
        ("build: decode + write", f"{n / build:.0f} img/s ({build:.0f} s)"),
        (f"gather {args.batch} random rows: store", f"{from_store:.0f} img/s"),
        (f"gather {args.batch} random rows: in-memory", f"{from_memory:.0f} img/s"),
        (f"training ({args.procs} proc, {args.steps} steps, batch {args.batch}, {args.model})",
         f"{reports[0]['steps_per_s']:.2f} steps/s"),
        ("RssAnon added by load_data (mapping the store)", f"{reports[0]['data_rss_anon'] / 2**20:.0f} MiB"),
        ("peak RssAnon, one training process", f"{peak / gib:.2f} GiB ({peak / store_bytes:.0%} of the store; "
                                               f"{'OK' if peak < store_bytes / 2 else 'OVER'} < 50%)"),
    ]
    if args.procs > 1:
        rows += [(f"peak RssAnon, {args.procs} ranks combined",
                  f"{combined / gib:.2f} GiB ({combined / store_bytes:.0%} of the store; "
                  f"{'OK' if combined < store_bytes else 'OVER'} < 100%)"),
                 ("ranks map one store file", "yes" if one_file else f"NO: {[r['mapped'] for r in reports]}")]
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
