"""The set-up of a run, everything decided once before the loop: the output folder claimed, the model and data
(build.py), the preprocessing, the CPU threads and the precision, the state a checkpoint restores; the loop
(trainer.py) gets them as one ``Run``."""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml

from ..data.augment import BatchAugment
from ..data.decode import default_workers
from ..data.shards import ShardReader
from ..data.sources import DataBundle, ImageSet
from ..data.views import Preprocess, eval_view
from ..devices import auto_precision, eval_batch, set_cpu_threads, to_device
from ..errors import VitlabError
from ..models.summary import matmul_flops, matmul_macs
from ..progress import Progress, progress_bar
from ..runs.folder import check_claimed, check_model_written, claim_folder, written_by_this_launch
from ..runs.format import CHECKPOINT, config_values, has_config, read_config
from ..runs.identity import (
    check_threads,
    checkpoint_marks,
    own_checkpoint,
    resumed_threads,
    run_identity,
    write_run_files,
)
from .build import build_model_and_data, describe_plan, epoch_plan, freeze, prepare_model
from .clock import RunClock
from .distributed import Dist, barrier, broadcast_flag, broadcast_state, on_rank0
from .feed import BatchFeeder, EpochPlan, ShardFeeder, fits_on_device
from .optim import Lookahead, describe_groups, recipe_optimizer
from .progressive import ProgressiveResize
from .recipe import Recipe
from .schedule import LrSchedule, Plateau
from .shard import SHARDED_FIELDS, check_can_shard, load_sharded, save_sharded, shard_model
from .state import TrainState, place_in_epoch, save_checkpoint
from .step import Stepper, channels_last_helps
from .tasks import EvalSplit, Task, task_for
from .tensorboard import TensorBoardLog


