"""The training loop, top to bottom: set up, train epoch by epoch, evaluate, checkpoint, write the run folder.

Every epoch re-seeds the random generators from (seed, epoch, rank), so a run resumed from its last
checkpoint (epochs mode) replays exactly what the uninterrupted run would have done. Under a time
budget the schedule follows rank 0's clock, which starts at the first step; a resumed budget run
continues from the training time already spent, but since its steps fall at other moments of the
clock it is not a bit-exact replay.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml

from ..data.augment import BatchAugment
from ..data.sources import DataBundle, ImageSet
from ..data.views import eval_view
from ..devices import set_cpu_threads
from ..models.summary import matmul_flops
from ..progress import Progress, log_line, progress_bar
from ..runs.folder import check_claimed, check_model_written, claim_folder, written_by_this_launch
from ..runs.format import (
    CHECKPOINT,
    EpochRow,
    Summary,
    config_values,
    has_config,
    read_config,
    run_images_per_second,
    write_metrics,
    write_summary,
)
from ..runs.identity import (
    check_threads,
    checkpoint_marks,
    own_checkpoint,
    resumed_threads,
    run_identity,
    write_run_files,
)
from .clock import RunClock
from .distributed import (
    Dist,
    all_reduce_value,
    average_running_stats,
    barrier,
    broadcast_flag,
    broadcast_state,
    cleanup,
    init_distributed,
    on_rank0,
    replicas_agree,
)
from .feed import BatchFeeder, fits_on_device, repeated_aug_indices
from .optim import Lookahead, describe_groups, recipe_optimizer
from .progressive import ProgressiveResize
from .recipe import Recipe
from .schedule import Plateau, describe_warmup, set_lr, step_share, warmup_cosine
from .setup import (
    build_model_and_data,
    check_groups,
    choose_precision,
    describe_plan,
    epoch_plan,
    epoch_seed,
    freeze,
    prepare_model,
    set_fast_math,
)
from .state import TrainState, save_checkpoint
from .step import Batch, EpochMeter, Stepper, channels_last_helps, ema_decay_at, train_step
from .tasks import EvalSplit, Task, task_for
from .tensorboard import TensorBoardLog


def figures_every(device: torch.device) -> int:
    """Steps between reading the running totals back (progress-bar figures, the finite-loss check): on a GPU
    each read waits for the queued work, so it is rarer there."""
    return 50 if device.type == "cuda" else 5


def train(r: Recipe, resume: bool = False, log: Callable[[str], None] | None = None,
          now: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Train as the recipe says and write the run folder; returns the summary (empty on ranks other than 0).

    ``now`` is the clock in seconds that the time budget, the timings and the summary's seconds are read
    from. torch's global settings that the run changes (thread count, TF32 and cudnn.benchmark on a GPU,
    the global random generators it seeds) are restored when it returns; a process group that torchrun
    started is left as the run found it.
    """
    if r.out is None:
        raise ValueError("a training run needs an output folder: --out DIR")
    check_sources_outside(r)
    with torch_globals_kept():
        d = init_distributed(r.device)
        log = log or log_line
        log = log if d.is_main else (lambda s: None)
        try:
            with contextlib.ExitStack() as claimed:
                resume = claim_out(claimed, r, d, resume, log)
                return _train(r, d, resume, log, now)
        finally:
            cleanup(d)


def claim_out(stack: contextlib.ExitStack, r: Recipe, d: Dist, resume: bool, log: Callable[[str], None]) -> bool:
    """Rank 0 claims --out for the run (the one rank that writes there: another machine's ranks may not see it) and
    decides whether it resumes; returns that decision, on every rank."""
    def claim() -> bool:
        again = resume or resumes_a_restart(r, log)
        started = not again and has_config(r.out)
        stack.enter_context(claim_folder(r.out, "train", resume=again))
        if started:
            log(f"{r.out} holds a run that stopped before its first epoch ended: starting it over")
        return again
    return broadcast_flag(bool(on_rank0(claim, d, f"claim --out {r.out}")), d)


