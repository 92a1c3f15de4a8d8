"""CIFAR-10 time-to-accuracy: the speed-run CNN and the speed-run hybrid ViT under one budget on one machine.

Runs ``vitlab train`` with recipes/cifar10_airbench.yaml (airbench_32) and then with
recipes/cifar10_hybrid_speedrun.yaml (the hybrid ViT), one after the other, each under a budget of ``--budget``
minutes of training with an evaluation after every epoch, and prints one table: the training time at which each
first reached 80, 85, 90, 93 and 94% test top-1, its final top-1, and its final model's top-1 with mirror +
translate TTA (six views, evaluated once and kept beside the run as ``RUN.tta-mirror-translate``), with the CPU
(or GPU) named. Training time is what speed runs time: the run's clock from its first step, evaluations not counted
(``--budget-counts training``); the wall time of each arm is longer by its evaluations.

Every figure is printed beside the box's calibration: airbench_32's bare training step (forward, backward, SGD on
random 32x32 images, channels-last, the arms' thread count), in training images a second. Times are also given in
CNN-epochs, the time this box's CNN step takes for 50,000 images, so that runs on boxes twice as fast or slow read
alike. ``--calibrate-steps 0`` skips it.

``distilled`` is the hybrid with a distillation token, hard-distilled from the ``cnn`` arm's finished model (the
teacher trained once and reused; its forward pass on every batch is inside the student's budget).
``distilled-once`` is the same student with ``--teacher-once``: the teacher's predictions on every training image
and its mirror image made once before the first step (their time inside the student's budget), so that the student
trains at the hybrid's own speed but learns the teacher's view of the uncropped image. ``--total MIN`` gives each
student the time the teacher's training left of MIN (MIN minus the ``cnn`` arm's training minutes), so that its row
compares with a CNN trained for MIN minutes alone: DeiT's student against its teacher at equal total time.

``hybrid-quarter`` is the hybrid with its progressive resizing over the first quarter of the budget instead of
half (the ``progressive-quarter`` ablation as an arm of the time-to-accuracy table, for its thresholds).

``--ablations`` trains the hybrid under the budget as it is and with each piece of the speed run taken away, added
or changed (the levers: whitening, alternating flips, lookahead, label smoothing, BatchNorm-bias lr, progressive
resizing, its start and its length, EMA, DeiT's augmentation, a light Mixup or random erasing alone, the weight
decay, a deeper or wider transformer, DeiT's two tokens without a teacher, and hard distillation from a finished CNN
run given as ``--teacher``, trained once and reused: through the tokens with the teacher on every batch or its
predictions made once, or through the hybrid's own head with them made once), each with ``--seeds`` seeds (default
3), evaluated at the end only (one view); then it evaluates the whole recipe's models (and those of the arms named
in ``--tta-arms``) again with mirror and with mirror + translate test-time augmentation, once: each evaluation is
kept beside its run (``RUN.tta-mirror``, ``RUN.tta-mirror-translate``: `vitlab eval`'s folders, with their confusion
matrices) and read back while it is newer than the run. Each row gives its seeds' mean and standard deviation and
its gain on the whole recipe with that gain's standard error (the seed-to-seed noise it is read against). The arms
run seed by seed and pair up under ``--jobs 2`` (an arm left to run alone would have the machine to itself and train
faster than the others). ``--arms`` picks some of them (e.g. a few levers at a longer budget). ``--epochs N`` trains
every arm N epochs instead of a time budget: the arms compared at equal epochs, e.g. on a GPU at the epoch count a
CPU's budget reaches (``--device cuda --precision fp32`` go to vitlab train with the other options).

Run again into the same ``--out`` (with more seeds, say), it keeps the arms already finished there, resumes those a
stopped benchmark left unfinished, and trains the rest; the table reads them all. A finished run of another recipe
than its arm's now (the recipe file or the arm changed since) is refused in one line that names what changed.

    python benchmarks/cifar10_speedrun.py --budget 30 [--data ../shared/data/cifar10-jpg.tar.gz] [--out runs/speedrun]
    python benchmarks/cifar10_speedrun.py --ablations --budget 4 --jobs 2 --threads 1 --out runs/speedrun-ablations \
        [--seeds 3] [--teacher runs/speedrun/cnn] [--arms full,ema,progressive-quarter]
    python benchmarks/cifar10_speedrun.py --arms cnn,distilled,distilled-once,soft-once-pooled --budget 30 --total 60 \
        --out runs/speedrun
    python benchmarks/cifar10_speedrun.py --ablations --arms full,wd-0.2 --seeds 4 --jobs 4 --epochs 13 \
        --device cuda --precision fp32 --threads 1 --calibrate-steps 0 --out runs/speedrun-gpu-13ep
    python benchmarks/cifar10_speedrun.py --table-only --out runs/speedrun   # tabulate finished runs again
    python benchmarks/cifar10_speedrun.py --ablations --table-only --tta-arms light-mix --out runs/speedrun-ablations

Any other option goes to every ``vitlab train`` (e.g. ``--threads 2``, ``--tta-translate 0`` for mirror TTA only).
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import vitlab
from vitlab.runs.format import SUMMARY, is_finished, read_eval_summary, read_history, read_summary
from vitlab.runs.jobs import Job, run_jobs

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"cnn": ROOT / "recipes/cifar10_airbench.yaml", "hybrid": ROOT / "recipes/cifar10_hybrid_speedrun.yaml",
        "distilled": ROOT / "recipes/cifar10_hybrid_speedrun.yaml",
        "distilled-once": ROOT / "recipes/cifar10_hybrid_speedrun.yaml",
        "soft-once-pooled": ROOT / "recipes/cifar10_hybrid_speedrun.yaml",
        "hybrid-quarter": ROOT / "recipes/cifar10_hybrid_speedrun.yaml"}
QUARTER = ["--progressive-until", "0.25"]  # the hybrid's progressive resizing over the first quarter, not half
MAIN_OPTIONS = {"hybrid-quarter": QUARTER}  # main arms' options beside their recipe (the students': STUDENTS)
TEACHER_ARM = "cnn"  # the distilled arms' teacher: the CNN arm's finished run
TOKENS = ["--model-arg", "distilled=true", "--model-arg", "class_token=true", "--model-arg", "global_pool=token"]
DISTILLED = TOKENS + ["--distill", "hard"]  # + --teacher OUT/cnn; DeiT reads the class and distillation tokens
SOFT_ONCE = ["--distill", "soft", "--teacher-once"]  # the teacher's logits made once, learnt softly by the one head
# the students and their options besides --teacher: the teacher on every batch, or its predictions made once; the
# last keeps the hybrid's model (average pooling, no tokens) and learns the teacher's argmax through its one head
STUDENTS = {"distilled": DISTILLED, "distilled-once": DISTILLED + ["--teacher-once"],
            "distilled-once-pooled": ["--distill", "hard", "--teacher-once"],
            "soft-once-pooled": SOFT_ONCE, "soft-once-pooled-t3": SOFT_ONCE + ["--tau", "3"],
            "soft-once-pooled-a0.8": SOFT_ONCE + ["--alpha", "0.8"],
            "soft-once-pooled-no-smoothing": SOFT_ONCE + ["--label-smoothing", "0"]}
CIFAR10_TRAIN = 50_000  # images in a CNN-epoch
THRESHOLDS = (0.80, 0.85, 0.90, 0.93, 0.94)
# the hybrid with one piece of the speed run taken away ("-"), added ("+") or changed at a time:
# (row label, vitlab train options); "+ hard distillation" needs a finished CNN run as its teacher (--teacher)
ABLATIONS = {
    "full": ("the whole recipe", []),
    "no-whiten": ("- whitening init (the first conv trained from PyTorch's init)",
                  ["--model-arg", "whiten_from_data=false"]),
    "no-altflip": ("- alternating flips (random flips instead)", ["--no-alternating-flip"]),
    "no-lookahead": ("- lookahead", ["--lookahead-every", "0"]),
    "no-smoothing": ("- label smoothing 0.2", ["--label-smoothing", "0"]),
    "no-bnbias": ("- BatchNorm biases at a higher lr", ["--bn-bias-lr-scale", "1"]),
    "no-progressive": ("- progressive resizing (32x32 throughout)", ["--progressive-scale", "1"]),
    "progressive-quarter": ("progressive resizing over the first quarter instead of half", QUARTER),
    "progressive-16": ("progressive resizing from 16x16 (16 -> 24 -> 32) instead of 24x24",
                       ["--progressive-scale", "0.5"]),
    "smoothing-0.1": ("label smoothing 0.1 instead of 0.2", ["--label-smoothing", "0.1"]),
    "ema": ("+ EMA of the weights (decay 0.999)", ["--ema-decay", "0.999"]),
    "ema-late": ("+ EMA begun where the resizing ends (decay 0.995, from half of the schedule)",
                 ["--ema-decay", "0.995", "--ema-start", "0.5"]),
    "deit-augment": ("+ DeiT's augmentation (Mixup 0.8, CutMix 1.0, random erasing 0.25)",
                     ["--mixup", "0.8", "--cutmix", "1.0", "--random-erasing", "0.25"]),
    "light-mix": ("+ light Mixup (alpha 0.2, no CutMix), against the overfitting of long runs",
                  ["--mixup", "0.2", "--cutmix", "0"]),
    "erasing": ("+ random erasing 0.25 alone", ["--random-erasing", "0.25"]),
    "wd-0.05": ("weight decay 0.05 (the recipe's first) instead of 0.8", ["--weight-decay", "0.05"]),
    "wd-0.2": ("weight decay 0.2 instead of 0.8", ["--weight-decay", "0.2"]),
    "deeper": ("+ 2 more transformer blocks (4)", ["--model-arg", "depth=4"]),
    "wider": ("+ a wider transformer (384, 6 heads)", ["--model-arg", "embed_dim=384", "--model-arg", "num_heads=6"]),
    "distilled": ("+ hard distillation from the CNN (--teacher)", STUDENTS["distilled"]),
    "distilled-once": ("+ hard distillation from the CNN, its predictions made once before training (--teacher)",
                       STUDENTS["distilled-once"]),
    "tokens": ("DeiT's class and distillation tokens read by two heads instead of average pooling, no teacher",
               TOKENS),
    "distilled-once-pooled": ("+ hard distillation through the one head of the hybrid as it is (average pooling), "
                              "the teacher's predictions made once (--teacher)", STUDENTS["distilled-once-pooled"]),
    "soft-once-pooled": ("+ soft distillation (temperature 1, weight 0.5) through the hybrid's one head, the "
                         "teacher's predictions made once (--teacher)", STUDENTS["soft-once-pooled"]),
    "soft-once-pooled-t3": ("+ soft distillation at temperature 3 (weight 0.5) through the hybrid's one head, the "
                            "teacher's predictions made once (--teacher)", STUDENTS["soft-once-pooled-t3"]),
    "soft-once-pooled-a0.8": ("+ soft distillation weighted 0.8 (temperature 1) through the hybrid's one head, the "
                              "teacher's predictions made once (--teacher)", STUDENTS["soft-once-pooled-a0.8"]),
    "soft-once-pooled-no-smoothing": ("+ soft distillation (temperature 1, weight 0.5) through the hybrid's one head, "
                                      "the teacher's predictions made once, no label smoothing (--teacher)",
                                      STUDENTS["soft-once-pooled-no-smoothing"]),
}
ONE_VIEW = ["--no-tta", "--tta-translate", "0", "--eval-every", "100000"]
TTA_VIEWS = {"+ mirror TTA": 0, "+ mirror + translate TTA": 1}  # row label: pixels of translation beside the mirror


def machine() -> str:
    """The CPU's model name, family and model numbers (a bare "AMD EPYC" names no generation) and its AVX-512 / AMX
    flags, and the GPU when torch sees one."""
    info, flags = {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in info:
                info[key] = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = info.get("model name", "unknown CPU")
    if "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    isa = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_vp2intersect",
                                                                    "amx_tile"))
    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{name} ({isa}), {torch.get_num_threads()} threads{gpu}"


def calibrate(steps: int = 5, batch: int = 512, clock=time.perf_counter) -> float:
    """This box's calibration: airbench_32's training images per second, the median of ``steps`` bare steps
    (forward, backward, Nesterov SGD) on random 32x32 images, channels-last, at torch's current thread count, after
    one step not counted."""
    torch.manual_seed(0)
    model = vitlab.create_model("airbench_32").to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.85, nesterov=True)
    x = torch.randn(batch, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    seconds = []
    for _ in range(steps + 1):
        t0 = clock()
        loss = F.cross_entropy(model(x), y, label_smoothing=0.2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seconds.append(clock() - t0)
    return batch / statistics.median(seconds[1:])


def cnn_epochs(seconds: float, calibration: float | None) -> float | None:
    """A time in CNN-epochs: how many epochs of CIFAR-10 this box's CNN step trains in it."""
    return None if calibration is None else seconds * calibration / CIFAR10_TRAIN


