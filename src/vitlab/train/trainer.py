"""The training loop: data in memory, batched augmentation, AdamW with warmup+cosine, checkpoints, run folder.

Every epoch re-seeds the random generators from (seed, epoch, rank), so a run resumed from its
last checkpoint replays exactly what the uninterrupted run would have done.
"""
from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from .. import io as vio
from ..data.augment import AugmentConfig, BatchAugment, repeated_aug_indices
from ..data.sources import DataBundle, load_data
from ..fileio import atomic_write_bytes, atomic_write_json
from ..models.registry import accepted_args, create_model, get_spec
from .checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from .distill import TrainLoss
from .distributed import Dist, all_reduce_sum, barrier, broadcast_flag, cleanup, init_distributed
from .evaluate import autocast, confusion_counts, metrics_from_counts
from .recipe import Recipe
from .report import plot_confusion, plot_curves
from .schedule import Plateau, progressive_size, warmup_cosine

SUMMARY, METRICS, CONFIG_YAML = "summary.json", "metrics.jsonl", "config.yaml"
HEAD_NAMES = ("head", "head_dist", "fc")


# --- setup ------------------------------------------------------------------------------------


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse to overwrite a finished run or to silently restart an unfinished one."""
    if (out / SUMMARY).exists():
        raise ValueError(f"{out} holds a finished run ({SUMMARY} exists); choose another --out")
    if not resume and (out / CHECKPOINT).exists():
        raise ValueError(f"{out} holds an unfinished run: continue it with `vitlab train --resume {out}` "
                         "or choose another --out")


def default_model(data: str) -> str:
    return "vit_micro_patch2_8" if data == "digits" else "vit_tiny_patch4_32"


def build_model_and_data(r: Recipe, d: Dist, log: Callable[[str], None]) -> tuple[nn.Module, DataBundle, tuple, tuple]:
    """The model and the data, sized for each other; returns (model, data, mean, std)."""
    def get_data(img_size, in_chans):
        if d.is_main:
            data = load_data(r.data, img_size=img_size, in_chans=in_chans, cache_dir=r.cache_dir,
                             download=r.download, val_fraction=r.val_fraction, seed=r.seed, log=log)
        barrier(d)  # rank 0 decodes and fills the cache; the others then read it
        if not d.is_main:
            data = load_data(r.data, img_size=img_size, in_chans=in_chans, cache_dir=r.cache_dir,
                             download=False, val_fraction=r.val_fraction, seed=r.seed, log=lambda s: None)
        return data

    if r.init:
        base = vio.load(r.init)
        in_chans = base.pretrained_cfg["input_size"][0]
        data = get_data(r.img_size, in_chans)
        size = tuple(data.train.images.shape[-2:])
        overrides = dict(r.model_args)
        if "drop_path_rate" in accepted_args(type(base)):
            overrides.setdefault("drop_path_rate", r.drop_path)
        if getattr(base, "patch_embed", None) is not None and tuple(base.patch_embed.img_size) != size:
            overrides["img_size"] = size
            log(f"resampling the position embedding from {tuple(base.patch_embed.img_size)} to {size}")
        model = vio.load(r.init, **overrides)
        if model.pretrained_cfg.get("label_names") != list(data.classes) or model.num_classes != len(data.classes):
            model.reset_classifier(len(data.classes))
            log(f"new head(s) for {len(data.classes)} classes")
        mean, std = tuple(model.pretrained_cfg["mean"]), tuple(model.pretrained_cfg["std"])
        return model, data, mean, std
    name = r.model or default_model(r.data)
    spec = get_spec(name)
    args = {**spec.args, **r.model_args}
    in_chans = args.get("in_chans", 3)
    img_size = r.img_size or args.get("img_size", 224)
    data = get_data(img_size, in_chans)
    overrides = dict(r.model_args, num_classes=len(data.classes))
    if "img_size" in accepted_args(spec.cls):
        overrides["img_size"] = tuple(data.train.images.shape[-2:])
    if "drop_path_rate" in accepted_args(spec.cls):
        overrides.setdefault("drop_path_rate", r.drop_path)
    model = create_model(name, **overrides)
    return model, data, tuple(data.mean), tuple(data.std)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on norms, biases, LayerScale, position embeddings and tokens."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip or name.split(".")[-1] in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier head(s): a linear probe."""
    for name, p in model.named_parameters():
        p.requires_grad = name.split(".")[0] in HEAD_NAMES


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
        if e.dtype.is_floating_point:
            e.lerp_(m, 1.0 - decay)
        else:
            e.copy_(m)


