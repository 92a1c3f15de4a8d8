"""The training loop, top to bottom: train epoch by epoch, evaluate, checkpoint, write the run folder; everything it
runs with is decided once before it starts (setup.py: the model and data, the preprocessing, the threads, the
precision) and handed to it as one ``Run``.

Every epoch re-seeds the random generators from (seed, epoch, rank), so a run resumed from its last
checkpoint (epochs mode) replays exactly what the uninterrupted run would have done. A batch cut into parts
(ranks, micro-batches, or both) draws each part's augmentation and drop-path from (seed, epoch, step, part), and each
rank takes its contiguous share, so N ranks take the very steps of one process cutting each batch into N
micro-batches (``--accum-steps N``). Under a time
budget the schedule follows rank 0's clock, which starts at the first step; a resumed budget run
continues from the training time already spent, but since its steps fall at other moments of the
clock it is not a bit-exact replay.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import VitlabError
from ..progress import log_line
from ..runs.folder import check_claimed
from ..runs.format import EpochRow, Summary, run_images_per_second, write_metrics, write_summary
from .distributed import (
    Dist,
    all_reduce_value,
    average_running_stats,
    barrier,
    cleanup,
    init_distributed,
    replicas_agree,
)
from .lora import finish_lora
from .recipe import Recipe
from .setup import (
    Run,
    batch_sizes,
    check_sources_outside,
    claim_out,
    early_stop_due,
    epoch_plan_of,
    epoch_seed,
    held_out,
    images_trained,
    model_name,
    run_net,
    set_up,
    torch_globals_kept,
    track_best,
)
from .shard import gathered
from .state import take_place
from .step import Batch, EpochMeter, check_loss_finite, ema_decay_at, figures_every, part_seed, train_step


def train(recipe: Recipe, resume: bool = False, log: Callable[[str], None] | None = None,
          now: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Train as the recipe says and write the run folder; returns the summary (empty on ranks other than 0).

    ``now`` is the clock in seconds that the time budget, the timings and the summary's seconds are read
    from. torch's global settings that the run changes (thread count, TF32 and cudnn.benchmark on a GPU,
    the global random generators it seeds) are restored when it returns; a process group that torchrun
    started is left as the run found it.
    """
    if recipe.out is None:
        raise VitlabError("a training run needs an output folder: --out DIR")
    check_sources_outside(recipe)
    with torch_globals_kept():
        dist = init_distributed(recipe.device)
        log = log or log_line
        log = log if dist.is_main else (lambda s: None)
        try:
            with contextlib.ExitStack() as claimed:
                resume = claim_out(claimed, recipe, dist, resume, log)
                return _train(recipe, dist, resume, log, now)
        finally:
            cleanup(dist)


def _train(recipe: Recipe, dist: Dist, resume: bool, log: Callable[[str], None],
           now: Callable[[], float]) -> dict[str, Any]:
    t_start = now()
    run = set_up(recipe, dist, resume, log, now)
    final_metrics, stopped_early = None, False
    end = run.out_of_time()  # a resumed run whose budget is already spent trains no more
    with contextlib.closing(run.bar):  # closed when the loop stops, an error included: the error is said last
        while not end and (run.budget is not None or recipe.steps or run.state.epoch < recipe.epochs):
            row, cut = train_epoch(run)
            if row is None:  # the budget ran out before this epoch's first step: no epoch
                break
            end = cut or (run.budget is None and not recipe.steps and row.epoch == recipe.epochs) or run.out_of_time()
            if end and run.lookahead is not None:
                run.lookahead.finish(run.model)
            for m in (run.model, run.state.ema):  # BatchNorm's, which each rank updates from its own share
                if m is not None:
                    average_running_stats(m, run.dist)
            if end or row.epoch % recipe.eval_every == 0:
                final_metrics, score = evaluate_epoch(run, row, None if end else run.sample_size(
                    run.data.num_train / max(row.images_per_second, 1e-9)))
                end = end or run.out_of_time()  # the reserve for the end may have grown past what is left
                track_best(run, score)
                stopped_early = not end and early_stop_due(run)
                end = end or stopped_early
            record_epoch(run, row)
    return finish(run, final_metrics, stopped_early, t_start)


