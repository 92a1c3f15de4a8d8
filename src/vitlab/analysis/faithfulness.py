"""Is a map faithful? Deletion and insertion curves (RISE) and the perturbation test of Chefer et al. (CVPR 2021).

Both remove (or add) whole patches of the model's grid in the order a map ranks them:

- deletion / insertion (Petsiuk et al. 2018): the probability of the class predicted on the
  intact image as patches are removed (replaced by the deletion baseline) or inserted into the
  insertion baseline, most relevant first, at ``curve_steps`` + 1 evenly spaced fractions from 0
  to 1; the area under each curve by the trapezoid rule over x in [0, 1]. A faithful map has a
  low deletion and a high insertion AUC.
- positive / negative perturbation (Chefer, Gur & Wolf 2021): the top-1 accuracy over a set
  after removing floor(f * N) patches, f = 0.1 .. 0.9, the most (positive) or least (negative)
  relevant first, the removed pixels set to 0 (black) before normalisation as in the authors'
  code; the AUC by the trapezoid rule over f = 0, 0.1, .., 0.9, the unperturbed accuracy (%)
  included. A faithful map has a low positive and a high negative AUC.

- SaCo, the salience-guided faithfulness coefficient (Wu et al., CVPR 2024, "On the Faithfulness of Vision
  Transformer Explanations"): the patches, ranked by the map, fall into ``SACO_GROUPS`` groups of (near) equal
  size; each group's salience is the sum of the map over it and its effect the drop of the predicted class's
  probability when that group alone is removed (replaced by the deletion baseline). Over every pair of groups
  i < j (i the more salient), the salience gap s_i - s_j counts for the map when group i's removal hurts at least
  as much as group j's and against it otherwise; SaCo is the signed sum over the total weight, in [-1, 1]. It
  reads the map's values, not only its order: a map whose salience does not track the model's sensitivity scores
  near 0, whatever its order does to the curves.

Two floor baselines every method should beat: a random map (uniform values per patch, so a random order) and an
edge detector (the Sobel gradient magnitude of the image, pooled to the patch grid), which sees the image and not
the model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VitlabError
from ..progress import progress_bar
from .capture import attention_modules
from .explain import explain, explanation_methods, method_key, method_label
from .road import NOISE, noisy_linear_imputation

BASELINES = ("black", "mean", "blur")
PERTURBATION_STEPS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def normalisation(model: nn.Module, channels: int) -> tuple[Sequence[float], Sequence[float]]:
    """The mean and std the model's inputs were normalised with (its pretrained_cfg; 0.5 per channel without)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return cfg.get("mean", (0.5,) * channels), cfg.get("std", (0.5,) * channels)


def baseline_images(images: torch.Tensor, kind: str, mean: Sequence[float], std: Sequence[float],
                    blur_sigma: float = 4.0) -> torch.Tensor:
    """What 'removed' pixels become, for normalised images (B, C, H, W): 'black' (pixel value 0), 'mean' (0 after
    normalisation: the data set's mean colour) or 'blur' (a Gaussian blur of the image, sigma in pixels)."""
    if kind == "black":
        m = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
        s = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
        return ((0 - m) / s).expand_as(images)
    if kind == "mean":
        return torch.zeros_like(images)
    if kind == "blur":
        if blur_sigma <= 0:
            raise VitlabError(f"blur_sigma must be positive, got {blur_sigma}")
        return gaussian_blur(images, blur_sigma)
    raise VitlabError(f"baseline {kind!r} is not one of {BASELINES}")


def gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """A separable Gaussian blur of (B, C, H, W) images, kernel about +-2 sigma, reflected borders."""
    pad = min(int(2 * sigma + 0.5), images.shape[-1] - 1, images.shape[-2] - 1)  # reflection needs pad < side
    k = 2 * pad + 1
    t = torch.arange(k, dtype=images.dtype, device=images.device) - pad
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    g = g / g.sum()
    c = images.shape[1]
    x = images
    for kernel, padding in ((g.view(1, 1, 1, k), (pad, pad, 0, 0)), (g.view(1, 1, k, 1), (0, 0, pad, pad))):
        x = F.pad(x, padding, mode="reflect")
        x = F.conv2d(x, kernel.expand(c, 1, *kernel.shape[-2:]), groups=c)
    return x