def arm_command(recipe: Path, out: Path, data: str, budget: float, extra: list[str],
                epochs: int | None = None) -> list[str]:
    """``vitlab train`` of one arm: its schedule laid over ``budget`` minutes of training, or over ``epochs``
    epochs where given (the recipe's time budget taken away)."""
    length = (["--time-budget", f"{budget:g}", "--budget-counts", "training"] if epochs is None
              else ["--time-budget", "null", "--epochs", str(epochs)])
    return [sys.executable, "-m", "vitlab", "train", "--config", str(recipe), "--data", data, "--out", str(out),
            *length, "--eval-every", "1", *extra]


def recipe_changes(folder: Path, cmd: list[str]) -> str:
    """What differs between the recipe a run folder was trained with and the one ``cmd`` (a `vitlab train` command
    line) trains now, as ``key old -> new``; '' when nothing does, or when the folder has no recipe to compare. The
    recipe as a checkpoint records it (less where it ran and how it reported), with its length, less the data's
    path."""
    from vitlab.cli import build_parser
    from vitlab.cli.train import recipe_of
    from vitlab.runs.format import config_values, read_config
    from vitlab.runs.identity import recipe_record

    def plain(config: dict) -> dict:
        record = {**recipe_record(config), "epochs": config.get("epochs"), "time_budget": config.get("time_budget")}
        record.pop("data", None)
        augment = {f"augment.{k}": v for k, v in record.pop("augment", {}).items()}
        return {**record, **augment}
    then = read_config(folder)
    if not then:
        return ""
    recipe = recipe_of(build_parser().parse_args(cmd[cmd.index("train"):]))
    then, now = plain(then), plain(config_values(recipe, None))
    # a value that only one of them has is an option added or removed since that run, which ran as vitlab did then
    keys = sorted(k for k in then.keys() & now.keys() if then[k] != now[k])
    return ", ".join(f"{k} {then[k]!r} -> {now[k]!r}" for k in keys)