def resumes_a_restart(r: Recipe, log: Callable[[str], None]) -> bool:
    """True when torchrun has restarted the worker group (TORCHELASTIC_RESTART_COUNT > 0) and --out holds this
    launch's own run of this recipe: the run then continues from its last checkpoint (or starts over without one)."""
    restarts, out = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0), Path(r.out)
    if not restarts or not written_by_this_launch(out) or not has_config(out):
        return False
    saved, mine = read_config(out), yaml.safe_load(yaml.safe_dump(r.to_dict()))
    if {**saved, "model": None} != {**mine, "model": None}:  # the model's name is written as the model says it
        log(f"restart {restarts} of the worker group: {out} holds a run of another recipe; not resumed")
        return False
    log(f"restart {restarts} of the worker group: resuming this launch's run in {out}")
    return True


def check_sources_outside(r: Recipe) -> None:
    """Refuse a run whose --out is (or holds) the model it starts from or its teacher: it would overwrite them; and
    one whose model or teacher is a run with no model yet (still training, or stopped)."""
    out = Path(r.out).resolve()
    for flag, source in (("--init", r.init), ("--teacher", r.teacher)):
        if source and not str(source).startswith("hf-hub:") and out in (Path(source).resolve(),
                                                                         *Path(source).resolve().parents):
            raise ValueError(f"{flag} {source} lies in --out {r.out}: the run would overwrite it; "
                             "choose another --out")
        if source:
            check_model_written(source)


@contextlib.contextmanager
def torch_globals_kept() -> Iterator[None]:
    """Restore, on leaving, the torch globals a run changes: threads, TF32, cudnn.benchmark, the RNG states."""
    threads = torch.get_num_threads()
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = flags
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@dataclass
class Inputs:
    """The data as the run's steps and evaluations take it."""

    data: DataBundle
    classes: list[str]
    mean: tuple
    std: tuple
    feeder: BatchFeeder
    augment: BatchAugment
    view: Callable | None        # how stored test images larger than the training size are evaluated
    img_size: tuple[int, int]
    batch_size: int
    per_epoch: int


@dataclass
class Nets:
    """The model as it trains: ``model`` is what the task trains (the model, or an objective around it), ``net``
    the same as the steps run it (compiled and/or replicated)."""

    model: nn.Module
    net: nn.Module
    n_params: int
    channels_last: bool
    resize: ProgressiveResize
    lookahead: Lookahead | None = None


@dataclass
class Run:
    """Everything a run is made of once it is set up; the loop below reads and advances it."""

    r: Recipe
    d: Dist
    out: Path
    log: Callable[[str], None]
    now: Callable[[], float]
    task: Task
    inputs: Inputs
    nets: Nets
    state: TrainState
    clock: RunClock
    tb: TensorBoardLog | None = None
    bar: Progress | None = None
    marks: dict | None = None   # what every checkpoint carries besides the state: the run's id, the recipe as run

    @property
    def budget(self) -> float | None:
        return self.clock.budget

    @property
    def precision(self) -> str:
        return self.state.precision

    def out_of_time(self) -> bool:
        """A time budget that is spent (the reserve for the end kept back); the same answer on every rank."""
        return self.budget is not None and self.clock.progress(self.state.step) >= 1

    def evaluate(self, m: nn.Module, limit: int | None = None) -> dict[str, dict]:
        """The task's metrics per head on the test split, each rank on its contiguous shard (a view, read batch by
        batch), summed over the ranks; ``limit`` stops after that many images of the shard."""
        d, test, i = self.d, held_out(self.inputs.data), self.inputs
        start, stop = len(test.images) * d.rank // d.world, len(test.images) * (d.rank + 1) // d.world
        n = stop - start if limit is None else min(limit, stop - start)
        split = EvalSplit(images=test.images.narrow(0, start, n), labels=test.labels.narrow(0, start, n), first=start,
                          classes=i.classes, mean=i.mean, std=i.std, batch_size=self.eval_batch,
                          precision=self.precision, view=i.view, d=d)
        return self.task.evaluate(m, split)

    @property
    def eval_batch(self) -> int:
        return eval_batch_size(self.inputs, self.d)

    def stepper(self) -> Stepper:
        """What every step uses, as the run now stands (``net`` is made again when a stem freezes)."""
        r, state = self.r, self.state
        return Stepper(net=self.nets.net, augment=self.inputs.augment, loss=self.task.loss, optimizer=state.optimizer,
                       precision=self.precision, clip_grad=r.clip_grad, ema=state.ema, ema_decay=r.ema_decay,
                       accum_steps=r.accum_steps, scaler=state.scaler, channels_last=self.nets.channels_last,
                       correct=self.task.correct)