def relevance_order(maps: torch.Tensor) -> torch.Tensor:
    """(B, grid_h, grid_w) maps -> (B, N) patch indices, most relevant first (ties keep grid order)."""
    return maps.flatten(1).float().argsort(dim=1, descending=True, stable=True)


def random_order(batch: int, num_patches: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, N) a random permutation of the patches per image."""
    return torch.stack([torch.randperm(num_patches, generator=generator) for _ in range(batch)])


def random_map(batch: int, grid: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, grid_h, grid_w) uniform random values in [0, 1): the floor a map must beat (its order is random)."""
    return torch.rand(batch, *grid, generator=generator)


def edge_map(images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, grid_h, grid_w) the Sobel gradient magnitude of the images (channels summed, replicated borders),
    averaged over each cell of the grid and scaled to a maximum of 1: a map that reads the image, not the model."""
    sobel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=torch.float32,
                         device=images.device)
    kernels = torch.stack([sobel, sobel.T])[:, None]  # (2, 1, 3, 3): d/dx, d/dy
    gray = F.pad(images.float().sum(dim=1, keepdim=True), (1, 1, 1, 1), mode="replicate")
    magnitude = F.conv2d(gray, kernels).pow(2).sum(dim=1, keepdim=True).sqrt()  # (B, 1, H, W)
    cells = F.adaptive_avg_pool2d(magnitude, grid)[:, 0]
    return cells / cells.amax(dim=(1, 2), keepdim=True).clamp_min(1e-12)


SACO_GROUPS = 10  # Wu et al.'s K
SACO_GROUPED = "pixels (each cell's value on its pixels), groups equal to a pixel"  # the protocol's words


def saco_groups(maps: torch.Tensor, image_size: tuple[int, int], groups: int = SACO_GROUPS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, grid_h, grid_w) maps -> (the image's pixels, most salient first, (B, H * W); each group's salience, the
    sum of the map over its pixels, (B, K)). Each cell's value goes to every pixel of it (nearest upsampling to
    ``image_size``), so a cell's pixels stay together in the ranking (ties keep row-major order), and the ranked
    pixels are cut into K = min(groups, H * W) groups equal to a pixel (the first H * W mod K one pixel larger): Wu
    et al. group pixels, and groups of whole patches would differ in size (64 patches in 10 groups: 7 or 6 patches),
    the larger removals dropping the probability more whatever the map, which lifts every map's SaCo."""
    pixels = F.interpolate(maps[:, None].float(), size=tuple(image_size), mode="nearest")[:, 0]
    order = relevance_order(pixels)
    ranked = pixels.flatten(1).gather(1, order)
    K = min(groups, ranked.shape[1])
    return order, torch.stack([c.sum(1) for c in ranked.tensor_split(K, dim=1)], dim=1)


def saco_score(salience: torch.Tensor, drops: torch.Tensor) -> torch.Tensor:
    """SaCo (Wu et al. 2024) per image from each group's salience (B, K), most salient first, and the drop of the
    class's probability when that group is removed (B, K): sum over i < j of +-(s_i - s_j), + when
    drop_i >= drop_j, over the sum of |s_i - s_j|; 0 where every gap is 0 (a constant map)."""
    i, j = torch.triu_indices(salience.shape[1], salience.shape[1], offset=1)
    gap = salience[:, i] - salience[:, j]
    signed = torch.where(drops[:, i] >= drops[:, j], gap, -gap)
    total = gap.abs().sum(1)
    return torch.where(total > 0, signed.sum(1) / total.clamp_min(1e-30), 0.0)