def train_step(net: nn.Module, augment: BatchAugment, loss_fn: TrainLoss, optimizer: torch.optim.Optimizer,
               images: torch.Tensor, labels: torch.Tensor, bf16: bool, clip_grad: float | None = None,
               ema: nn.Module | None = None, ema_decay: float = 0.0,
               size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimisation step from a uint8 batch: augment, forward, loss, backward, clip, AdamW, EMA.

    ``size`` resizes the augmented batch (progressive resizing). Returns the batch's loss and its
    count of correct predictions (of the mixed targets' argmax).
    """
    x, targets = augment(images, labels)
    if size is not None and tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)
    with autocast(images.device, bf16):
        outputs = net(x)
        loss = loss_fn(x, outputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if clip_grad:
        nn.utils.clip_grad_norm_(params, clip_grad)
    optimizer.step()
    if ema is not None:
        ema_update(ema, net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net, ema_decay)
    logits = outputs[0] if isinstance(outputs, tuple) else outputs
    return loss.detach().float(), (logits.detach().argmax(1) == targets.argmax(1)).sum()


def any_size(model: nn.Module) -> dict[nn.Module, bool]:
    """Let a model take inputs of other sizes (dynamic_img_size on every module that has it).

    Returns the previous flags; ``restore_size_flags`` puts them back.
    """
    flags = {m: m.dynamic_img_size for m in model.modules() if isinstance(getattr(m, "dynamic_img_size", None), bool)}
    for m in flags:
        m.dynamic_img_size = True
    return flags


def restore_size_flags(flags: dict[nn.Module, bool]) -> None:
    for m, v in flags.items():
        m.dynamic_img_size = v


def size_step(model: nn.Module) -> int:
    """The granularity of input sizes a model takes: its patch size (a CNN's: 8)."""
    pe = getattr(model, "patch_embed", None)
    return int(max(pe.patch_size)) if pe is not None else 8


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 7919 + rank * 104_729) % (2 ** 31)


def choose_precision(r: Recipe, model: nn.Module, augment: BatchAugment, images, labels, d: Dist,
                     log: Callable[[str], None]) -> bool:
    """True for bf16 autocast. 'auto' times a few training steps of each on a copy of the model."""
    if r.precision != "auto":
        return r.precision == "bf16"
    if d.device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    probe = copy.deepcopy(model).train()
    opt = torch.optim.AdamW([p for p in probe.parameters() if p.requires_grad], lr=1e-6)
    n = min(len(images), max(r.batch_size // d.world, 2))
    x, y = augment(images[:n].to(d.device), labels[:n].to(d.device))
    rng = torch.get_rng_state()
    times = {}
    for bf16 in (False, True):
        def step(bf16=bf16):
            with autocast(d.device, bf16):
                out = probe(x)
                loss = sum(o.float().logsumexp(1).mean() for o in (out if isinstance(out, tuple) else (out,)))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
        samples = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t)
        times[bf16] = sorted(samples)[1]
    torch.set_rng_state(rng)
    choice = broadcast_flag(times[True] < times[False], d)
    log(f"precision auto: float32 {n / times[False]:.0f} img/s, bf16 {n / times[True]:.0f} img/s "
        f"-> {'bf16' if choice else 'float32'}")
    return choice


# --- the run ----------------------------------------------------------------------------------


def show_seconds(bar: tqdm, seconds: float) -> None:
    """Move a bar counted in seconds to ``seconds``, printing at most once per ``mininterval``."""
    bar.n = min(int(seconds), bar.total)
    if time.time() - bar.last_print_t >= bar.mininterval:  # tqdm keeps time.time()
        bar.refresh()
        bar.last_print_t = time.time()  # refresh() leaves it as it was: without this, every step would print


def train(r: Recipe, resume: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train as the recipe says and write the run folder; returns the summary."""
    if r.out is None:
        raise ValueError("a training run needs an output folder: --out DIR")
    d = init_distributed(r.device)
    log = log or (lambda s: tqdm.write(s, file=sys.stderr))  # keeps the progress bar intact
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
    if r.batch_size % d.world:
        raise ValueError(f"batch_size {r.batch_size} is not divisible by the {d.world} processes")
    torch.manual_seed(r.seed)
    model, data, mean, std = build_model_and_data(r, d, log)
    classes = list(data.classes)
    if r.freeze_backbone:
        freeze_backbone(model)
    model.pretrained_cfg.update(mean=list(mean), std=list(std), label_names=classes)
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_YAML).write_text(yaml.safe_dump({**r.to_dict(), "model": getattr(model, "arch", r.model)},
                                                      sort_keys=False))
    model.to(d.device)
    train_x, train_y = data.train.images.to(d.device), data.train.labels.to(d.device)
    img_size = tuple(train_x.shape[-2:])
    aug_cfg = AugmentConfig(crop=r.crop, padding=r.padding, hflip=r.hflip, auto_augment=r.auto_augment,
                            ra_num_ops=r.ra_num_ops, ra_magnitude=r.ra_magnitude, random_erasing=r.random_erasing,
                            mixup_alpha=r.mixup, cutmix_alpha=r.cutmix, mix_prob=r.mix_prob,
                            label_smoothing=r.label_smoothing, repeated_aug=r.repeated_aug)
    aug_cfg.validate()
    augment = BatchAugment(aug_cfg, img_size, mean, std, len(classes)).to(d.device)

    teacher = None
    if r.teacher:
        teacher = vio.load(r.teacher).to(d.device)
        if teacher.num_classes != len(classes):
            raise ValueError(f"teacher {r.teacher} predicts {teacher.num_classes} classes, the data has {len(classes)}")
        log(f"teacher: {r.teacher} ({type(teacher).__name__}), {r.distill} distillation")
    teacher_norm = (teacher.pretrained_cfg["mean"], teacher.pretrained_cfg["std"]) if teacher else None
    loss_fn = TrainLoss(teacher, r.distill, r.tau, r.alpha, student_norm=(mean, std), teacher_norm=teacher_norm)

    ckpt = load_checkpoint(out) if resume else None
    bf16 = ckpt["bf16"] if ckpt is not None else choose_precision(r, model, augment, train_x, train_y, d, log)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if r.ema_decay > 0 else None
    optimizer = torch.optim.AdamW(param_groups(model, r.weight_decay), lr=r.lr, betas=(0.9, 0.999))
    plateau = Plateau(r.plateau_patience, r.plateau_factor)
    history: list[dict] = []
    start_epoch, step, prior_seconds, best, since_best = 0, 0, 0.0, -math.inf, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        if ema is not None:
            ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        plateau.load_state_dict(ckpt["plateau"])
        history, start_epoch, step = ckpt["history"], ckpt["epoch"] + 1, ckpt["step"]
        prior_seconds, best, since_best = ckpt["elapsed_seconds"], ckpt["best"], ckpt["since_best"]
        log(f"resuming {out} after epoch {ckpt['epoch'] + 1}")
    elif resume:
        log(f"no checkpoint in {out} yet: starting the run from the beginning")

    progressive = r.progressive_scale < 1
    size_flags = any_size(model) if progressive else {}  # every vitlab model takes other sizes this way
    px = size_step(model)

    net = model
    if r.compile:
        net = torch.compile(net, dynamic=False)  # progressive resizing: one graph per size
    if d.enabled:
        net = nn.parallel.DistributedDataParallel(net, device_ids=[d.device.index] if d.device.type == "cuda" else None)

    n_train = len(train_x)
    local_batch = r.batch_size // d.world
    if n_train < r.batch_size:
        raise ValueError(f"batch_size {r.batch_size} is larger than the {n_train} training images; lower it")
    per_epoch = n_train // r.batch_size  # the last partial batch is dropped
    budget = r.time_budget * 60 if r.time_budget else None
    total_steps = per_epoch * r.epochs
    reserve = 0.0  # seconds kept back for the final evaluation and saving
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {getattr(model, 'arch', None) or type(model).__name__} ({n_params / 1e6:.2f}M parameters), "
        f"{n_train} training images {tuple(train_x.shape[1:])}, {len(classes)} classes, batch {r.batch_size}"
        f"{f' over {d.world} processes' if d.enabled else ''}, {'bf16' if bf16 else 'float32'}, "
        + (f"time budget {r.time_budget:g} min" if budget else f"{r.epochs} epochs of {per_epoch} steps"))

    bar = tqdm(total=int(budget) if budget else total_steps,
               initial=min(int(prior_seconds), int(budget)) if budget else step,
               disable=not d.is_main, unit="s" if budget else "step", dynamic_ncols=True, file=sys.stderr,
               mininterval=1.0 if sys.stderr.isatty() else 30.0,  # a log file gets a line now and then
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def progress() -> float:
        if budget:
            return elapsed() / max(budget - reserve, 1e-9)
        return step / total_steps

    def elapsed() -> float:
        """Wall-clock seconds of the run: earlier sessions (before a resume) plus this one, set-up included."""
        return prior_seconds + (time.perf_counter() - t_start)

    def evaluate(m: nn.Module) -> dict[str, dict]:
        """Metrics per head on the test split, each rank on its shard."""
        idx = torch.arange(d.rank, len(data.test.images), d.world)
        counts = confusion_counts(m, data.test.images[idx], data.test.labels[idx], mean, std, len(classes),
                                  batch_size=max(local_batch, 256), bf16=bf16, tta=r.tta)
        for c in counts.values():
            for k in c:
                c[k] = all_reduce_sum(c[k], d)
        return {name: metrics_from_counts(c, classes) for name, c in counts.items()}

    epoch = start_epoch
    stop = broadcast_flag(budget is not None and progress() >= 1, d) if ckpt is not None else False
    stopped_early = False
    final_metrics = None
    last_size = None
    while not stop and (budget is not None or epoch < r.epochs):
        torch.manual_seed(epoch_seed(r.seed, epoch, d.rank))
        g = torch.Generator().manual_seed(epoch_seed(r.seed, epoch, 0))
        if r.repeated_aug > 1:
            order = repeated_aug_indices(n_train, r.repeated_aug, g)
        else:
            order = torch.randperm(n_train, generator=g)
        model.train()
        loss_fn.train()
        epoch_t0 = time.perf_counter()
        seen, loss_sum, correct, lr = 0, torch.zeros(()), torch.zeros(()), r.lr
        for i in range(per_epoch):
            p = progress()
            lr = warmup_cosine(p, r.lr, r.min_lr, r.warmup) * plateau.scale
            size = progressive_size(p, img_size, r.progressive_scale, r.progressive_until, px) if progressive else None
            if size is not None and size != last_size:
                log(f"training input size {size[0]}x{size[1]}")
                last_size = size
            for group in optimizer.param_groups:
                group["lr"] = lr
            idx = order[i * r.batch_size:(i + 1) * r.batch_size][d.rank::d.world].to(d.device)
            loss, hits = train_step(net, augment, loss_fn, optimizer, train_x[idx], train_y[idx], bf16,
                                    r.clip_grad, ema, r.ema_decay, size)
            step += 1
            loss_sum += loss * len(idx)
            correct += hits
            seen += len(idx)
            if d.is_main and (i % 5 == 0 or i == per_epoch - 1):
                rate = seen * d.world / max(time.perf_counter() - epoch_t0, 1e-9)
                bar.set_postfix_str(f"epoch {epoch + 1} loss {loss_sum.item() / seen:.3f} "
                                    f"acc {correct.item() / seen:.3f} {rate:.0f} img/s", refresh=False)
            if budget:
                show_seconds(bar, elapsed())
                if broadcast_flag(progress() >= 1, d):
                    stop = True
                    break
            else:
                bar.update(1)
        epoch_seconds = time.perf_counter() - epoch_t0
        stats = all_reduce_sum(torch.stack([loss_sum, correct.float(), torch.tensor(float(seen))]).to(d.device), d)
        row = {"epoch": epoch + 1, "step": step, "train_loss": float(stats[0] / stats[2]),
               "train_acc": float(stats[1] / stats[2]), "lr": lr,
               "images_per_second": float(stats[2]) / max(epoch_seconds, 1e-9)}
        if last_size is not None:
            row["input_size"] = list(last_size)
        last = stop or (budget is None and epoch + 1 == r.epochs)
        if last or (epoch + 1) % r.eval_every == 0:
            t_eval = time.perf_counter()
            metrics = evaluate(model)
            row.update(test_loss=metrics["logits"]["loss"], test_top1=metrics["logits"]["top1"],
                       test_top5=metrics["logits"]["top5"])
            for head in ("cls", "dist"):
                if head in metrics:
                    row[f"test_top1_{head}"] = metrics[head]["top1"]
            score = metrics["logits"]["top1"]
            if ema is not None:
                ema_metrics = evaluate(ema)
                row["ema_test_top1"] = ema_metrics["logits"]["top1"]
                if row["ema_test_top1"] > score:
                    metrics, score = {**ema_metrics, "ema": True}, row["ema_test_top1"]
            final_metrics = metrics
            reserve = max(reserve, 2.0 * (time.perf_counter() - t_eval) + 3.0)
            if plateau.step(score) and r.plateau_patience:
                log(f"no improvement for {r.plateau_patience} evaluations: lr scale now {plateau.scale:g}")
            if score > best:
                best, since_best = score, 0
            else:
                since_best += 1
            if r.early_stop and since_best >= r.early_stop and not last:
                log(f"early stop: no improvement for {since_best} evaluations")
                stopped_early = stop = True
        row["elapsed_seconds"] = elapsed()
        history.append(row)
        if d.is_main:
            log(f"epoch {epoch + 1}: loss {row['train_loss']:.4f} train acc {row['train_acc']:.3f}"
                + (f" test top-1 {row['test_top1']:.4f}" if "test_top1" in row else "")
                + (f" (EMA {row['ema_test_top1']:.4f})" if "ema_test_top1" in row else "")
                + f" lr {lr:.2e} {row['images_per_second']:.0f} img/s")
            save_checkpoint(out, {"model": model.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                                  "optimizer": optimizer.state_dict(), "plateau": plateau.state_dict(),
                                  "history": history, "epoch": epoch, "step": step, "elapsed_seconds": elapsed(),
                                  "best": best, "since_best": since_best, "bf16": bf16})
            atomic_write_bytes(out / METRICS, "".join(json.dumps(h) + "\n" for h in history).encode())
        barrier(d)
        epoch += 1
        if budget is not None and progress() >= 1:
            stop = broadcast_flag(True, d)
    bar.close()

    # --- the end: evaluate, save the model, plots, summary (last: it marks the run finished) ---
    if final_metrics is None or "test_top1" not in history[-1]:
        final_metrics = evaluate(model)
    use_ema = bool(final_metrics.pop("ema", False))
    final_model = ema if use_ema else model
    restore_size_flags(size_flags)  # the saved model takes the size it was trained for (the EMA copy never changed)
    summary: dict[str, Any] = {}
    if d.is_main:
        m = final_metrics["logits"]
        summary = {
            "top1": m["top1"], "top5": m["top5"], "test_loss": m["loss"], "per_class": m["per_class"],
            "images_per_second": sum(h["images_per_second"] for h in history) / len(history),
            "elapsed_seconds": elapsed(), "epochs": len(history), "steps": step,
            "stopped_early": stopped_early, "model": getattr(model, "arch", None) or type(model).__name__,
            "parameters": n_params, "precision": "bf16" if bf16 else "fp32", "data": data.name,
            "num_train": n_train, "num_test": len(data.test.images), "classes": classes, "ema": use_ema,
            "tta": r.tta, "processes": d.world, "distill": r.distill, "teacher": r.teacher,
            "time_budget_minutes": r.time_budget,
        }
        if "cls" in final_metrics:
            summary["heads"] = {"cls": final_metrics["cls"]["top1"], "dist": final_metrics["dist"]["top1"],
                                "mean": m["top1"]}
        if r.freeze_backbone:
            for p in final_model.parameters():
                p.requires_grad = True
        vio.save(final_model, out)
        plot_curves(history, out / "curves.png", title=f"{summary['model']} on {data.name}")
        plot_confusion(m["confusion"], classes, out / "confusion.png",
                       title=f"Confusion matrix, test top-1 {100 * m['top1']:.2f}%")
        summary["wall_seconds"] = time.perf_counter() - t_start
        atomic_write_json(out / SUMMARY, summary)
    return summary