def held_out(data: DataBundle) -> ImageSet:
    """The images a run evaluates on: its test split, or the training images where none is held out (pre-training
    with val_fraction 0)."""
    return data.test if len(data.test.images) else data.train


def eval_batch_size(inputs: Inputs, d: Dist) -> int:
    """The batch of a pass without gradients (evaluation, a teacher's predictions made once) on each rank."""
    return max(inputs.batch_size // d.world, 256)


def _train(r: Recipe, d: Dist, resume: bool, log: Callable[[str], None], now: Callable[[], float]) -> dict[str, Any]:
    t_start = now()
    run = set_up(r, d, resume, log, now)
    if run.budget is not None and run.clock.reserve == 0 and r.budget_counts == "all":
        keep_back_final_evaluation(run)
    final_metrics, stopped_early = None, False
    end = run.out_of_time()  # a resumed run whose budget is already spent trains no more
    with contextlib.closing(run.bar):  # closed when the loop stops, an error included: the error is said last
        while not end and (run.budget is not None or run.state.epoch < r.epochs):
            row, cut = train_epoch(run)
            if row is None:  # the budget ran out before this epoch's first step: no epoch
                break
            end = cut or (run.budget is None and row.epoch == r.epochs) or run.out_of_time()
            if end and run.nets.lookahead is not None:
                run.nets.lookahead.finish(run.nets.model)
            for m in (run.nets.model, run.state.ema):  # BatchNorm's, which each rank updates from its own share
                if m is not None:
                    average_running_stats(m, run.d)
            if end or row.epoch % r.eval_every == 0:
                final_metrics, score = evaluate_epoch(run, row)
                end = end or run.out_of_time()  # the reserve for the end may have grown past what is left
                track_best(run, score)
                stopped_early = not end and early_stop_due(run)
                end = end or stopped_early
            record_epoch(run, row)
    return finish(run, final_metrics, stopped_early, t_start)


def set_up(r: Recipe, d: Dist, resume: bool, log: Callable[[str], None], now: Callable[[], float]) -> Run:
    """Check the output folder, build the task, model, data, augmentation and optimiser, restore a checkpoint, start
    the bar."""
    out = Path(r.out)
    ckpt = broadcast_state(on_rank0(lambda: own_checkpoint(out, config_values(r, None)), d, f"read {out / CHECKPOINT}"),
                           d) if resume else None  # by rank 0 (another machine may not see --out), before any work
    if r.threads:
        torch.set_num_threads(r.threads)
    if r.batch_size % (d.world * r.accum_steps):
        raise ValueError(f"batch_size {r.batch_size} is not divisible by {d.world} processes x "
                         f"{r.accum_steps} accumulation steps")
    set_fast_math(d.device)
    torch.manual_seed(r.seed)
    tb = TensorBoardLog(out) if r.log == "tensorboard" and d.is_main else None  # a missing package: before any data
    task = task_for(r, log)
    model, inputs, n_params, channels_last = build_inputs(r, d, task, fresh=ckpt is None and not r.init, log=log)
    config = config_values(r, getattr(model, "arch", None))
    identity = broadcast_state(on_rank0(lambda: run_identity(out, ckpt, inputs.data.identity, log, sources={
        "teacher": r.teacher, "init": r.init}), d, "check its data and models"), d)
    if ckpt is not None and d.device.type == "cpu" and not r.threads:  # the count it trained with
        log(resumed_threads(identity))
    model = task.wrap(model, inputs.mean, inputs.std)  # what trains, checkpoints and resumes
    task.make_loss(d.device, inputs.classes, inputs.mean, inputs.std)
    state = build_state(r, d, task, model, inputs, ckpt, log)
    if ckpt is not None:
        check_groups(state.optimizer, ckpt, out / CHECKPOINT, model)
        load_state(state, ckpt, model, out)
        log(f"resuming {out} after epoch {state.epoch}")
    elif resume:
        log(f"no checkpoint in {out} yet: starting the run from the beginning")
    spent = task.prepare(inputs.data.train, inputs.view, eval_batch_size(inputs, d), now)
    if ckpt is None:  # a resumed run counted them in its first session
        state.seconds += spent
    resize = ProgressiveResize(model, inputs.img_size, r.progressive_scale, r.progressive_until, log)
    nets = Nets(model=model, net=run_net(model, r, d), n_params=n_params, channels_last=channels_last, resize=resize,
                lookahead=Lookahead(model, r.lookahead_every, r.lookahead_decay) if r.lookahead_every else None)
    budget = r.time_budget * 60 if r.time_budget else None
    clock = RunClock(d, inputs.per_epoch * r.epochs, budget, seconds=state.seconds, reserve=state.reserve, now=now)
    if said := describe_warmup(r.warmup, None if budget else clock.total_steps, r.lr, r.min_lr):
        log(said)
    run = Run(r=r, d=d, out=out, log=log, now=now, task=task, inputs=inputs, nets=nets, state=state, clock=clock, tb=tb,
              marks=checkpoint_marks(identity, config))
    check_threads(identity, resumed=ckpt is not None, log=log)
    if d.is_main:  # only a run whose set-up succeeded leaves a recipe to resume (and its data's identity)
        write_run_files(out, config, identity)
    log(describe(run))
    run.bar = progress_bar(total=int(budget) if budget else clock.total_steps,
                           initial=min(int(state.seconds), int(budget)) if budget else state.step,
                           disable=not d.is_main, unit="s" if budget else "step", dynamic_ncols=True,
                           mininterval=1.0, file=sys.stderr,
                           bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    return run


def build_inputs(r: Recipe, d: Dist, task: Task, fresh: bool,
                 log: Callable[[str], None]) -> tuple[nn.Module, Inputs, int, bool]:
    """The model (on the device) and the data as the run takes it; returns
    (model, inputs, the model's parameter count, whether it runs channels-last)."""
    model, data, mean, std = build_model_and_data(r, d, task, log)
    if len(data.test.images) == 0 and r.pretrain != "none" and r.val_fraction == 0:
        log("val_fraction 0: no image is held out, so each evaluation measures the pre-training loss on the training "
            "images (unaugmented): how well the objective fits them, not how it generalises")
    elif len(data.test.images) == 0:
        raise ValueError(f"{data.name} leaves no test images ({len(data.train.images)} training images in "
                         f"{len(data.classes)} classes, val_fraction {r.val_fraction:g}): accepted: classes of at "
                         "least 2 images each, or a larger --val-fraction")
    classes = list(data.classes)
    freeze(model, r, log)
    model.pretrained_cfg.update(mean=list(mean), std=list(std), label_names=task.label_names(classes))
    channels_last = r.channels_last if r.channels_last is not None else channels_last_helps(model, d.device)
    model.to(d.device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if fresh:
        prepare_model(model, data.train.images, mean, std, log)
    n_params = sum(p.numel() for p in model.parameters())
    if d.device.type == "cpu" and not r.threads:  # from the work of a step and the cores other work leaves free
        image = torch.zeros(1, data.train.images.shape[1], *data.img_size, device=d.device)
        log(set_cpu_threads(3 * matmul_flops(model, image) * r.batch_size // (d.world * r.accum_steps)))
    n_train = len(data.train.images)
    batch_size, per_epoch = epoch_plan(n_train, r.batch_size, d.world * r.accum_steps)  # no image left out
    if said := describe_plan(n_train, r.batch_size, batch_size, per_epoch):
        log(said)
    on_device = r.data_on_device if r.data_on_device is not None else fits_on_device(
        data.train.images.nbytes, d.device)
    img_size = tuple(data.img_size)  # stored photos may be larger: training crops, evaluation resizes and crops
    crop_pct = (model.pretrained_cfg.get("crop_pct") or r.crop_pct) if r.init else r.crop_pct
    view = (lambda b: eval_view(b, img_size, crop_pct)) if tuple(data.train.images.shape[-2:]) != img_size else None
    inputs = Inputs(data=data, classes=classes, mean=mean, std=std,
                    feeder=BatchFeeder(data.train.images, data.train.labels, d.device, on_device),
                    augment=BatchAugment(r.augment, img_size, mean, std, len(classes)).to(d.device),
                    view=view, img_size=img_size, batch_size=batch_size, per_epoch=per_epoch)
    return model, inputs, n_params, channels_last


def build_state(r: Recipe, d: Dist, task: Task, model: nn.Module, inputs: Inputs, ckpt: dict | None,
                log: Callable[[str], None]) -> TrainState:
    """The state a run advances and checkpoints: the model, its optimiser (the task's betas), the plateau schedule,
    the EMA copy and the precision (a resumed run's own)."""
    n_first = min(len(inputs.data.train.images), inputs.batch_size // d.world)
    precision = ckpt["precision"] if ckpt is not None else choose_precision(
        r, model, inputs.augment, *inputs.feeder.gather(torch.arange(n_first)), d, log)
    state = TrainState(
        model=model,
        optimizer=recipe_optimizer(model, r, inputs.batch_size, d.device, task.betas),
        plateau=Plateau(r.plateau_patience, r.plateau_factor),
        ema=copy.deepcopy(model).eval().requires_grad_(False) if r.ema_decay > 0 else None,
        scaler=torch.amp.GradScaler(d.device.type) if precision == "fp16" else None,
        precision=precision, task=task)
    if r.layer_decay < 1:
        log(describe_groups(state.optimizer, r.layer_decay))
    return state


def load_state(state: TrainState, ckpt: dict[str, Any], model: nn.Module, out: Path) -> None:
    """Restore the checkpoint into the run's state; weights of another model are refused in one line."""
    try:
        state.load_state_dict(ckpt)
    except RuntimeError as e:  # load_state_dict: missing, unexpected or misshapen tensors
        saved, first = ckpt.get("arch") or "another model", str(e).strip().splitlines()[-1].strip()
        raise ValueError(f"{out / CHECKPOINT} holds the weights of {saved}, not of {model_name(model)} that the run "
                         f"trains ({first[:100].rstrip('.')}); accepted: a checkpoint of this run") from None


def model_name(model: nn.Module) -> str:
    """The model's registered name (a pre-training objective's: its encoder's)."""
    model = getattr(model, "encoder", model)
    return getattr(model, "arch", None) or type(model).__name__


def describe(run: Run) -> str:
    """The line that says what is trained, on what, how."""
    r, d, i = run.r, run.d, run.inputs
    train_images = i.data.train.images
    return (f"model {model_name(run.nets.model)} ({run.nets.n_params / 1e6:.2f}M parameters) on "
            f"{d.device}, {len(train_images)} training images {tuple(train_images.shape[1:])}"
            f"{f' trained at {i.img_size[0]}x{i.img_size[1]}' if i.view is not None else ''}"
            f"{' (on the device)' if d.device.type == 'cuda' and i.feeder.on_device else ''}, "
            f"{run.task.describe(i.classes)}, "
            f"batch {i.batch_size}{f' over {d.world} processes' if d.enabled else ''}"
            f"{f' in {r.accum_steps} micro-batches' if r.accum_steps > 1 else ''}, {run.precision}, "
            + (f"time budget {r.time_budget:g} min" + (" of training (evaluations not counted)"
                                                         if r.budget_counts == "training" else "")
               if run.budget else f"{r.epochs} epochs of {i.per_epoch} steps"))


def run_net(model: nn.Module, r: Recipe, d: Dist) -> nn.Module:
    """The model as the steps run it: compiled (one graph per input size) and/or replicated. DistributedDataParallel
    reduces the gradients of the parameters that train when it is made: made again after a freeze."""
    net = torch.compile(model, dynamic=False) if r.compile else model
    if d.enabled:
        net = nn.parallel.DistributedDataParallel(net, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    return net


def keep_back_final_evaluation(run: Run) -> None:
    """Keep back the end's evaluation before the first one has been timed: one batch, timed, scaled to the test
    split, after one untimed batch that pays for warm-up (a CPU's kernels are chosen on the first call), so that a
    run evaluated only at the end still ends within its budget."""
    run.evaluate(run.nets.model, limit=run.eval_batch)  # every rank: it sums over them; its metrics are read back
    t_probe = run.now()
    run.evaluate(run.nets.model, limit=run.eval_batch)
    shard = len(held_out(run.inputs.data).images) // run.d.world
    capped = run.clock.keep_back((2.0 if run.state.ema is not None else 1.0) * (run.now() - t_probe)
                                 * shard / min(run.eval_batch, shard))
    run.log(f"kept back {run.clock.reserve:.0f} s of the budget for the final evaluation"
            + (" (half the budget: the evaluation was timed at more; the run may end late)" if capped else ""))


def epoch_batches(run: Run, epoch: int) -> list[torch.Tensor]:
    """This rank's share of every batch of the epoch, in an order that depends on (seed, epoch) only (the whole
    batches' sizes: ``batch_sizes``)."""
    r, d, n_train = run.r, run.d, len(run.inputs.data.train.images)
    g = torch.Generator().manual_seed(epoch_seed(r.seed, epoch, 0))
    if r.augment.repeated_aug > 1:
        order = repeated_aug_indices(n_train, r.augment.repeated_aug, g)
    else:
        order = torch.randperm(n_train, generator=g)
    return [batch[d.rank::d.world] for batch in order.tensor_split(run.inputs.per_epoch)]  # near-equal batches


def batch_sizes(run: Run) -> list[int]:
    """The size of every whole batch of an epoch (all ranks together), as ``epoch_batches`` splits it."""
    return [len(b) for b in torch.arange(len(run.inputs.data.train.images)).tensor_split(run.inputs.per_epoch)]


def train_epoch(run: Run) -> tuple[EpochRow | None, bool]:
    """One epoch of steps; returns its row (None when the budget ran out before its first step) and whether the
    budget cut it short."""
    r, d, state, nets = run.r, run.d, run.state, run.nets
    epoch = state.epoch
    torch.manual_seed(epoch_seed(r.seed, epoch, d.rank))
    batches = epoch_batches(run, epoch)
    nets.model.train()
    run.task.loss.train()
    meter = EpochMeter(d.device)
    if r.freeze_stem_after and epoch >= r.freeze_stem_after and hasattr(nets.model, "freeze_stem"):
        if nets.model.freeze_stem() and d.enabled:  # newly frozen: the replicas stop reducing its gradients
            nets.net = run_net(nets.model, r, d)
    epoch_t0 = run.now()
    run.clock.start()
    lr, steps_before, cut, every, stepper = r.lr, state.step, False, figures_every(d.device), run.stepper()
    sizes = batch_sizes(run)
    for i, (images, labels) in enumerate(run.inputs.feeder.batches(batches)):
        p = run.clock.progress(state.step)
        if run.budget is not None and p >= 1:
            cut = True
            break
        share = step_share(p, state.step, run.clock.total_steps)
        lr = warmup_cosine(p, r.lr, r.min_lr, r.warmup, share) * state.plateau.scale
        size = nets.resize.size_at(p)
        set_lr(state.optimizer, lr)  # times each group's lr_scale (layer decay, BatchNorm biases, SGD)
        stepper.ema_decay = ema_decay_at(p, r.ema_decay, r.ema_start)
        images = run.inputs.augment.alternate(images, batches[i], epoch, r.seed)
        loss, hits = train_step(stepper, Batch(images, labels, size, share=len(images) * d.world / sizes[i],
                                               index=batches[i]))
        state.step += 1
        run.task.after_step(nets.model)
        if nets.lookahead is not None:
            nets.lookahead.step(nets.model, state.step, run.clock.progress(state.step))
        meter.add(loss, hits, len(images))
        if i % every == 0 or i == run.inputs.per_epoch - 1:
            show_running(run, meter, epoch, epoch_t0)
        if run.budget:
            run.bar.goto(run.clock.seconds())
        else:
            run.bar.update(1)
    epoch_seconds = run.now() - epoch_t0
    if cut and state.step == steps_before:
        return None, cut
    totals = meter.totals(d)
    state.nonfinite += int(totals["nonfinite"])
    row = EpochRow(epoch=epoch + 1, step=state.step, train_loss=totals["loss"],
                   train_acc=run.task.epoch_accuracy(totals), lr=lr,
                   images_per_second=totals["seen"] / max(epoch_seconds, 1e-9),
                   input_size=list(nets.resize.last) if nets.resize.last is not None else None)
    return row, cut


def show_running(run: Run, meter: EpochMeter, epoch: int, epoch_t0: float) -> None:
    """Read the running totals back: stop a diverged run, and show loss, accuracy and speed on the bar."""
    d, state = run.d, run.state
    running = meter.totals()
    check_finite(all_reduce_value(running["nonfinite"], d) + state.nonfinite, run.precision, run.r.max_nonfinite,
                 state.step)
    if d.is_main:
        rate = running["seen"] * d.world / max(run.now() - epoch_t0, 1e-9)
        run.bar.set_postfix_str(f"epoch {epoch + 1} {run.task.running(running)} {rate:.0f} img/s", refresh=False)


def evaluate_epoch(run: Run, row: EpochRow) -> tuple[dict[str, dict], float]:
    """Evaluate the model (and its EMA copy) into the row; returns the better one's metrics (marked ``ema``
    when it is the EMA copy's) and its score. Its time is kept back for the run's final evaluation, or, when the
    budget counts training only, not counted at all."""
    t_eval, off_clock = run.now(), run.r.budget_counts == "training"
    with run.clock.paused(off_clock):
        metrics = run.evaluate(run.nets.model)
        logits = metrics["logits"]
        row.test_loss, row.test_top1, row.test_top5 = logits["loss"], logits["top1"], logits["top5"]
        if "cls" in metrics:
            row.test_top1_cls, row.test_top1_dist = metrics["cls"]["top1"], metrics["dist"]["top1"]
        metrics, row.ema_test_top1 = better_of_ema(run, metrics)
    if not off_clock:
        run.clock.keep_back(run.now() - t_eval)
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


def track_best(run: Run, score: float) -> None:
    """Step the plateau schedule and the best score so far."""
    r, state = run.r, run.state
    if state.plateau.step(score) and r.plateau_patience:
        run.log(f"no improvement for {r.plateau_patience} evaluations: lr scale now {state.plateau.scale:g}")
    if score > state.best:
        state.best, state.since_best = score, 0
    else:
        state.since_best += 1


def early_stop_due(run: Run) -> bool:
    """True (and said) when the recipe's early stopping ends the run here."""
    if run.r.early_stop and run.state.since_best >= run.r.early_stop:
        run.log(f"early stop: no improvement for {run.state.since_best} evaluations")
        return True
    return False


def record_epoch(run: Run, row: EpochRow) -> None:
    """Add the row to the history, then (rank 0) log it, checkpoint and rewrite metrics.jsonl."""
    state = run.state
    state.seconds, state.reserve = run.clock.seconds(), run.clock.reserve
    row.elapsed_seconds = state.seconds
    state.history.append(row.to_dict())
    state.epoch += 1
    if run.d.is_main:
        run.log(row.line())
        check_claimed(run.out)
        save_checkpoint(run.out, state, arch=model_name(run.nets.model), **run.marks)
        write_metrics(run.out, [EpochRow.from_dict(h) for h in state.history])
        if run.tb is not None:
            run.tb.scalars(row.epoch, row.to_dict())
    barrier(run.d)


def finish(run: Run, final_metrics: dict | None, stopped_early: bool, t_start: float) -> dict[str, Any]:
    """The end: evaluate, save the model, the figures and the summary (last: it marks the run finished)."""
    r, d, state, model, data = run.r, run.d, run.state, run.nets.model, run.inputs.data
    if not state.history:
        raise ValueError(f"--time-budget {r.time_budget:g} min ran out before the first training step (after "
                         f"{run.clock.reserve:.0f} s kept back for the final evaluation); accepted: a budget that "
                         "leaves time to train")
    if final_metrics is None or "test_loss" not in state.history[-1]:  # resumed after its last epoch
        final_metrics, _ = better_of_ema(run, run.evaluate(model))  # the choice the last epoch made
    in_sync = replicas_agree(model, d)
    if not in_sync:
        run.log("warning: the replicas' weights differ between processes; the saved model is rank 0's")
    use_ema = bool(final_metrics.pop("ema", False))
    final_model = state.ema if use_ema else model
    run.nets.resize.restore()
    if not d.is_main:
        return {}
    history = [EpochRow.from_dict(h) for h in state.history]
    m = final_metrics["logits"]
    summary = Summary(
        top1=m["top1"], top5=m["top5"], test_loss=m["loss"], per_class=m["per_class"],
        images_per_second=run_images_per_second(history),
        train_seconds=state.seconds, epochs=len(history), steps=state.step, stopped_early=stopped_early,
        model=model_name(model), parameters=run.nets.n_params, precision=run.precision, device=str(d.device),
        data=data.name, num_train=len(data.train.images), num_test=len(data.test.images),
        classes=run.inputs.classes, ema=use_ema, tta=r.tta, processes=d.world, replicas_in_sync=in_sync,
        nonfinite_steps=state.nonfinite, distill=r.distill, teacher=r.teacher, time_budget_minutes=r.time_budget,
        heads={"cls": final_metrics["cls"]["top1"], "dist": final_metrics["dist"]["top1"], "mean": m["top1"]}
        if "cls" in final_metrics else None, pretrain=r.pretrain, unreadable=list(data.unreadable))
    if r.freeze_backbone or r.freeze_blocks:
        for p in final_model.parameters():
            p.requires_grad = True
    check_claimed(run.out)
    run.task.save(final_model, run.out, run.inputs.mean, run.inputs.std)
    figures = run.task.draw(run.out, history, m, f"{summary.model} on {data.name}", run.inputs.classes)
    if run.tb is not None:
        for png in figures:
            run.tb.image(Path(png).stem, run.out / png, len(history))
        run.tb.close()
    summary.wall_seconds = run.now() - t_start
    check_claimed(run.out)
    write_summary(run.out, summary)
    return summary.to_dict()


def check_finite(nonfinite: float, precision: str, bound: int, step: int) -> None:
    """Stop a run whose loss is no longer finite: at once in float32/bf16 (it diverged), after ``bound``
    skipped steps in fp16 (whose gradient scaler skips such steps while it finds its scale)."""
    if nonfinite == 0 or math.isnan(nonfinite):
        return
    if precision != "fp16":
        raise FloatingPointError(f"the training loss is not finite (by step {step}, {precision}): the run diverged; "
                                 "train it again with a lower --lr, --clip-grad, or --precision fp32 (in a new --out "
                                 "once it has a checkpoint: --resume keeps the recipe)")
    if nonfinite > bound:
        raise FloatingPointError(f"{int(nonfinite)} fp16 steps had a non-finite loss and were skipped (bound "
                                 f"--max-nonfinite {bound}); try --precision bf16 or fp32, or a lower --lr")