@torch.no_grad()
def saco(model: nn.Module, images: torch.Tensor, maps: torch.Tensor, target: torch.Tensor, removed: torch.Tensor,
         groups: int = SACO_GROUPS, chunk: int = 256, known: Known | None = None) -> torch.Tensor:
    """SaCo of maps (B, grid_h, grid_w) for the target classes (B,), each group of pixels (see saco_groups) removed
    alone (replaced by ``removed``, (B, C, H, W)): (B,) in [-1, 1]. ``known``: the intact images' logits, not
    passed again."""
    B, _, H, W = images.shape
    order, salience = saco_groups(maps, (H, W), groups)
    order = order.to(images.device)
    perturbed = [images]
    for part in order.tensor_split(salience.shape[1], dim=1):
        mask = torch.zeros(B, H * W, device=images.device).scatter_(1, part, 1.0).view(B, 1, H, W) > 0.5
        perturbed.append(torch.where(mask, removed, images))
    probs = _logits(model, perturbed, chunk, _intact_at([0], known)).softmax(dim=-1)  # (1 + K, B, classes)
    p = probs.gather(2, target.view(1, -1, 1).expand(len(perturbed), -1, 1))[..., 0]  # (1 + K, B)
    drops = (p[:1] - p[1:]).T  # (B, K)
    return saco_score(salience.to(drops.device), drops)


def saco_scores(model: nn.Module, images: torch.Tensor, *, methods: Sequence[tuple[str, str]] | None = None,
                batch_size: int = 64, deletion_baseline: str = "mean", head_fusion: str = "mean",
                discard_ratio: float = 0.0, seed: int = 0) -> dict[str, float]:
    """Each map's mean SaCo over normalised images, and nothing else: the maps (the floors' random draws included)
    that faithfulness() with these arguments scores, so that SaCo can be re-scored without the removal curves."""
    methods = list(methods or explanation_methods(model))
    keys = [method_key(m, t) for m, t in methods] + list(BASELINE_KEYS)
    mean, std = normalisation(model, images.shape[1])
    generator = torch.Generator().manual_seed(seed)  # faithfulness()'s: the same random maps
    device = next(model.parameters()).device
    sums = dict.fromkeys(keys, 0.0)
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(images), batch_size):
            x = images[s:s + batch_size].to(device)
            with torch.no_grad():
                pred = model(x).argmax(dim=-1)
            found = _batch_maps(model, x, pred, methods, keys, None, s, head_fusion, discard_ratio, generator)
            deleted = baseline_images(x, deletion_baseline, mean, std)
            for key in keys:
                sums[key] += float(saco(model, x, found[key], pred, deleted, chunk=max(4 * batch_size, 64))
                                   .double().sum())
    finally:
        model.train(was_training)
    return {k: v / len(images) for k, v in sums.items()}


def patch_mask(order: torch.Tensor, k: int, grid_size: tuple[int, int], image_size: tuple[int, int]) -> torch.Tensor:
    """(B, 1, H, W) bool: True on the pixels of the first k patches of each order (B, N)."""
    B, N = order.shape
    mask = torch.zeros(B, N, device=order.device)
    if k > 0:
        mask.scatter_(1, order[:, :k], 1.0)
    mask = mask.view(B, 1, *grid_size)
    return F.interpolate(mask, size=tuple(image_size), mode="nearest") > 0.5


def trapezoid(xs: Sequence[float], ys: torch.Tensor) -> torch.Tensor:
    """Area under ys (..., len(xs)) over the points xs, by the trapezoid rule."""
    return torch.trapezoid(ys.double(), torch.as_tensor(xs, dtype=torch.float64, device=ys.device), dim=-1)


def curve_fractions(num_patches: int, steps: int) -> list[int]:
    """Patch counts 0 .. N at ``steps`` + 1 evenly spaced points (rounded), for deletion and insertion."""
    if steps < 1:
        raise VitlabError(f"curve steps must be at least 1, got {steps}")
    steps = min(steps, num_patches)
    return [round(i * num_patches / steps) for i in range(steps + 1)]