def train_epoch(run: Run) -> tuple[EpochRow | None, bool]:
    """One epoch of steps; returns its row (None when the budget ran out before its first step) and whether the
    budget cut it short."""
    recipe, dist, state = run.recipe, run.dist, run.state
    epoch = state.epoch
    torch.manual_seed(epoch_seed(recipe.seed, epoch, dist.rank))
    sizes = batch_sizes(run)
    done, workers = take_place(state, run.per_epoch, sizes, run.budget is None, dist)
    seen = sum(sizes[:done])  # images of the epoch taken so far, all ranks together
    run.model.train()
    run.task.loss.train()
    meter = EpochMeter(dist.device)
    if recipe.freeze_stem_after and epoch >= recipe.freeze_stem_after and hasattr(run.model, "freeze_stem"):
        if run.model.freeze_stem() and dist.enabled:  # newly frozen: the replicas stop reducing its gradients
            run.net = run_net(run.model, recipe, dist)
    epoch_t0 = run.now()
    run.clock.start()
    lr, steps_before, cut, every, stepper = recipe.lr, state.step, False, figures_every(dist.device), run.stepper()
    for i, (images, labels, index) in enumerate(run.feeder.epoch(epoch_plan_of(run, epoch), done, workers), start=done):
        p = run.clock.progress(state.step)
        if (run.budget is not None or recipe.steps) and p >= 1:
            cut = True
            break
        lr = run.schedule.apply(state.optimizer, p, state.step)
        size = run.resize.size_at(p)
        stepper.ema_decay = ema_decay_at(p, recipe.ema_decay, recipe.ema_start)
        images = run.augment.alternate(images, index, epoch, recipe.seed)
        parts = dist.world * stepper.accum_steps  # a batch cut into parts draws each part's randomness alone
        seeds = ([part_seed(recipe.seed, epoch, i, dist.rank * stepper.accum_steps + k)
                  for k in range(stepper.accum_steps)] if parts > 1 else None)
        loss, hits = train_step(stepper, Batch(images, labels, size, share=len(images) * dist.world / sizes[i],
                                               index=index, seeds=seeds))
        state.step += 1
        run.task.after_step(run.model)
        if run.lookahead is not None:
            run.lookahead.step(run.model, state.step, run.clock.progress(state.step))
        meter.add(loss, hits, len(images))
        seen += sizes[i]
        run.save_within_epoch(i + 1, seen)
        if i % every == 0 or i == run.per_epoch - 1:
            show_running(run, meter, epoch, epoch_t0)
        if run.budget:
            run.bar.goto(run.clock.seconds())
        else:
            run.bar.update(1)
    epoch_seconds = run.now() - epoch_t0
    if cut and state.step == steps_before:
        return None, cut
    totals = meter.totals(dist)
    state.nonfinite += int(totals["nonfinite"])
    row = EpochRow(epoch=epoch + 1, step=state.step, train_loss=totals["loss"],
                   train_acc=run.task.epoch_accuracy(totals), lr=lr,
                   images_per_second=totals["seen"] / max(epoch_seconds, 1e-9),
                   input_size=list(run.resize.last) if run.resize.last is not None else None)
    return row, cut


def show_running(run: Run, meter: EpochMeter, epoch: int, epoch_t0: float) -> None:
    """Read the running totals back: stop a diverged run, and show loss, accuracy and speed on the bar."""
    dist, state = run.dist, run.state
    running = meter.totals()
    check_loss_finite(all_reduce_value(running["nonfinite"], dist) + state.nonfinite, run.precision,
                 run.recipe.max_nonfinite, state.step)
    if dist.is_main:
        rate = running["seen"] * dist.world / max(run.now() - epoch_t0, 1e-9)
        run.bar.set_postfix_str(f"epoch {epoch + 1} {run.task.running(running)} {rate:.0f} img/s", refresh=False)


