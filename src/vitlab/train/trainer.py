"""The training loop, top to bottom: set up, train epoch by epoch, evaluate, checkpoint, write the run folder.

Every epoch re-seeds the random generators from (seed, epoch, rank), so a run resumed from its last
checkpoint (epochs mode) replays exactly what the uninterrupted run would have done. Under a time
budget the schedule follows rank 0's clock, which starts at the first step; a resumed budget run
continues from the training time already spent, but since its steps fall at other moments of the
clock it is not a bit-exact replay.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .. import checkpoint
from ..data.augment import BatchAugment, repeated_aug_indices
from ..data.views import eval_view
from ..progress import Progress, log_line
from .clock import RunClock
from .distill import TrainLoss
from .distributed import Dist, all_reduce_sum, all_reduce_value, barrier, cleanup, init_distributed, replicas_agree
from .evaluate import confusion_counts, metrics_from_counts
from .feed import BatchFeeder, fits_on_device
from .recipe import Recipe
from .report import plot_confusion, plot_curves
from .runfolder import check_out_dir, epoch_line, write_config, write_metrics, write_summary
from .schedule import Plateau, progressive_size, warmup_cosine
from .setup import (
    any_size,
    build_model_and_data,
    choose_precision,
    epoch_seed,
    freeze_backbone,
    make_optimizer,
    restore_size_flags,
    set_fast_math,
    size_step,
)
from .state import TrainState, load_checkpoint, save_checkpoint
from .step import EpochMeter, channels_last_helps, train_step
from .tensorboard import TensorBoardLog


def figures_every(device: torch.device) -> int:
    """Steps between reading the running totals back (progress-bar figures, the finite-loss check): on a GPU
    each read waits for the queued work, so it is rarer there."""
    return 50 if device.type == "cuda" else 5


def train(r: Recipe, resume: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train as the recipe says and write the run folder; returns the summary (empty on ranks other than 0)."""
    if r.out is None:
        raise ValueError("a training run needs an output folder: --out DIR")
    d = init_distributed(r.device)
    log = log or log_line
    log = log if d.is_main else (lambda s: None)
    try:
        return _train(r, d, resume, log)
    finally:
        cleanup(d)