@dataclass
class Known:
    """A batch's logits that every method's curves share, passed forward once: the intact images' (the first
    point of every removal curve and the last of insertion), the deletion baseline's (deletion's last point) and
    the insertion baseline's (insertion's first)."""

    intact: torch.Tensor
    deleted: torch.Tensor
    inserted_into: torch.Tensor


@torch.no_grad()
def _logits(model: nn.Module, batches: Sequence[torch.Tensor], chunk: int,
            reuse: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """(len(batches), B, classes): the model on several perturbed copies of a batch, ``chunk`` images per pass;
    the copies at the indices of ``reuse`` are not passed again: their logits are the ones given."""
    reuse = reuse or {}
    passed = [b for i, b in enumerate(batches) if i not in reuse]
    x = torch.cat(passed) if passed else batches[0][:0]
    out = [model(x[i:i + chunk]).float() for i in range(0, len(x), chunk)]
    found = iter(torch.cat(out).view(len(passed), len(batches[0]), -1) if out else [])
    return torch.stack([reuse[i].float() if i in reuse else next(found) for i in range(len(batches))])


def _intact_at(counts: Sequence[int], known: Known | None) -> dict[int, torch.Tensor]:
    """The points of a removal curve (patches removed) that are the intact images, with their known logits."""
    return {} if known is None else {i: known.intact for i, k in enumerate(counts) if k == 0}


@torch.no_grad()
def deletion_insertion(model: nn.Module, images: torch.Tensor, order: torch.Tensor, target: torch.Tensor,
                       counts: Sequence[int], grid_size: tuple[int, int], deleted: torch.Tensor,
                       inserted_into: torch.Tensor, chunk: int = 256,
                       known: Known | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(deletion, insertion) curves (B, len(counts)): the target class's probability with the first k patches of
    order replaced by ``deleted``, and with only the first k patches of the image shown over ``inserted_into``.
    ``known``: the logits of the curves' ends (no patch or every patch), not passed again."""
    masks = [patch_mask(order, k, grid_size, images.shape[-2:]) for k in counts]
    perturbed = [torch.where(m, deleted, images) for m in masks]
    perturbed += [torch.where(m, images, inserted_into) for m in masks]
    S, N = len(counts), order.shape[1]
    reuse = _intact_at(counts, known)  # deletion of no patch, insertion of every patch: the intact images
    if known is not None:
        reuse |= {S + i: known.intact for i, k in enumerate(counts) if k == N}
        reuse |= {i: known.deleted for i, k in enumerate(counts) if k == N}
        reuse |= {S + i: known.inserted_into for i, k in enumerate(counts) if k == 0}
    probs = _logits(model, perturbed, chunk, reuse).softmax(dim=-1)  # (2 S, B, classes)
    p = probs.gather(2, target.view(1, -1, 1).expand(len(perturbed), -1, 1))[..., 0].T  # (B, 2 S)
    return p[:, :len(counts)], p[:, len(counts):]


@torch.no_grad()
def perturbation_hits(model: nn.Module, images: torch.Tensor, order: torch.Tensor, labels: torch.Tensor,
                      fractions: Sequence[float], grid_size: tuple[int, int], removed: torch.Tensor,
                      chunk: int = 256, known: Known | None = None) -> torch.Tensor:
    """(len(fractions), B) bool: is the top-1 prediction right after removing the first floor(f * N) patches.
    ``known``: the intact images' logits, for the fractions that remove no patch."""
    N = order.shape[1]
    counts = [int(f * N) for f in fractions]
    perturbed = [torch.where(patch_mask(order, k, grid_size, images.shape[-2:]), removed, images) for k in counts]
    return _logits(model, perturbed, chunk, _intact_at(counts, known)).argmax(dim=-1) == labels.view(1, -1)


@torch.no_grad()
def road_hits(model: nn.Module, images: torch.Tensor, order: torch.Tensor, labels: torch.Tensor,
              fractions: Sequence[float], grid_size: tuple[int, int], noise: float = NOISE,
              generator: torch.Generator | None = None, chunk: int = 256, known: Known | None = None) -> torch.Tensor:
    """(len(fractions), B) bool: is the top-1 prediction right after ROAD's noisy linear imputation of the first
    floor(f * N) patches of order (Rong et al. 2022). ``known``: the intact images' logits, for the fractions that
    impute no patch (their noise is still drawn, so that the others' noise is the same with or without it)."""
    N = order.shape[1]
    counts = [int(f * N) for f in fractions]
    masks = torch.cat([patch_mask(order, k, grid_size, images.shape[-2:]) for k in counts])
    filled = noisy_linear_imputation(images.repeat(len(fractions), 1, 1, 1), masks, noise, generator)  # one solve
    return _logits(model, filled.chunk(len(fractions)), chunk, _intact_at(counts, known)).argmax(dim=-1) == \
        labels.view(1, -1)


# faithfulness.json's scores, each with whether higher is better
METRICS = {"deletion_auc": False, "insertion_auc": True, "positive_auc": False, "negative_auc": True,
           "road_morf_auc": False, "road_lerf_auc": True, "saco": True}
BASELINE_KEYS = ("random", "edge")  # the floor baselines' keys in faithfulness.json


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1 (ties get their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks; ties get mean ranks); 0 if either is constant."""
    ra, rb = torch.tensor(_ranks(a), dtype=torch.float64), torch.tensor(_ranks(b), dtype=torch.float64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else 0.0


def map_rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean Spearman rank correlation between matching maps of (B, h, w) a and b (a constant map counts as 0)."""
    rhos = [spearman(x.tolist(), y.tolist()) for x, y in zip(a.flatten(1).double().cpu(), b.flatten(1).double().cpu())]
    return sum(rhos) / len(rhos)


def kendall(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b over every pair."""
    conc = disc = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = (a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif da == db:
                conc += 1
            else:
                disc += 1
    den = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / den if den > 0 else 0.0


def rank_agreement(results: dict[str, dict]) -> dict:
    """Do the metrics order the methods alike? Per pair of METRICS, Spearman's and Kendall's correlation between
    the methods' scores (each oriented so that higher is better), over every method and the random order."""
    keys = list(results)
    metrics = [m for m in METRICS if all(m in results[k] for k in keys)]
    scores = {m: [results[k][m] if METRICS[m] else -results[k][m] for k in keys] for m in metrics}
    return {"methods": keys, "metrics": metrics,
            "spearman": [[spearman(scores[a], scores[b]) for b in metrics] for a in metrics],
            "kendall": [[kendall(scores[a], scores[b]) for b in metrics] for a in metrics],
            "about": "per pair of metrics, the rank correlation of the methods' scores, each oriented so that "
                     "higher is better"}


def _protocol(total: int, grid: tuple[int, int], counts: list[int], fractions: list[float], deletion_baseline: str,
              insertion_baseline: str, sigma: float, perturbation_baseline: str, with_labels: bool, seed: int,
              head_fusion: str, discard_ratio: float) -> dict:
    """faithfulness.json's ``protocol``: every parameter of the measurement, in words where a number needs them."""
    N = grid[0] * grid[1]
    return {
        "images": total, "grid": list(grid), "patches": N, "unit": "patch of the model's token grid",
        "map_class": "the class predicted on the intact image",
        "deletion_insertion": {
            "reference": "Petsiuk et al. 2018 (RISE)", "score": "softmax probability of the predicted class",
            "order": "most relevant patch first", "patch_counts": counts, "x": [k / N for k in counts],
            "deletion_baseline": deletion_baseline, "insertion_baseline": insertion_baseline,
            "blur_sigma_px": sigma, "auc": "trapezoid rule over x in [0, 1]; deletion: lower is better, "
                                          "insertion: higher is better"},
        "perturbation": {
            "reference": "Chefer, Gur & Wolf 2021 (CVPR), pertubation_eval_from_hdf5.py",
            "fractions": fractions, "patches_removed": [int(f * N) for f in fractions],
            "removed_value": perturbation_baseline + (" (pixel value 0 before normalisation)"
                                                      if perturbation_baseline == "black" else ""),
            "accuracy_against": "true labels" if with_labels else "the intact prediction",
            "positive": "most relevant removed first (lower AUC is better)",
            "negative": "least relevant removed first (higher AUC is better)",
            "auc": "trapezoid rule over the fractions (unperturbed point included), accuracy in %"},
        "road": {
            "reference": "Rong, Leemann, Borisov, Kasneci & Kasneci 2022 (ICML), ROAD",
            "fractions": fractions, "patches_removed": [int(f * N) for f in fractions],
            "removed_value": "noisy linear imputation: each removed pixel the mean of its 8 neighbours (direct "
                             "1/6, diagonal 1/12, renormalised at the border), one sparse linear system, plus "
                             f"N(0, {NOISE}^2) on the normalised image",
            "morf": "most relevant removed first (lower AUC is better)",
            "lerf": "least relevant removed first (higher AUC is better)",
            "accuracy_against": "true labels" if with_labels else "the intact prediction",
            "auc": "trapezoid rule over the fractions (unperturbed point included), accuracy in %"},
        "saco": {
            "reference": "Wu, Kang, Shen, Zhang, Yang & Guo 2024 (CVPR), On the Faithfulness of Vision Transformer "
                         "Explanations",
            "groups": SACO_GROUPS, "grouped": SACO_GROUPED,
            "removed_value": f"{deletion_baseline} (the deletion baseline), one group at a time",
            "score": "softmax probability of the predicted class; drop = intact - with the group removed",
            "range": "[-1, 1], higher is better; a map unrelated to the model scores about 0"},
        "random": f"a random map per image (uniform values per patch, seed {seed}): a random order; positive = "
                  "negative, MoRF = LeRF",
        "edge": "the Sobel gradient magnitude of the normalised image (channels summed), averaged per patch: reads "
                "the image only",
        "head_fusion": head_fusion, "discard_ratio": discard_ratio}


def _check_arguments(images: torch.Tensor, batch_size: int, perturbation_steps: Sequence[float],
                     deletion_baseline: str, insertion_baseline: str, perturbation_baseline: str) -> None:
    if len(images) == 0:
        raise VitlabError("faithfulness needs at least one image")
    if batch_size < 1:
        raise VitlabError(f"batch_size must be at least 1, got {batch_size}")
    if sorted(perturbation_steps) != list(perturbation_steps) or not all(0 <= f < 1 for f in perturbation_steps):
        raise VitlabError(f"perturbation steps must rise within [0, 1), got {list(perturbation_steps)}")
    for name, kind in (("deletion", deletion_baseline), ("insertion", insertion_baseline),
                       ("perturbation", perturbation_baseline)):
        if kind not in BASELINES:
            raise VitlabError(f"{name} baseline {kind!r} is not one of {BASELINES}")


def _accumulate(acc: dict, dele: torch.Tensor, ins: torch.Tensor, d_auc: torch.Tensor, i_auc: torch.Tensor,
                hits: dict[str, torch.Tensor], saco_scores: torch.Tensor) -> None:
    """Add a batch's AUCs, curves, removal-test hits (positive, negative, ROAD) and SaCo of one method to its
    sums."""
    acc["saco"] = acc.get("saco", 0.0) + float(saco_scores.double().sum())
    acc["deletion"] += float(d_auc.sum())
    acc["insertion"] += float(i_auc.sum())
    acc["deletion_curve"] = acc.get("deletion_curve", 0) + dele.double().sum(0)
    acc["insertion_curve"] = acc.get("insertion_curve", 0) + ins.double().sum(0)
    for name, h in hits.items():
        acc[name] = acc.get(name, 0) + h.double().sum(1)


def _mean_result(key: str, acc: dict, total: int, fractions: Sequence[float]) -> dict:
    """One method's mean AUCs, curves and removal-test accuracies over the ``total`` images."""
    result = {
        "label": method_label(key),
        "deletion_auc": acc["deletion"] / total, "insertion_auc": acc["insertion"] / total,
        "saco": acc["saco"] / total,
        "deletion_curve": (acc["deletion_curve"] / total).tolist(),
        "insertion_curve": (acc["insertion_curve"] / total).tolist()}
    for name in ("positive", "negative", "road_morf", "road_lerf"):
        accuracy = (acc[name] / total * 100).tolist()
        result[f"{name}_auc"] = float(trapezoid(fractions, torch.tensor(accuracy)))
        result[f"{name}_accuracy"] = accuracy
    return result


def faithfulness(model: nn.Module, images: torch.Tensor, labels: torch.Tensor | Sequence[int] | None = None, *,
                 methods: Sequence[tuple[str, str]] | None = None, batch_size: int = 64, curve_steps: int = 16,
                 deletion_baseline: str = "mean", insertion_baseline: str = "blur",
                 perturbation_baseline: str = "black", blur_sigma: float | None = None,
                 perturbation_steps: Sequence[float] = PERTURBATION_STEPS, head_fusion: str = "mean",
                 discard_ratio: float = 0.0, keep_images: int = 8, seed: int = 0,
                 progress: bool | None = None, maps: dict[str, torch.Tensor] | None = None) -> dict:
    """Deletion/insertion AUCs and the positive/negative perturbation test of each method over normalised images.

    methods: (method, token) pairs (default: all that apply, see explanation_methods); maps are
    computed for the class predicted on each intact image. labels: the true classes for the
    perturbation test's accuracy (default: the intact prediction, so it starts at 100%).
    Returns a JSON-ready dict: ``protocol`` (every parameter), ``methods`` (key -> mean AUCs and
    mean curves, plus the floors 'random', a random map, and 'edge', a Sobel edge map) and ``images``
    (per-image curves and AUCs of the first keep_images images).
    progress: a bar, with its time left; None shows one for more than one batch. maps: the methods' maps of these
    images already drawn (method key -> (len(images), grid_h, grid_w), e.g. the report's), not drawn again.
    """
    attention_modules(model)
    _check_arguments(images, batch_size, perturbation_steps, deletion_baseline, insertion_baseline,
                     perturbation_baseline)
    methods = list(methods or explanation_methods(model))
    C, H, W = images.shape[1:]
    mean, std = normalisation(model, C)
    sigma = float(blur_sigma if blur_sigma is not None else max(H, W) / 8)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    fractions = list(perturbation_steps) if 0.0 in perturbation_steps else [0.0, *perturbation_steps]
    generator = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(seed + 1)  # ROAD's imputation noise
    chunk = max(4 * batch_size, 64)  # images per forward pass of the perturbed copies
    keys = [method_key(m, t) for m, t in methods] + list(BASELINE_KEYS)
    sums = {k: {"deletion": 0.0, "insertion": 0.0} for k in keys}
    starts = list(range(0, len(images), batch_size))
    show = len(starts) > 1 if progress is None else progress
    per_image: list[dict] = []
    grid, counts, total = None, None, 0
    bar = progress_bar(total=len(images) * len(keys), desc="faithfulness", unit="map", disable=not show)
    try:
        for s in starts:
            x = images[s:s + batch_size].to(device)
            B = len(x)
            deleted, inserted_into, removed = (baseline_images(x, b, mean, std, sigma) for b in (
                deletion_baseline, insertion_baseline, perturbation_baseline))
            with torch.no_grad():  # what every method's curves share: passed once
                intact = model(x).float()
                known = Known(intact, *_logits(model, [deleted, inserted_into], chunk))
            pred = intact.argmax(dim=-1)  # (B,) the class every map explains
            y = pred if labels is None else torch.as_tensor(labels[s:s + batch_size], device=device).long()
            found = _batch_maps(model, x, pred, methods, keys, maps, s, head_fusion, discard_ratio, generator)
            grid = tuple(found["edge"].shape[-2:])
            orders = {key: relevance_order(m).to(device) for key, m in found.items()}
            counts = curve_fractions(grid[0] * grid[1], curve_steps)
            xs = [k / counts[-1] for k in counts]  # the fraction of the patches
            batch_images = [{} for _ in range(B)]
            for key, order in orders.items():
                dele, ins = deletion_insertion(model, x, order, pred, counts, grid, deleted, inserted_into, chunk,
                                               known)
                d_auc, i_auc = trapezoid(xs, dele), trapezoid(xs, ins)
                hits = _removal_hits(model, x, order, y, fractions, grid, removed, noise_gen, chunk,
                                     both=key != "random", known=known)
                scores = saco(model, x, found[key], pred, deleted, chunk=chunk, known=known)
                _accumulate(sums[key], dele, ins, d_auc, i_auc, hits, scores)
                for i in range(B):
                    batch_images[i][key] = {"deletion_auc": float(d_auc[i]), "insertion_auc": float(i_auc[i]),
                                            "saco": float(scores[i]),
                                            "deletion_curve": dele[i].tolist(), "insertion_curve": ins[i].tolist()}
                bar.update(B)
            per_image += [{"index": s + i, "predicted": int(pred[i]), "methods": batch_images[i]}
                          for i in range(min(B, max(keep_images - len(per_image), 0)))]
            total += B
    finally:
        bar.close()
        model.train(was_training)
    results = {key: _mean_result(key, sums[key], total, fractions) for key in keys}
    protocol = _protocol(total, grid, counts, fractions, deletion_baseline, insertion_baseline, sigma,
                         perturbation_baseline, labels is not None, seed, head_fusion, discard_ratio)
    return {"protocol": protocol, "methods": results, "rank_agreement": rank_agreement(results), "images": per_image}


def _batch_maps(model: nn.Module, x: torch.Tensor, pred: torch.Tensor, methods: Sequence[tuple[str, str]],
                keys: Sequence[str], maps: dict[str, torch.Tensor] | None, start: int, head_fusion: str,
                discard_ratio: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Each method's map of a batch (those given in ``maps`` taken from there, from image ``start`` on), then the
    floors' (a random map and a Sobel edge map) at the same grid."""
    found = {}
    for (method, token), key in zip(methods, keys):
        found[key] = maps[key][start:start + len(x)].to(x.device) if maps is not None and key in maps else explain(
            model, x, method, pred, token=token, head_fusion=head_fusion, discard_ratio=discard_ratio).detach()
    grid = tuple(model.patch_embed.grid_size) if not found else tuple(next(iter(found.values())).shape[-2:])
    found["random"] = random_map(len(x), grid, generator).to(x.device)
    found["edge"] = edge_map(x, grid)
    return found


def _removal_hits(model: nn.Module, x: torch.Tensor, order: torch.Tensor, y: torch.Tensor, fractions: list[float],
                  grid: tuple[int, int], removed: torch.Tensor, noise_gen: torch.Generator, chunk: int,
                  both: bool = True, known: Known | None = None) -> dict[str, torch.Tensor]:
    """Top-1 hits (S, B) of the positive / negative perturbation test and of ROAD's MoRF / LeRF for one order;
    without both (a random order), the reversed order's are the same as the order's."""
    hits = {"positive": perturbation_hits(model, x, order, y, fractions, grid, removed, chunk, known),
            "road_morf": road_hits(model, x, order, y, fractions, grid, NOISE, noise_gen, chunk, known)}
    hits["negative"] = perturbation_hits(model, x, order.flip(1), y, fractions, grid, removed, chunk, known) \
        if both else hits["positive"]
    hits["road_lerf"] = road_hits(model, x, order.flip(1), y, fractions, grid, NOISE, noise_gen, chunk, known) \
        if both else hits["road_morf"]
    return hits