def evaluate_epoch(run: Run, row: EpochRow, sample: int | None = None) -> tuple[dict[str, dict], float]:
    """Evaluate the model (and its EMA copy) into the row, on the whole test split or on about ``sample`` images of
    it; returns the better one's metrics (marked ``ema`` when it is the EMA copy's) and its score. Its time, scaled
    to the whole split, is kept back for the run's final evaluation, or, when the budget counts training only, not
    counted at all."""
    t_eval, off_clock = run.now(), run.recipe.budget_counts == "training"
    whole = len(held_out(run.data).images) // run.dist.world
    if sample is not None and sample < whole and not run.said_sample:
        run.log(f"evaluating on about {sample} of the {whole} test images after each epoch (a tenth of an epoch's "
                "time), on all of them at the end")
        run.said_sample = True
    with run.clock.paused(off_clock):
        metrics = run.evaluate(run.model, sample=sample)
        logits = metrics["logits"]
        row.test_loss, row.test_top1, row.test_top5 = logits["loss"], logits["top1"], logits["top5"]
        if "cls" in metrics:
            row.test_top1_cls, row.test_top1_dist = metrics["cls"]["top1"], metrics["dist"]["top1"]
        metrics, row.ema_test_top1 = better_of_ema(run, metrics)
        spent = run.now() - t_eval  # read inside the pause: when it pauses, the reading itself is not counted
    taken = len(range(0, whole, -(-whole // sample))) if sample is not None and sample < whole else whole
    run.eval_seconds_per_image = spent / max(taken, 1) / (2 if run.state.ema is not None else 1)
    if not off_clock:
        run.clock.keep_back(spent * whole / max(taken, 1))
    return metrics, score(metrics["logits"])


def score(m: dict) -> float:
    """What an evaluation is ranked by (higher is better): top-1, or without labels the held-out loss, negated."""
    return m["top1"] if m["top1"] is not None else -m["loss"]


def better_of_ema(run: Run, metrics: dict[str, dict]) -> tuple[dict[str, dict], float | None]:
    """The model's metrics, or its EMA copy's (marked ``ema``) when that scores higher; and the EMA's top-1."""
    if run.state.ema is None:
        return metrics, None
    ema_metrics = run.evaluate(run.state.ema)
    better = score(ema_metrics["logits"]) > score(metrics["logits"])
    return ({**ema_metrics, "ema": True} if better else metrics), ema_metrics["logits"]["top1"]


def record_epoch(run: Run, row: EpochRow) -> None:
    """Add the row to the history, then (rank 0) log it, checkpoint and rewrite metrics.jsonl."""
    state = run.state
    state.seconds, state.reserve = run.clock.seconds(), run.clock.reserve
    row.elapsed_seconds = state.seconds
    state.history.append(row.to_dict())
    state.epoch += 1
    run.log(row.line())
    run.checkpoint()
    if run.dist.is_main:
        write_metrics(run.out, [EpochRow.from_dict(h) for h in state.history])
        if run.tb is not None:
            run.tb.scalars(row.epoch, row.to_dict())
    barrier(run.dist)


def finish(run: Run, final_metrics: dict | None, stopped_early: bool, t_start: float) -> dict[str, Any]:
    """The end: evaluate, save the model, the figures and the summary (last: it marks the run finished)."""
    recipe, dist, state, model, data = run.recipe, run.dist, run.state, run.model, run.data
    if not state.history:
        raise VitlabError(f"--time-budget {recipe.time_budget:g} min ran out before the first training step (after "
                          f"{run.clock.reserve:.0f} s kept back for the final evaluation); accepted: a budget that "
                          "leaves time to train")
    if final_metrics is None or "test_loss" not in state.history[-1]:  # resumed after its last epoch
        final_metrics, _ = better_of_ema(run, run.evaluate(model))  # the choice the last epoch made
    in_sync = run.sharded or replicas_agree(model, dist)  # a sharded model has one copy
    if not in_sync:
        run.log("warning: the replicas' weights differ between processes; the saved model is rank 0's")
    use_ema = bool(final_metrics.pop("ema", False))
    final_model = state.ema if use_ema else model
    run.resize.restore()
    if run.sharded:  # every rank sends its parts; rank 0 saves the whole model as any run's
        final_model = gathered(model, run.skeleton, dist)
    if not dist.is_main:
        return {}
    history = [EpochRow.from_dict(h) for h in state.history]
    m = final_metrics["logits"]
    summary = run_summary(run, final_metrics, history, stopped_early=stopped_early, in_sync=in_sync, ema=use_ema)
    if recipe.freeze_backbone or recipe.freeze_blocks:
        for p in final_model.parameters():
            p.requires_grad = True
    check_claimed(run.out)
    final_model = finish_lora(final_model, run.out, run.log)
    run.task.save(final_model, run.out, run.mean, run.std)
    figures = run.task.draw(run.out, history, m, f"{summary.model} on {data.name}", run.classes)
    if run.tb is not None:
        for png in figures:
            run.tb.image(Path(png).stem, run.out / png, len(history))
        run.tb.close()
    summary.wall_seconds = run.now() - t_start
    check_claimed(run.out)
    write_summary(run.out, summary)
    return summary.to_dict()


def run_summary(run: Run, final_metrics: dict[str, dict], history: list[EpochRow], stopped_early: bool,
                in_sync: bool, ema: bool) -> Summary:
    """summary.json: the final metrics, what the run ran on and how long it took (its wall time is set last)."""
    recipe, dist, state, data, m = run.recipe, run.dist, run.state, run.data, final_metrics["logits"]
    return Summary(
        top1=m["top1"], top5=m["top5"], test_loss=m["loss"], per_class=m["per_class"],
        images_per_second=run_images_per_second(history),
        train_seconds=state.seconds, epochs=len(history), steps=state.step, stopped_early=stopped_early,
        model=model_name(run.model), parameters=run.n_params, precision=run.precision, device=str(dist.device),
        data=data.name, num_train=data.num_train, num_test=len(data.test.images),
        classes=run.classes, ema=ema, tta=recipe.tta, processes=dist.world, replicas_in_sync=in_sync,
        nonfinite_steps=state.nonfinite, distill=recipe.distill, teacher=recipe.teacher,
        time_budget_minutes=recipe.time_budget,
        heads={"cls": final_metrics["cls"]["top1"], "dist": final_metrics["dist"]["top1"], "mean": m["top1"]}
        if "cls" in final_metrics else None, pretrain=recipe.pretrain, unreadable=list(data.unreadable),
        images=images_trained(run), steps_budget=recipe.steps, auto=recipe.auto or None)