def _train(r: Recipe, d: Dist, resume: bool, log: Callable[[str], None]) -> dict[str, Any]:
    t_start = time.perf_counter()
    out = Path(r.out)
    check_out_dir(out, resume)
    if r.threads:
        torch.set_num_threads(r.threads)
    if r.batch_size % (d.world * r.accum_steps):
        raise ValueError(f"batch_size {r.batch_size} is not divisible by {d.world} processes x "
                         f"{r.accum_steps} accumulation steps")
    set_fast_math(d.device)
    torch.manual_seed(r.seed)
    tb = TensorBoardLog(out) if r.log == "tensorboard" and d.is_main else None  # a missing package: before any data

    # --- model, data, augmentation, loss ---
    model, data, mean, std = build_model_and_data(r, d, log)
    classes = list(data.classes)
    if r.freeze_backbone:
        freeze_backbone(model)
    model.pretrained_cfg.update(mean=list(mean), std=list(std), label_names=classes)
    if d.is_main:
        write_config(out, r, getattr(model, "arch", None))
    channels_last = r.channels_last if r.channels_last is not None else channels_last_helps(model, d.device)
    model.to(d.device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    n_train = len(data.train.images)
    if n_train < r.batch_size:
        log(f"batch_size {r.batch_size} is larger than the {n_train} training images: "
            f"each step uses the whole training set")
    batch_size = min(r.batch_size, n_train - n_train % (d.world * r.accum_steps)) or n_train
    on_device = r.data_on_device if r.data_on_device is not None else fits_on_device(
        data.train.images.nbytes, d.device)
    feeder = BatchFeeder(data.train.images, data.train.labels, d.device, on_device)
    img_size = tuple(data.img_size)  # stored photos may be larger: training crops, evaluation resizes and crops
    stored = tuple(data.train.images.shape[-2:])
    crop_pct = (model.pretrained_cfg.get("crop_pct") or r.crop_pct) if r.init else r.crop_pct
    view = (lambda b: eval_view(b, img_size, crop_pct)) if stored != img_size else None
    augment = BatchAugment(r.augment, img_size, mean, std, len(classes)).to(d.device)
    teacher = None
    if r.teacher:
        teacher = checkpoint.load(r.teacher).to(d.device)
        if teacher.num_classes != len(classes):
            raise ValueError(f"teacher {r.teacher} predicts {teacher.num_classes} classes, the data has {len(classes)}")
        log(f"teacher: {r.teacher} ({type(teacher).__name__}), {r.distill} distillation")
    teacher_norm = (teacher.pretrained_cfg["mean"], teacher.pretrained_cfg["std"]) if teacher else None
    loss_fn = TrainLoss(teacher, r.distill, r.tau, r.alpha, student_norm=(mean, std), teacher_norm=teacher_norm)

    # --- the state that a checkpoint carries ---
    ckpt = load_checkpoint(out) if resume else None
    precision = ckpt["precision"] if ckpt is not None else choose_precision(
        r, model, augment, *feeder.gather(torch.arange(min(n_train, batch_size // d.world))), d, log)
    state = TrainState(
        model=model,
        optimizer=make_optimizer(model, r.lr, r.weight_decay, d.device),
        plateau=Plateau(r.plateau_patience, r.plateau_factor),
        ema=copy.deepcopy(model).eval().requires_grad_(False) if r.ema_decay > 0 else None,
        scaler=torch.amp.GradScaler(d.device.type) if precision == "fp16" else None,
        precision=precision)
    if ckpt is not None:
        state.load_state_dict(ckpt)
        log(f"resuming {out} after epoch {state.epoch}")
    elif resume:
        log(f"no checkpoint in {out} yet: starting the run from the beginning")

    # --- how the model runs: other sizes, compiled, replicated ---
    progressive = r.progressive_scale < 1
    size_flags = any_size(model) if progressive else {}  # every vitlab model takes other sizes this way
    px = size_step(model)
    net = torch.compile(model, dynamic=False) if r.compile else model  # progressive resizing: one graph per size
    if d.enabled:
        net = nn.parallel.DistributedDataParallel(net, device_ids=[d.device.index] if d.device.type == "cuda" else None)

    per_epoch = n_train // batch_size  # the last partial batch is dropped
    budget = r.time_budget * 60 if r.time_budget else None
    clock = RunClock(d, per_epoch * r.epochs, budget, seconds=state.seconds, reserve=state.reserve)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {getattr(model, 'arch', None) or type(model).__name__} ({n_params / 1e6:.2f}M parameters) on "
        f"{d.device}, {n_train} training images {tuple(data.train.images.shape[1:])}"
        f"{f' trained at {img_size[0]}x{img_size[1]}' if view is not None else ''}"
        f"{' (on the device)' if d.device.type == 'cuda' and feeder.on_device else ''}, {len(classes)} classes, "
        f"batch {batch_size}{f' over {d.world} processes' if d.enabled else ''}"
        f"{f' in {r.accum_steps} micro-batches' if r.accum_steps > 1 else ''}, {precision}, "
        + (f"time budget {r.time_budget:g} min" if budget else f"{r.epochs} epochs of {per_epoch} steps"))
    bar = Progress(total=int(budget) if budget else clock.total_steps,
                   initial=min(int(state.seconds), int(budget)) if budget else state.step,
                   disable=not d.is_main, unit="s" if budget else "step", dynamic_ncols=True,
                   mininterval=1.0, file=sys.stderr,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    eval_batch = max(batch_size // d.world, 256)

    def evaluate(m: nn.Module, limit: int | None = None) -> dict[str, dict]:
        """Metrics per head on the test split, each rank on its contiguous shard (a view, read batch by batch),
        summed on the device; ``limit`` stops after that many images of the shard."""
        n_test = len(data.test.images)
        start, stop_ = n_test * d.rank // d.world, n_test * (d.rank + 1) // d.world
        n = stop_ - start if limit is None else min(limit, stop_ - start)
        counts = confusion_counts(m, data.test.images.narrow(0, start, n), data.test.labels.narrow(0, start, n),
                                  mean, std, len(classes), batch_size=eval_batch, precision=precision, tta=r.tta,
                                  view=view)
        for c in counts.values():
            for k in c:
                c[k] = all_reduce_sum(c[k], d)
        return {name: metrics_from_counts(c, classes) for name, c in counts.items()}

    if budget is not None and clock.reserve == 0:
        # Keep back the end's evaluation before the first one has been timed: one batch, timed, scaled to the
        # test split (an over-estimate: the first batch pays for warm-up), so that a run evaluated only at
        # the end still ends within its budget.
        t_probe = time.perf_counter()
        evaluate(model, limit=eval_batch)  # every rank: it sums over them; its metrics are read back (a device sync)
        shard = len(data.test.images) // d.world
        clock.keep_back((2.0 if state.ema is not None else 1.0) * (time.perf_counter() - t_probe)
                        * shard / min(eval_batch, shard))
        log(f"kept back {clock.reserve:.0f} s of the budget for the final evaluation")

    # --- the loop ---
    every = figures_every(d.device)
    stop = budget is not None and clock.progress(state.step) >= 1
    stopped_early = False
    final_metrics = None
    last_size = None
    while not stop and (budget is not None or state.epoch < r.epochs):
        epoch = state.epoch
        torch.manual_seed(epoch_seed(r.seed, epoch, d.rank))
        g = torch.Generator().manual_seed(epoch_seed(r.seed, epoch, 0))
        if r.augment.repeated_aug > 1:
            order = repeated_aug_indices(n_train, r.augment.repeated_aug, g)
        else:
            order = torch.randperm(n_train, generator=g)
        batches = [order[i * batch_size:(i + 1) * batch_size][d.rank::d.world] for i in range(per_epoch)]
        model.train()
        loss_fn.train()
        meter = EpochMeter(d.device)
        epoch_t0 = time.perf_counter()
        clock.start()
        lr = r.lr
        steps_before = state.step
        for i, (images, labels) in enumerate(feeder.batches(batches)):
            p = clock.progress(state.step)
            if budget is not None and p >= 1:
                stop = True
                break
            lr = warmup_cosine(p, r.lr, r.min_lr, r.warmup) * state.plateau.scale
            size = progressive_size(p, img_size, r.progressive_scale, r.progressive_until, px) if progressive else None
            if size is not None and size != last_size:
                log(f"training input size {size[0]}x{size[1]}")
                last_size = size
            for group in state.optimizer.param_groups:
                group["lr"] = lr
            loss, hits = train_step(net, augment, loss_fn, state.optimizer, images, labels, precision, r.clip_grad,
                                    state.ema, r.ema_decay, size, r.accum_steps, state.scaler, channels_last)
            state.step += 1
            meter.add(loss, hits, len(images))
            if i % every == 0 or i == per_epoch - 1:
                running = meter.totals()
                check_finite(all_reduce_value(running["nonfinite"], d) + state.nonfinite, precision,
                             r.max_nonfinite, state.step)
                if d.is_main:
                    rate = running["seen"] * d.world / max(time.perf_counter() - epoch_t0, 1e-9)
                    bar.set_postfix_str(f"epoch {epoch + 1} loss {running['loss']:.3f} acc {running['acc']:.3f} "
                                        f"{rate:.0f} img/s", refresh=False)
            if budget:
                bar.goto(clock.seconds())
            else:
                bar.update(1)
        epoch_seconds = time.perf_counter() - epoch_t0
        if stop and state.step == steps_before:  # the budget ran out before this epoch's first step: no epoch
            break
        totals = meter.totals(d)
        state.nonfinite += int(totals["nonfinite"])
        row = {"epoch": epoch + 1, "step": state.step, "train_loss": totals["loss"], "train_acc": totals["acc"],
               "lr": lr, "images_per_second": totals["seen"] / max(epoch_seconds, 1e-9)}
        if last_size is not None:
            row["input_size"] = list(last_size)
        last = stop or (budget is None and epoch + 1 == r.epochs) or (budget is not None and clock.progress(
            state.step) >= 1)
        if last or (epoch + 1) % r.eval_every == 0:
            t_eval = time.perf_counter()
            metrics = evaluate(model)
            row.update(test_loss=metrics["logits"]["loss"], test_top1=metrics["logits"]["top1"],
                       test_top5=metrics["logits"]["top5"])
            for head in ("cls", "dist"):
                if head in metrics:
                    row[f"test_top1_{head}"] = metrics[head]["top1"]
            score = metrics["logits"]["top1"]
            if state.ema is not None:
                ema_metrics = evaluate(state.ema)
                row["ema_test_top1"] = ema_metrics["logits"]["top1"]
                if row["ema_test_top1"] > score:
                    metrics, score = {**ema_metrics, "ema": True}, row["ema_test_top1"]
            final_metrics = metrics
            clock.keep_back(time.perf_counter() - t_eval)
            # the reserve for the end may have grown past what is left: then this evaluation was the last
            last = last or (budget is not None and clock.progress(state.step) >= 1)
            if state.plateau.step(score) and r.plateau_patience:
                log(f"no improvement for {r.plateau_patience} evaluations: lr scale now {state.plateau.scale:g}")
            if score > state.best:
                state.best, state.since_best = score, 0
            else:
                state.since_best += 1
            if r.early_stop and state.since_best >= r.early_stop and not last:
                log(f"early stop: no improvement for {state.since_best} evaluations")
                stopped_early = stop = True
        stop = stop or last
        state.seconds, state.reserve = clock.seconds(), clock.reserve
        row["elapsed_seconds"] = state.seconds
        state.history.append(row)
        state.epoch += 1
        if d.is_main:
            log(epoch_line(row))
            save_checkpoint(out, state)
            write_metrics(out, state.history)
            if tb is not None:
                tb.scalars(row["epoch"], row)
        barrier(d)
    bar.close()

    # --- the end: evaluate, save the model, plots, summary (last: it marks the run finished) ---
    if final_metrics is None or "test_top1" not in state.history[-1]:
        final_metrics = evaluate(model)
    in_sync = replicas_agree(model, d)
    if not in_sync:
        log("warning: the replicas' weights differ between processes; the saved model is rank 0's")
    use_ema = bool(final_metrics.pop("ema", False))
    final_model = state.ema if use_ema else model
    restore_size_flags(size_flags)  # the saved model takes the size it was trained for (the EMA copy never changed)
    summary: dict[str, Any] = {}
    if d.is_main:
        history = state.history
        m = final_metrics["logits"]
        summary = {
            "top1": m["top1"], "top5": m["top5"], "test_loss": m["loss"], "per_class": m["per_class"],
            "images_per_second": sum(h["images_per_second"] for h in history) / len(history),
            "train_seconds": state.seconds, "epochs": len(history), "steps": state.step,
            "stopped_early": stopped_early, "model": getattr(model, "arch", None) or type(model).__name__,
            "parameters": n_params, "precision": precision, "device": str(d.device), "data": data.name,
            "num_train": n_train, "num_test": len(data.test.images), "classes": classes, "ema": use_ema,
            "tta": r.tta, "processes": d.world, "replicas_in_sync": in_sync, "nonfinite_steps": state.nonfinite,
            "distill": r.distill, "teacher": r.teacher, "time_budget_minutes": r.time_budget,
        }
        if "cls" in final_metrics:
            summary["heads"] = {"cls": final_metrics["cls"]["top1"], "dist": final_metrics["dist"]["top1"],
                                "mean": m["top1"]}
        if r.freeze_backbone:
            for p in final_model.parameters():
                p.requires_grad = True
        checkpoint.save(final_model, out)
        plot_curves(history, out / "curves.png", title=f"{summary['model']} on {data.name}")
        plot_confusion(m["confusion"], classes, out / "confusion.png",
                       title=f"Confusion matrix, test top-1 {100 * m['top1']:.2f}%")
        if tb is not None:
            for name in ("curves", "confusion"):
                tb.image(name, out / f"{name}.png", len(history))
            tb.close()
        summary["wall_seconds"] = time.perf_counter() - t_start
        write_summary(out, summary)
    return summary


def check_finite(nonfinite: float, precision: str, bound: int, step: int) -> None:
    """Stop a run whose loss is no longer finite: at once in float32/bf16 (it diverged), after ``bound``
    skipped steps in fp16 (whose gradient scaler skips such steps while it finds its scale)."""
    if nonfinite == 0 or math.isnan(nonfinite):
        return
    if precision != "fp16":
        raise FloatingPointError(f"the training loss is not finite (by step {step}, {precision}): the run diverged; "
                                 "resume from the last checkpoint with a lower --lr, --clip-grad, or --precision fp32")
    if nonfinite > bound:
        raise FloatingPointError(f"{int(nonfinite)} fp16 steps had a non-finite loss and were skipped (bound "
                                 f"--max-nonfinite {bound}); try --precision bf16 or fp32, or a lower --lr")