def arm_jobs(commands: dict[str, list[str]]) -> list[Job]:
    """The arms' commands as child runs (vitlab.runs.jobs): a finished arm is kept, not trained again (the benchmark
    run again with more seeds or arms trains what is missing); an unfinished one, of a stopped benchmark, resumes
    from its last checkpoint with the same threads. A finished run of another recipe than its arm's now (the recipe
    file or the arm changed since) is refused in one line: kept, it would stand in the table for what it is not."""
    jobs = []
    for name, cmd in commands.items():
        folder = Path(cmd[cmd.index("--out") + 1])
        changes = recipe_changes(folder, cmd) if is_finished(folder) else ""
        if changes:
            raise ValueError(f"{name}: {folder} holds a finished run of another recipe than the arm's now "
                             f"({changes}); accepted: another --out, or that folder moved aside")
        runtime = cmd[cmd.index("--threads"):cmd.index("--threads") + 2] if "--threads" in cmd else []
        jobs.append(Job(name, folder, cmd, resume=[*cmd[:cmd.index("train") + 1], "--resume", str(folder), *runtime]))
    return jobs


def run_arms(jobs: list[Job], parallel: int, start=None, wait=time.sleep) -> None:
    """Run the arms, ``parallel`` at a time (each alone on the machine with 1), and say how each ended. Stopped
    (Ctrl-C, SIGTERM, an error), it stops the arms still training, so that none goes on writing its run folder and
    taking the cores of the next benchmark."""
    for failure in run_jobs(jobs, parallel, lambda line: print(line, flush=True), start=start, wait=wait):
        print(f"failed: {failure}", flush=True)