@dataclass
class Run:
    """Everything a run is made of once it is set up; the loop reads and advances it."""

    recipe: Recipe
    dist: Dist
    out: Path
    log: Callable[[str], None]
    now: Callable[[], float]
    task: Task
    # the data as the steps and the evaluations take it
    data: DataBundle
    classes: list[str]
    mean: tuple
    std: tuple
    feeder: BatchFeeder
    augment: BatchAugment
    view: Callable | None        # how stored test images larger than the training size are evaluated
    batch_size: int
    per_epoch: int
    # the model as it trains: ``model`` is what the task trains (the model, or an objective around it), ``net`` the
    # same as the steps run it (compiled and/or replicated)
    model: nn.Module
    net: nn.Module
    n_params: int
    channels_last: bool
    resize: ProgressiveResize
    lookahead: Lookahead | None
    state: TrainState
    clock: RunClock
    schedule: LrSchedule
    tb: TensorBoardLog | None = None
    bar: Progress | None = None
    marks: dict | None = None   # what every checkpoint carries besides the state: the run's id, the recipe as run
    eval_seconds_per_image: float | None = None  # measured: the probe before the first step, then each evaluation
    said_sample: bool = False
    skeleton: nn.Module | None = None  # --shard fsdp, rank 0: the model's copy (meta) the whole model is gathered into

    @property
    def sharded(self) -> bool:
        return self.recipe.shard == "fsdp"

    @property
    def budget(self) -> float | None:
        return self.clock.budget

    @property
    def precision(self) -> str:
        return self.state.precision

    @property
    def eval_batch(self) -> int:
        batch = eval_batch_size(self.batch_size, self.dist)
        return even_batches(len(held_out(self.data).images), batch, self.dist.world) if self.sharded else batch

    def out_of_time(self) -> bool:
        """A time budget that is spent (the reserve for the end kept back), or the recipe's steps taken; the same
        answer on every rank."""
        return (self.budget is not None or bool(self.recipe.steps)) and self.clock.progress(self.state.step) >= 1

    def evaluate(self, model: nn.Module, limit: int | None = None, sample: int | None = None) -> dict[str, dict]:
        """The task's metrics per head on the test split, each rank on its contiguous shard (a view, read batch by
        batch), summed over the ranks; ``limit`` stops after that many images of the shard; ``sample`` takes about
        that many images of the shard, evenly spaced through it (a test split in class order keeps its shares)."""
        dist, test = self.dist, held_out(self.data)
        start, stop = len(test.images) * dist.rank // dist.world, len(test.images) * (dist.rank + 1) // dist.world
        n = stop - start if limit is None else min(limit, stop - start)
        images, labels = test.images.narrow(0, start, n), test.labels.narrow(0, start, n)
        if sample is not None and sample < n:
            every = -(-n // sample)
            images, labels = images[::every], labels[::every]
        split = EvalSplit(images=images, labels=labels, first=start, classes=self.classes, mean=self.mean,
                          std=self.std, batch_size=self.eval_batch, precision=self.precision, view=self.view, dist=dist)
        return self.task.evaluate(model, split)

    def sample_size(self, epoch_seconds: float) -> int | None:
        """The test images an evaluation during a budget run takes: as many as EVAL_SHARE of the epoch's training
        time evaluates at the measured rate (at least EVAL_SAMPLE_MIN); None (the whole split) without a budget, or
        before the rate is measured."""
        if self.budget is None or not self.eval_seconds_per_image:
            return None
        return max(EVAL_SAMPLE_MIN, int(EVAL_SHARE * epoch_seconds / self.eval_seconds_per_image))

    def save_within_epoch(self, steps: int, images: int) -> None:
        """After ``steps`` of the epoch (``images`` of it, all ranks): the checkpoint that --checkpoint-every asks
        for within an epoch, with the epoch's place (the sample offset, the shard readers of each rank and rank 0's
        random state), from which a resumed run goes on as the run that never stopped."""
        every, state, dist = self.recipe.checkpoint_every, self.state, self.dist
        if not every or self.budget is not None or state.step % every or steps >= self.per_epoch:
            return
        state.resume_at = place_in_epoch(images, self.feeder.workers, dist.device)
        state.seconds, state.reserve = self.clock.seconds(), self.clock.reserve
        self.checkpoint()
        state.resume_at = None
        barrier(dist)

    def checkpoint(self) -> None:
        """Write checkpoint.pt: rank 0 alone, or with --shard fsdp every rank its part of the model and optimizer."""
        if self.dist.is_main:
            check_claimed(self.out)
        if self.sharded:
            save_sharded(self.out, self.state, self.dist, arch=model_name(self.model), **self.marks)
        elif self.dist.is_main:
            save_checkpoint(self.out, self.state, arch=model_name(self.model), **self.marks)

    def stepper(self) -> Stepper:
        """What every step uses, as the run now stands (``net`` is made again when a stem freezes)."""
        recipe, state = self.recipe, self.state
        return Stepper(net=self.net, augment=self.augment, loss=self.task.loss, optimizer=state.optimizer,
                       precision=self.precision, clip_grad=recipe.clip_grad, ema=state.ema, ema_decay=recipe.ema_decay,
                       accum_steps=recipe.accum_steps, scaler=state.scaler, channels_last=self.channels_last,
                       correct=self.task.correct)


def held_out(data: DataBundle) -> ImageSet:
    """The images a run evaluates on: its test split, or the training images where none is held out (pre-training
    with val_fraction 0)."""
    return data.test if len(data.test.images) else data.train


# A budget run evaluates during training on an evenly spaced sample of the test split that costs this share of the
# epoch's training time (at least EVAL_SAMPLE_MIN images); the whole split once at the end.
EVAL_SHARE = 0.1
EVAL_SAMPLE_MIN = 500


def eval_batch_size(batch_size: int, dist: Dist) -> int:
    """The batch of a pass without gradients (evaluation, a teacher's predictions made once) on each rank: a CPU's
    (devices.eval_batch), on a GPU the training batch's share, at least 256."""
    if dist.device.type == "cpu":
        return eval_batch(dist.device)
    return max(batch_size // dist.world, 256)


def even_batches(n: int, batch: int, world: int) -> int:
    """The smallest batch from ``batch`` up that splits every rank's contiguous shard of ``n`` images into as many
    batches as the others': a sharded model's forward pass is a collective that every rank must take as often."""
    shards = {n * (r + 1) // world - n * r // world for r in range(world)}
    while len({-(-k // batch) for k in shards}) > 1:
        batch += 1
    return batch


def set_up(recipe: Recipe, dist: Dist, resume: bool, log: Callable[[str], None], now: Callable[[], float]) -> Run:
    """Build the run in the order its parts need each other: the checkpoint to resume, the task, the model and data,
    the threads, the preprocessing, the feed, the optimiser state (the precision), the task's preparation, the clock;
    then record the run's files and start the bar."""
    out = Path(recipe.out)
    ckpt = broadcast_state(on_rank0(lambda: own_checkpoint(out, config_values(recipe, None)), dist,
                                    f"read {out / CHECKPOINT}"),
                           dist) if resume else None  # by rank 0 (another machine may not see --out), before any work
    check_batch(recipe, dist)
    if recipe.shard == "fsdp":
        check_can_shard(None, dist)  # before any work; the model is checked once built
    set_fast_math(dist.device)
    torch.manual_seed(recipe.seed)
    tb = TensorBoardLog(out) if recipe.log == "tensorboard" and dist.is_main else None  # a missing package: first
    task = task_for(recipe, log)
    model, data, decoded = build_model_and_data(recipe, dist, task, log)
    check_test_split(recipe, data, log)
    identity = broadcast_state(on_rank0(lambda: run_identity(out, ckpt, data.identity, log, sources={
        "teacher": recipe.teacher, "init": recipe.init}), dist, "check its data and models"), dist)
    set_threads(recipe, dist, model, data, identity, ckpt is not None, log)
    prep = preprocessing(recipe, decoded)
    classes, img_size = list(data.classes), tuple(data.img_size)  # stored photos may be larger: see ``view``
    channels_last = place_model(recipe, dist, model, task, data, prep, fresh=ckpt is None and not recipe.init, log=log)
    n_params = sum(p.numel() for p in model.parameters())
    batch_size, per_epoch = plan_epoch(recipe, dist, data.num_train, log)
    feeder = make_feeder(recipe, dist, data)
    augment = BatchAugment(recipe.augment, img_size, prep.mean, prep.std, len(classes)).to(dist.device)
    view = eval_view_of(prep) if tuple(data.train.images.shape[-2:]) != img_size else None
    config = config_values(recipe, getattr(model, "arch", None))
    model = task.wrap(model, prep.mean, prep.std)  # what trains, checkpoints and resumes
    task.make_loss(dist.device, classes, prep.mean, prep.std)
    precision = run_precision(recipe, dist, model, data.train, augment, batch_size, ckpt, log)
    skeleton = shard_model(model, dist, precision) if recipe.shard == "fsdp" else None  # before the optimizer
    state = build_state(recipe, dist, task, model, batch_size, precision, log)
    restore(state, ckpt, model, out, resume, log, dist if recipe.shard == "fsdp" else None)
    spent = task.prepare(data.train, view, eval_batch_size(batch_size, dist), now)
    if ckpt is None:  # a resumed run counted them in its first session
        state.seconds += spent
    resize = ProgressiveResize(model, img_size, recipe.progressive_scale, recipe.progressive_until, log)
    net = run_net(model, recipe, dist)  # replicas made in step before the lookahead copies the weights
    lookahead = Lookahead(model, recipe.lookahead_every, recipe.lookahead_decay) if recipe.lookahead_every else None
    budget = recipe.time_budget * 60 if recipe.time_budget else None
    clock = RunClock(dist, recipe.steps or per_epoch * recipe.epochs, budget, seconds=state.seconds,
                     reserve=state.reserve, now=now)
    schedule = LrSchedule(recipe.lr, recipe.min_lr, recipe.warmup, clock.total_steps, state.plateau,
                          by_time=budget is not None)
    if said := schedule.describe():
        log(said)
    run = Run(recipe=recipe, dist=dist, out=out, log=log, now=now, task=task, data=data, classes=classes,
              mean=prep.mean, std=prep.std, feeder=feeder, augment=augment, view=view,
              batch_size=batch_size, per_epoch=per_epoch, model=model, net=net,
              n_params=n_params, channels_last=channels_last, resize=resize, lookahead=lookahead, state=state,
              clock=clock, schedule=schedule, tb=tb, marks=checkpoint_marks(identity, config), skeleton=skeleton)
    if dist.is_main:  # only a run whose set-up succeeded leaves a recipe to resume (and its data's identity)
        write_run_files(out, config, identity)
    log(describe(run))
    run.bar = run_bar(run)
    if run.budget is not None and run.clock.reserve == 0 and recipe.budget_counts == "all":
        keep_back_final_evaluation(run)
    return run


def check_batch(recipe: Recipe, dist: Dist) -> None:
    if recipe.batch_size % (dist.world * recipe.accum_steps):
        raise VitlabError(f"batch_size {recipe.batch_size} is not divisible by {dist.world} processes x "
                          f"{recipe.accum_steps} accumulation steps")


def check_test_split(recipe: Recipe, data: DataBundle, log: Callable[[str], None]) -> None:
    if len(data.test.images) == 0 and recipe.pretrain != "none" and recipe.val_fraction == 0:
        log("val_fraction 0: no image is held out, so each evaluation measures the pre-training loss on the training "
            "images (unaugmented): how well the objective fits them, not how it generalises")
    elif len(data.test.images) == 0 and recipe.pretrain != "none":  # pre-training can evaluate on what it trains on
        raise VitlabError(f"{data.name} leaves no test images ({len(data.train.images)} training images, val_fraction "
                          f"{recipe.val_fraction:g}); accepted: more images, or --val-fraction 0 (each evaluation "
                          "then measures the pre-training loss on the training images)")
    elif len(data.test.images) == 0:
        raise VitlabError(f"{data.name} leaves no test images ({len(data.train.images)} training images in "
                          f"{len(data.classes)} classes, val_fraction {recipe.val_fraction:g}): accepted: classes of "
                          "at least 2 images each, or a larger --val-fraction")


def set_threads(recipe: Recipe, dist: Dist, model: nn.Module, data: DataBundle, identity: dict[str, Any],
                resumed: bool, log: Callable[[str], None]) -> None:
    """The CPU threads the run trains with, decided here only: --threads; else on a resume the count the run trained
    with (run.json); else on a CPU from the work of a step and the cores other work leaves free. A new run records
    the count in its identity; a resume with another count is warned of."""
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    elif dist.device.type == "cpu" and resumed and identity.get("threads"):
        log(resumed_threads(identity))
    elif dist.device.type == "cpu":
        image = torch.zeros(1, data.train.images.shape[1], *data.img_size, device=dist.device)
        log(set_cpu_threads(3 * matmul_flops(model, image) * recipe.batch_size // (dist.world * recipe.accum_steps)))
    check_threads(identity, resumed=resumed, log=log)


def preprocessing(recipe: Recipe, decoded: Preprocess) -> Preprocess:
    """The preprocessing the run applies to an image file, decided here only (the model records it, evaluation
    applies it): the rule its images were decoded by, or with --store-size the shorter side to store_size and a
    centre crop (bicubic) of the model's crop_pct (--init) or the recipe's."""
    if recipe.store_size is None:
        return decoded
    return replace(decoded, crop_mode="center", crop_pct=decoded.crop_pct if recipe.init else recipe.crop_pct,
                   interpolation="bicubic")


def eval_view_of(prep: Preprocess) -> Callable[[torch.Tensor], torch.Tensor]:
    """How stored images larger than the training size are evaluated: resized and cropped as ``prep`` says."""
    return lambda batch: eval_view(batch, prep.size, prep.crop_pct, prep.interpolation, prep.crop_mode,
                                   prep.crop_offset)


def place_model(recipe: Recipe, dist: Dist, model: nn.Module, task: Task, data: DataBundle, prep: Preprocess,
                fresh: bool, log: Callable[[str], None]) -> bool:
    """Freeze what the recipe says, record the preprocessing and the labels in the model's pretrained_cfg, move it to
    the device and, in a fresh run, initialise it from the data; returns whether it runs channels-last."""
    freeze(model, recipe, log)
    model.pretrained_cfg.update(prep.to_cfg(), label_names=task.label_names(list(data.classes)))
    channels_last = recipe.channels_last if recipe.channels_last is not None else channels_last_helps(model,
                                                                                                       dist.device)
    model.to(dist.device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if fresh:
        prepare_model(model, data.train.images, prep.mean, prep.std, log)
    return channels_last


def make_feeder(recipe: Recipe, dist: Dist, data: DataBundle) -> BatchFeeder | ShardFeeder:
    """Where the training batches come from: the store's rows (on the device when they fit), or the shards, read by
    this rank's DataLoader workers (--workers, else up to SHARD_WORKERS)."""
    if data.shards is not None:
        workers = recipe.workers or min(SHARD_WORKERS, default_workers())
        reader = ShardReader(data.shards, dist.rank, dist.world, workers)
        return ShardFeeder(reader, dist.device, reader.workers)
    on_device = recipe.data_on_device if recipe.data_on_device is not None else fits_on_device(
        data.train.images.nbytes, dist.device)
    return BatchFeeder(data.train.images, data.train.labels, dist.device, on_device)


SHARD_WORKERS = 4  # DataLoader processes decoding shards on each rank, at most (one per CPU below that)


def plan_epoch(recipe: Recipe, dist: Dist, n_train: int, log: Callable[[str], None]) -> tuple[int, int]:
    """(largest batch, steps per epoch): no image left out."""
    batch_size, per_epoch = epoch_plan(n_train, recipe.batch_size, dist.world * recipe.accum_steps)
    if said := describe_plan(n_train, recipe.batch_size, batch_size, per_epoch):
        log(said)
    return batch_size, per_epoch


def run_precision(recipe: Recipe, dist: Dist, model: nn.Module, train: ImageSet, augment: BatchAugment,
                  batch_size: int, ckpt: dict | None, log: Callable[[str], None]) -> str:
    """The run's precision, decided here only (a resumed run's own)."""
    if ckpt is not None:
        return ckpt["precision"]
    n_first = min(len(train.images), batch_size // dist.world)
    return choose_precision(recipe, model, augment, to_device(train.images[:n_first], dist.device),
                            to_device(train.labels[:n_first], dist.device), dist, log)


def build_state(recipe: Recipe, dist: Dist, task: Task, model: nn.Module, batch_size: int, precision: str,
                log: Callable[[str], None]) -> TrainState:
    """The state a run advances and checkpoints: the model, its optimiser (the task's betas), the plateau schedule,
    the EMA copy and the precision."""
    state = TrainState(
        model=model,
        optimizer=recipe_optimizer(model, recipe, batch_size, dist.device, task.betas),
        plateau=Plateau(recipe.plateau_patience, recipe.plateau_factor),
        ema=copy.deepcopy(model).eval().requires_grad_(False) if recipe.ema_decay > 0 else None,
        scaler=torch.amp.GradScaler(dist.device.type) if precision == "fp16" else None,
        precision=precision, task=task)
    if recipe.layer_decay < 1:
        log(describe_groups(state.optimizer, recipe.layer_decay))
    return state


def restore(state: TrainState, ckpt: dict[str, Any] | None, model: nn.Module, out: Path, resume: bool,
            log: Callable[[str], None], sharded: Dist | None = None) -> None:
    """Restore the checkpoint into the run's state (``sharded``: a sharded model's, every rank reading its part);
    weights of another model, or an optimiser of other parameter groups, are refused in one line."""
    if ckpt is None:
        if resume:
            log(f"no checkpoint in {out} yet: starting the run from the beginning")
        return
    if "sharded" in ckpt and sharded is None:
        raise VitlabError(f"{out / CHECKPOINT} holds a sharded model ({', '.join(SHARDED_FIELDS)} in "
                          f"{ckpt['sharded'].get('folder')}); accepted: resume it with shard='fsdp' under torchrun")
    check_groups(state.optimizer, ckpt, out / CHECKPOINT, model)
    try:
        if sharded is not None:
            load_sharded(out, ckpt, state, sharded)
        else:
            state.load_state_dict(ckpt)
    except RuntimeError as e:  # load_state_dict: missing, unexpected or misshapen tensors
        saved, first = ckpt.get("arch") or "another model", str(e).strip().splitlines()[-1].strip()
        raise VitlabError(f"{out / CHECKPOINT} holds the weights of {saved}, not of {model_name(model)} that the run "
                          f"trains ({first[:100].rstrip('.')}); accepted: a checkpoint of this run") from None
    at = state.resume_at
    log(f"resuming {out} after epoch {state.epoch}"
        + (f", at image {at['images']} of epoch {state.epoch + 1} (step {state.step})" if at else ""))


def model_name(model: nn.Module) -> str:
    """The model's registered name (a pre-training objective's: its encoder's)."""
    model = getattr(model, "encoder", model)
    return getattr(model, "arch", None) or type(model).__name__


def describe(run: Run) -> str:
    """The line that says what is trained, on what, how."""
    recipe, dist = run.recipe, run.dist
    train_images = run.data.train.images
    return (f"model {model_name(run.model)} ({run.n_params / 1e6:.2f}M parameters) on "
            f"{dist.device}, {run.data.num_train} training images {tuple(train_images.shape[1:])}"
            f"{' streamed from shards' if run.data.shards is not None else ''}"
            f"{f' trained at {run.data.img_size[0]}x{run.data.img_size[1]}' if run.view is not None else ''}"
            f"{' (on the device)' if dist.device.type == 'cuda' and run.feeder.on_device else ''}, "
            f"{run.task.describe(run.classes)}, "
            f"batch {run.batch_size}{f' over {dist.world} processes' if dist.enabled else ''}"
            f"{' (model sharded: FSDP2)' if run.sharded else ''}"
            f"{f' in {recipe.accum_steps} micro-batches' if recipe.accum_steps > 1 else ''}, {run.precision}, "
            + (f"time budget {recipe.time_budget:g} min" + (" of training (evaluations not counted)"
                                                              if recipe.budget_counts == "training" else "")
               if run.budget else f"{recipe.steps} steps ({run.per_epoch} an epoch)" if recipe.steps
               else f"{recipe.epochs} epochs of {run.per_epoch} steps"))


def run_bar(run: Run) -> Progress:
    """The bar: seconds of a time budget, else steps."""
    budget, state = run.budget, run.state
    return progress_bar(total=int(budget) if budget else run.clock.total_steps,
                        initial=min(int(state.seconds), int(budget)) if budget else state.step,
                        disable=not run.dist.is_main, unit="s" if budget else "step", dynamic_ncols=True,
                        mininterval=1.0, file=sys.stderr,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")


def run_net(model: nn.Module, recipe: Recipe, dist: Dist) -> nn.Module:
    """The model as the steps run it: compiled (one graph per input size) and/or replicated. DistributedDataParallel
    reduces the gradients of the parameters that train when it is made: made again after a freeze."""
    net = torch.compile(model, dynamic=False) if recipe.compile else model
    if dist.enabled and recipe.shard == "none":  # a sharded model reduces its own gradients
        net = nn.parallel.DistributedDataParallel(net, device_ids=[dist.device.index] if dist.device.type == "cuda"
                                                  else None)
    return net


def keep_back_final_evaluation(run: Run) -> None:
    """Keep back the end's evaluation before the first one has been timed: one batch, timed, scaled to the test
    split, after one untimed batch that pays for warm-up (a CPU's kernels are chosen on the first call), so that a
    run evaluated only at the end still ends within its budget."""
    run.evaluate(run.model, limit=run.eval_batch)  # every rank: it sums over them; its metrics are read back
    shard = len(held_out(run.data).images) // run.dist.world
    timed = min(2 * run.eval_batch, shard)
    t_probe = run.now()
    run.evaluate(run.model, limit=timed)
    run.eval_seconds_per_image = (run.now() - t_probe) / max(timed, 1)
    capped = run.clock.keep_back((2.0 if run.state.ema is not None else 1.0) * run.eval_seconds_per_image * shard)
    run.log(f"kept back {run.clock.reserve:.0f} s of the budget for the final evaluation of {shard} test images "
            f"(timed on {timed})"
            + (" (half the budget: the evaluation was timed at more; the run may end late)" if capped else ""))


def claim_out(stack: contextlib.ExitStack, recipe: Recipe, dist: Dist, resume: bool,
              log: Callable[[str], None]) -> bool:
    """Rank 0 claims --out for the run (the one rank that writes there: another machine's ranks may not see it) and
    decides whether it resumes; returns that decision, on every rank."""
    def claim() -> bool:
        again = resume or resumes_a_restart(recipe, log)
        started = not again and has_config(recipe.out)
        stack.enter_context(claim_folder(recipe.out, "train", resume=again))
        if started:
            log(f"{recipe.out} holds a run that stopped before its first epoch ended: starting it over")
        return again
    return broadcast_flag(bool(on_rank0(claim, dist, f"claim --out {recipe.out}")), dist)


def resumes_a_restart(recipe: Recipe, log: Callable[[str], None]) -> bool:
    """True when torchrun has restarted the worker group (TORCHELASTIC_RESTART_COUNT > 0) and --out holds this
    launch's own run of this recipe: the run then continues from its last checkpoint (or starts over without one)."""
    restarts, out = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0), Path(recipe.out)
    if not restarts or not written_by_this_launch(out) or not has_config(out):
        return False
    saved, mine = read_config(out), yaml.safe_load(yaml.safe_dump(recipe.to_dict()))
    if {**saved, "model": None} != {**mine, "model": None}:  # the model's name is written as the model says it
        log(f"restart {restarts} of the worker group: {out} holds a run of another recipe; not resumed")
        return False
    log(f"restart {restarts} of the worker group: resuming this launch's run in {out}")
    return True


def check_sources_outside(recipe: Recipe) -> None:
    """Refuse a run whose --out is (or holds) the model it starts from or its teacher: it would overwrite them; and
    one whose model or teacher is a run with no model yet (still training, or stopped)."""
    out = Path(recipe.out).resolve()
    for flag, source in (("--init", recipe.init), ("--teacher", recipe.teacher)):
        if source and not str(source).startswith("hf-hub:") and out in (Path(source).resolve(),
                                                                         *Path(source).resolve().parents):
            raise VitlabError(f"{flag} {source} lies in --out {recipe.out}: the run would overwrite it; "
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



def check_groups(optimizer: torch.optim.Optimizer, ckpt: dict, path, model: nn.Module) -> None:
    """Refuse a checkpoint of this model whose optimizer groups (their sizes and lr scales) are not the ones this
    run builds; another model's checkpoint is left to the state's loading, which names both models."""
    saved, weights = ckpt.get("optimizer"), ckpt.get("model")
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) or not isinstance(weights, dict):
        return  # the state's own loading says what is missing
    own = model.state_dict()
    if set(weights) != set(own) or any(getattr(weights[k], "shape", None) != v.shape for k, v in own.items()):
        return
    ours = [(len(g["params"]), round(g.get("lr_scale", 1.0), 9)) for g in optimizer.param_groups]
    theirs = [(len(g.get("params", ())), round(g.get("lr_scale", 1.0), 9)) for g in saved["param_groups"]
              if isinstance(g, dict)]
    if ours != theirs:
        raise VitlabError(f"{path} holds an optimizer of {len(theirs)} parameter groups that the run's recipe does not "
                          f"make ({len(ours)} groups: layer_decay, freeze_blocks and freeze_backbone decide them); "
                          "accepted: a checkpoint of this run")


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 7919 + rank * 104_729) % (2 ** 31)


def set_fast_math(device: torch.device) -> None:
    """TF32 matmuls and convolutions on GPUs that have them (float32 runs; autocast regions use bf16/fp16)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


def choose_precision(recipe: Recipe, model: nn.Module, augment: BatchAugment, images: torch.Tensor,
                     labels: torch.Tensor, dist: Dist, log: Callable[[str], None]) -> str:
    """'fp32', 'bf16' or 'fp16'. 'auto' is bf16 where the hardware computes in it fast (a GPU that supports it,
    a CPU with AMX for a model large enough to gain from it), else fp32: decided from the hardware and the model's
    multiply-adds an image, never from a timing (see devices.auto_precision)."""
    if recipe.precision != "auto":
        if recipe.precision == "bf16" and dist.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise VitlabError(f"precision='bf16' is not supported by {torch.cuda.get_device_name(dist.device)}; "
                              "accepted here: fp16, fp32, auto")
        if recipe.precision == "fp16" and dist.device.type != "cuda":
            raise VitlabError("precision='fp16' needs a GPU (a gradient scaler on the CPU is of no use); "
                              "accepted on the CPU: auto, bf16, fp32")
        return recipe.precision
    precision, why = auto_precision(dist.device, matmul_macs(model, (images.shape[1], *augment.img_size)))
    precision = "bf16" if broadcast_flag(precision == "bf16", dist) else "fp32"  # rank 0's hardware decides
    log(f"precision auto: {'bf16' if precision == 'bf16' else 'float32'} ({why})")
    return precision


def epoch_plan_of(run: Run, epoch: int) -> EpochPlan:
    """The epoch's batches on this rank: their order depends on (seed, epoch) only."""
    recipe, dist = run.recipe, run.dist
    return EpochPlan(run.data.num_train, run.per_epoch, epoch_seed(recipe.seed, epoch, 0), dist.rank, dist.world,
                     recipe.augment.repeated_aug)


def batch_sizes(run: Run) -> list[int]:
    """The size of every whole batch of an epoch (all ranks together)."""
    return run.feeder.sizes(epoch_plan_of(run, 0))


def images_trained(run: Run) -> int:
    """The training images the run's steps took: every image of each whole epoch, then the first batches of the
    last one (all ranks together)."""
    whole, part = divmod(run.state.step, run.per_epoch)
    return whole * run.data.num_train + sum(batch_sizes(run)[:part])


def track_best(run: Run, score: float) -> None:
    """Step the plateau schedule and the best score so far."""
    recipe, state = run.recipe, run.state
    if state.plateau.step(score) and recipe.plateau_patience:
        run.log(f"no improvement for {recipe.plateau_patience} evaluations: lr scale now {state.plateau.scale:g}")
    if score > state.best:
        state.best, state.since_best = score, 0
    else:
        state.since_best += 1


def early_stop_due(run: Run) -> bool:
    """True (and said) when the recipe's early stopping ends the run here."""
    if run.recipe.early_stop and run.state.since_best >= run.recipe.early_stop:
        run.log(f"early stop: no improvement for {run.state.since_best} evaluations")
        return True
    return False
