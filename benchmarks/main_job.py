"""The main job, `make run` (`vitlab train --out runs/digits-<time>` on the embedded 8x8 digits): its wall time and
test top-1 on the machine as it is, and beside two CPU-bound processes this script starts itself, with the ratio.

    python benchmarks/main_job.py                # the default thread choice
    python benchmarks/main_job.py --threads 1 2  # also --threads 1 and --threads 2, each idle and busy

The competitors are plain Python loops, each bounded by --busy-limit seconds and killed when their run ends. The
load the machine already carries is measured before each run and printed beside it: an "idle" row is idle only
where that column says about 0.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vitlab.devices import busy_cores, cpu_flags, cpu_name, usable_cores
from vitlab.runs.format import read_summary


def competitors(n: int, limit: float) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes that stop by themselves after ``limit`` seconds."""
    loop = f"import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]


def main_job(out: Path, threads: int | None, busy: int, limit: float) -> dict:
    """One default digits run (as `make run` starts it) beside ``busy`` competing processes."""
    others = competitors(busy, limit)
    try:
        time.sleep(0.5 if busy else 0)  # the competitors running before the run looks at the load
        background = busy_cores(usable_cores(), interval=0.5)
        command = [sys.executable, "-m", "vitlab", "train", "--out", str(out)]
        t0 = time.perf_counter()
        done = subprocess.run(command + (["--threads", str(threads)] if threads else []),
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        for p in others:
            p.kill()
            p.wait()
    if done.returncode:
        sys.exit(f"vitlab train failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    chosen = re.search(r"^threads: (\d+)", done.stdout + done.stderr, re.MULTILINE)  # the log goes to stderr
    summary = read_summary(out)
    return {"threads": threads or (int(chosen.group(1)) if chosen else None), "busy": busy, "background": background,
            "wall": wall, "top1": summary.top1, "epochs": summary.epochs}


def machine() -> str:
    flags = cpu_flags()
    isa = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "x86"
    return f"{cpu_name()} ({isa}), {len(usable_cores())} cores usable"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="*", default=[], help="also time these explicit --threads counts")
    ap.add_argument("--busy-limit", type=float, default=900, help="seconds a competing process runs at most")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args(argv)
    print(f"main job: vitlab train (the default digits recipe) on {machine()}")
    print("| threads asked | chosen | competitors | load before (cores) | wall s | test top-1 | busy / idle |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in [None, *args.threads]:
            idle = None
            for busy in (0, 2):
                row = main_job(Path(tmp) / f"t{threads}-b{busy}", threads, busy, args.busy_limit)
                idle = idle or row["wall"]
                rows.append({**row, "asked": threads or "default"})
                print(f"| {threads or 'default'} | {row['threads']} | {busy} | {row['background']:.1f} | "
                      f"{row['wall']:.1f} | {100 * row['top1']:.2f}% | "
                      f"{row['wall'] / idle:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