def fmt_time(seconds: float | None, calibration: float | None = None) -> str:
    """Minutes, and CNN-epochs in brackets where the box is calibrated."""
    if seconds is None:
        return "-"
    ep = cnn_epochs(seconds, calibration)
    return f"{seconds / 60:.1f} min" + ("" if ep is None else f" ({ep:.1f})")


def arm_row(name: str, folder: Path, calibration: float | None = None, before: float = 0.0) -> list[str]:
    """One table row: the model, epochs, img/s, time to each threshold, final top-1, training time. ``before``:
    training seconds spent before this run began (the distilled arm's teacher), added to every time."""
    if not is_finished(folder):
        return [name, "(not finished)"] + [""] * (len(THRESHOLDS) + 4)
    rows, summary = read_history(folder), read_summary(folder)
    reached = []
    for t in THRESHOLDS:
        hit = next((r.elapsed_seconds for r in rows if r.test_top1 is not None and r.test_top1 >= t), None)
        reached.append(fmt_time(None if hit is None else before + hit, calibration))
    return [name, summary.model, f"{epochs_trained(folder):.1f}", f"{summary.images_per_second:.0f}", *reached,
            f"{100 * summary.top1:.2f}%", fmt_time(before + summary.train_seconds, calibration)]


def epochs_trained(folder: Path) -> float:
    """A finished run's epochs, its last one perhaps cut short: its steps over the steps of its first epoch."""
    rows, summary = read_history(folder), read_summary(folder)
    return summary.steps / rows[0].step if len(rows) > 1 else float(summary.epochs)


def teacher_seconds(out: Path) -> float:
    """The training seconds of the distilled arm's teacher (the cnn arm), 0 when it has not finished."""
    folder = out / TEACHER_ARM
    return read_summary(folder).train_seconds if is_finished(folder) else 0.0


def table(out: Path, arms: list[str], calibration: float | None = None,
          six_views: dict[str, float] | None = None) -> str:
    """The time-to-accuracy table; the distilled arm's times include its teacher's training. ``six_views``: each
    finished arm's final model with mirror + translate TTA (a column of its own where given)."""
    unit = " (CNN-epochs)" if calibration else ""
    head = ["arm", "model", "epochs", "img/s", *[f"to {100 * t:.0f}%{unit}" for t in THRESHOLDS], "final top-1",
            f"trained{unit}"] + (["final, mirror + translate TTA"] if six_views is not None else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in arms:
        before = teacher_seconds(out) if a in STUDENTS else 0.0
        label = f"{a} (+ its teacher's {before / 60:.1f} min)" if before else a
        row = arm_row(label, out / a, calibration, before)
        if six_views is not None:
            row.append(f"{100 * six_views[a]:.2f}%" if a in six_views else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def student_budget(out: Path, budget: float, total: float | None) -> float:
    """The distilled arm's budget in minutes: ``budget``, or what the teacher's training left of ``total``."""
    if total is None:
        return budget
    left = total - teacher_seconds(out) / 60
    if left <= 0:
        raise SystemExit(f"--total {total:g} min leaves the distilled student no time after its teacher's "
                         f"{teacher_seconds(out) / 60:.1f} min; accepted: a --total above the cnn arm's time")
    return left


def main_commands(out: Path, arms: list[str], data: str, budget: float, extra: list[str],
                  epochs: int | None = None) -> dict[str, list[str]]:
    """The commands of main arms that learn from no teacher: each its recipe with its options (MAIN_OPTIONS)."""
    return {a: arm_command(ARMS[a], out / a, data, budget, MAIN_OPTIONS.get(a, []) + extra, epochs) for a in arms}


def student_commands(out: Path, students: list[str], data: str, budget: float, extra: list[str],
                     epochs: int | None = None) -> dict[str, list[str]]:
    """The students' commands, each learning from the teacher arm's finished run under ``out``."""
    return {a: arm_command(ARMS[a], out / a, data, budget, STUDENTS[a] + ["--teacher", str(out / TEACHER_ARM)] + extra,
                           epochs) for a in students}


def seed_folder(out: Path, arm: str, seed: int) -> Path:
    """An ablation arm's run folder for one seed: ``arm`` for seed 0, ``arm-seedN`` for the others."""
    return out / (arm if seed == 0 else f"{arm}-seed{seed}")


def ablation_commands(out: Path, data: str, budget: float, seeds: int, teacher: Path | None,
                      extra: list[str], arms: list[str] | None = None, epochs: int | None = None
                      ) -> dict[str, list[str]]:
    """Every arm of ``ABLATIONS`` once per seed, seed by seed (so that ``--jobs`` pairs arms of one seed), one view
    at the end. The distillation arm runs only with a teacher (a finished CNN run, trained once and reused)."""
    commands = {}
    for seed in range(seeds):
        for arm, (_, options) in ABLATIONS.items():
            if (arms is not None and arm not in arms) or (arm in STUDENTS and teacher is None):
                continue
            more = ["--teacher", str(teacher)] if arm in STUDENTS else []
            folder = seed_folder(out, arm, seed)
            commands[folder.name] = arm_command(ARMS["hybrid"], folder, data, budget,
                                                options + more + ONE_VIEW + ["--seed", str(seed)] + extra, epochs)
    return commands


def mean_sd(values: list[float]) -> str:
    """The mean in percent and, from two values on, ± the sample standard deviation in points."""
    spread = f" ± {100 * statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{100 * statistics.fmean(values):.2f}%{spread}"


def seed_summaries(out: Path, arm: str, seeds: int) -> list:
    """The summaries of an ablation arm's finished seeds."""
    return [read_summary(f) for f in (seed_folder(out, arm, s) for s in range(seeds)) if is_finished(f)]


def difference_se(arm: list[float], full: list[float]) -> float | None:
    """The standard error of the difference of two means over independent seeds (None under two seeds a side)."""
    if len(arm) < 2 or len(full) < 2:
        return None
    return (statistics.variance(arm) / len(arm) + statistics.variance(full) / len(full)) ** 0.5


def paired_se(after: list[float], before: list[float]) -> float | None:
    """The standard error of the mean difference of paired figures (one model measured two ways)."""
    diffs = [a - b for a, b in zip(after, before)]
    return statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None


def gain_cell(gain: float, se: float | None) -> str:
    """A gain in points with its noise; "beyond the noise" where it is more than twice its standard error."""
    if se is None:
        return f"{100 * gain:+.2f}"
    return f"{100 * gain:+.2f} ± {100 * se:.2f}" + (" (beyond the noise)" if abs(gain) > 2 * se else "")


def ablation_table(out: Path, tta: dict[str, dict[str, list[float]]], seeds: int = 1,
                   arms: list[str] | None = None) -> str:
    """One row per arm of ``ABLATIONS``: its seeds' final one-view top-1 (mean ± standard deviation) and its
    difference from the whole recipe's with that difference's noise; then, per arm of ``tta`` (arm: {TTA row label:
    its seeds' top-1}), its models with test-time augmentation: the whole recipe's against its own one-view figures
    (paired: the same models), another arm's against the whole recipe's with the same TTA. A piece taken away ("-")
    gained what its arm lost; any other arm gained what it adds."""
    lines = ["| arm | seeds | epochs | img/s | top-1 (mean ± sd) | gain ± its noise |", "|---|---|---|---|---|---|"]
    full = [d.top1 for d in seed_summaries(out, "full", seeds)]
    for arm, (label, _) in ABLATIONS.items():
        if arms is not None and arm not in arms:
            continue
        done = seed_summaries(out, arm, seeds)
        top1 = [d.top1 for d in done]
        if not done:
            why = "needs --teacher" if arm in STUDENTS else "not finished"
            lines.append(f"| {label} | ({why}) | | | | |")
            continue
        epochs = statistics.fmean(epochs_trained(f) for f in (seed_folder(out, arm, s) for s in range(seeds))
                                  if is_finished(f))  # steps over an epoch's steps: a teacher made once takes none
        img_s = statistics.fmean(d.images_per_second for d in done)
        sign = -1 if label.startswith("-") else 1
        gain = "" if arm == "full" or not full else gain_cell(
            sign * (statistics.fmean(top1) - statistics.fmean(full)), difference_se(top1, full))
        lines.append(f"| {label} | {len(top1)} | {epochs:.2f} | {img_s:.0f} | {mean_sd(top1)} | {gain} |")
    for arm, figures in tta.items():
        for view, top1 in figures.items():
            against = full if arm == "full" else tta.get("full", {}).get(view, [])
            if not top1 or not against:
                continue
            se = paired_se(top1, against) if arm == "full" else difference_se(top1, against)
            label = ABLATIONS[arm][0]
            sign = -1 if label.startswith("-") else 1
            gain = gain_cell(sign * (statistics.fmean(top1) - statistics.fmean(against)), se)
            lines.append(f"| {label} {view} | {len(top1)} | | | {mean_sd(top1)} | {gain} |")
    return "\n".join(lines)


def tta_top1(run: Path, data: str, translate: int, evaluate=None) -> float:
    """A finished run's model's top-1 with mirror TTA (and, with ``translate``, the views shifted by that many
    pixels), evaluated once: `vitlab eval`'s folder beside the run (``RUN.tta-mirror`` or
    ``RUN.tta-mirror-translate``) is read back while it is newer than the run's summary and of the same views (one
    that cannot be read is evaluated again)."""
    where = run.with_name(f"{run.name}.tta-mirror{'-translate' if translate else ''}")
    if is_finished(where) and (where / SUMMARY).stat().st_mtime >= (run / SUMMARY).stat().st_mtime:
        try:
            kept = read_eval_summary(where)
        except ValueError:
            kept = None
        if kept is not None and kept.tta and kept.tta_translate == translate:
            return kept.top1
    if evaluate is None:
        from vitlab.infer.eval import evaluate_folder as evaluate
    print(f"{run.name}: evaluating with mirror{' + translate' if translate else ''} TTA into {where}", flush=True)
    return evaluate(run, data, out=where, tta=True, tta_translate=translate)["top1"]


def tta_figures(out: Path, data: str, seeds: int = 1, arms: tuple[str, ...] | list[str] = ("full",),
                evaluate=None) -> dict[str, dict[str, list[float]]]:
    """The finished models of each of ``arms`` (one per seed) with mirror TTA and with mirror + translate TTA."""
    figures = {}
    for arm in arms:
        runs = [f for f in (seed_folder(out, arm, s) for s in range(seeds)) if is_finished(f)]
        figures[arm] = {view: [tta_top1(f, data, translate, evaluate) for f in runs]
                        for view, translate in TTA_VIEWS.items()}
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=30.0, help="minutes of training per arm (default 30)")
    ap.add_argument("--epochs", type=int, help="epochs per arm instead of a time budget: arms compared at equal "
                                               "epochs (e.g. on a GPU, at the epochs a CPU's budget reaches)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/cifar10-jpg.tar.gz"))
    ap.add_argument("--out", default="runs/speedrun", help="folder of the arms' run folders")
    ap.add_argument("--arms", help="which to run, in order (default cnn,hybrid); with --ablations, which of its "
                                   f"arms (default all: {', '.join(ABLATIONS)})")
    ap.add_argument("--ablations", action="store_true", help="the hybrid without each piece of the speed run")
    ap.add_argument("--jobs", type=int, default=1, help="arms trained side by side (give --threads too; default 1)")
    ap.add_argument("--table-only", action="store_true", help="tabulate the run folders under --out, train nothing")
    ap.add_argument("--total", type=float, help="the distilled arms' budget is what the cnn arm's training left of "
                                                 "this many minutes (default: --budget for them too)")
    ap.add_argument("--seeds", type=int, default=3, help="--ablations: seeds of every arm, for the noise each gain "
                                                         "is read against (default 3)")
    ap.add_argument("--teacher", type=Path, help="--ablations: a finished CNN run that the distillation arm learns "
                                                 "from (without it that arm is left out)")
    ap.add_argument("--tta-arms", default="full", help="--ablations: the arms whose models are also evaluated with "
                                                        "mirror and mirror + translate TTA (default full; full is "
                                                        "always one)")
    ap.add_argument("--calibrate-steps", type=int, default=5, help="bare CNN steps timed for the box's calibration "
                                                                   "(0: none; default 5)")
    args, extra = ap.parse_known_args()  # anything else goes to vitlab train (e.g. --threads 2)
    arms = [a.strip() for a in (args.arms or ("" if args.ablations else "cnn,hybrid")).split(",") if a.strip()]
    known = ABLATIONS if args.ablations else ARMS
    unknown = [a for a in arms if a not in known]
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)}; accepted: {', '.join(known)}")
    chosen = (arms or None) if args.ablations else None  # the ablation arms to run (None: all)
    if args.ablations:
        arms = []
    tta_arms = ["full"] + [a.strip() for a in args.tta_arms.split(",") if a.strip() and a.strip() != "full"]
    unknown = [a for a in tta_arms if a not in ABLATIONS]
    if unknown:
        ap.error(f"--tta-arms: unknown {', '.join(unknown)}; accepted: {', '.join(ABLATIONS)}")
    if args.budget <= 0 or args.jobs < 1 or args.calibrate_steps < 0 or args.seeds < 1 or (args.epochs or 1) < 1:
        ap.error(f"--budget {args.budget:g}, --epochs {args.epochs}, --jobs {args.jobs}, --seeds {args.seeds}, "
                 f"--calibrate-steps {args.calibrate_steps}: accepted: --budget > 0, --epochs >= 1, --jobs >= 1, "
                 f"--seeds >= 1, --calibrate-steps >= 0")
    if args.epochs is not None and args.total is not None:
        ap.error("--total counts minutes and --epochs counts epochs; accepted: one of them")
    if args.teacher is not None and not is_finished(args.teacher):
        ap.error(f"--teacher {args.teacher}: not a finished run folder; accepted: the folder of a finished "
                 f"vitlab train run (e.g. OUT/{TEACHER_ARM} of an earlier run of this benchmark)")
    students = [a for a in arms if a in STUDENTS]
    if students and (TEACHER_ARM not in arms or arms.index(TEACHER_ARM) > arms.index(students[0])) \
            and not is_finished(Path(args.out) / TEACHER_ARM) and not args.table_only:
        ap.error(f"the {students[0]} arm's teacher is the {TEACHER_ARM} arm: list it first in --arms or finish it "
                 f"under --out first")
    if "--threads" in extra:
        torch.set_num_threads(int(extra[extra.index("--threads") + 1]))
    out = Path(args.out)

    def to_run(commands: dict[str, list[str]]) -> list[Job]:
        try:
            return arm_jobs(commands)
        except ValueError as e:  # a finished run of another recipe in --out
            ap.error(str(e))
    calibration = calibrate(args.calibrate_steps) if args.calibrate_steps else None
    if not args.table_only:
        if args.ablations:
            commands = ablation_commands(out, args.data, args.budget, args.seeds, args.teacher, extra, chosen,
                                         args.epochs)
        else:
            commands = main_commands(out, [a for a in arms if a not in STUDENTS], args.data, args.budget, extra,
                                     args.epochs)  # the students run once their teacher has finished
        run_arms(to_run(commands), args.jobs)
        if students and not is_finished(out / TEACHER_ARM):
            print(f"{', '.join(students)}: not run, the teacher ({out / TEACHER_ARM}) did not finish", flush=True)
        elif students:
            budget = student_budget(out, args.budget, args.total)
            run_arms(to_run(student_commands(out, students, args.data, budget, extra, args.epochs)), 1)
    # the TTA evaluations print as they go, so before the table's header
    tta = tta_figures(out, args.data, args.seeds, tta_arms) if args.ablations else {}
    six_views = None if args.ablations else {a: tta_top1(out / a, args.data, TTA_VIEWS["+ mirror + translate TTA"])
                                             for a in arms if is_finished(out / a)}
    what = "ablations of the hybrid" if args.ablations else "time-to-accuracy"
    length = f"budget {args.budget:g} min of training" if args.epochs is None else f"{args.epochs} epochs"
    print(f"\nCIFAR-10 {what}, {length} per arm, on {machine()}")
    if calibration:
        print(f"calibration: airbench_32's bare training step at {calibration:.0f} img/s on this box (batch 512, "
              f"median of {args.calibrate_steps}); one CNN-epoch = {CIFAR10_TRAIN / calibration / 60:.1f} min\n")
    if args.ablations:
        print(f"{args.seeds} seed(s) an arm; a gain is beyond the noise where it is over twice its standard error\n")
    print(ablation_table(out, tta, args.seeds, chosen) if args.ablations
          else table(out, arms, calibration, six_views))


def stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # so that run_arms' cleanup runs under kill as under Ctrl-C


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    main()
