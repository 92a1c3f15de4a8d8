"""Two standard judgements of frozen features: DINO's weighted k-NN and a full-batch linear probe."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import VitlabError
from ..models.groups import classifiers

SMALL_PROBLEM = 50_000_000  # features x classes below which the probe runs on one CPU thread


def _check(feats: torch.Tensor, labels: torch.Tensor | None, what: str) -> None:
    if not isinstance(feats, torch.Tensor) or feats.dim() != 2 or not len(feats):
        raise VitlabError(f"{what} features must be a non-empty (N, D) tensor, got "
                          f"{tuple(feats.shape) if isinstance(feats, torch.Tensor) else type(feats).__name__}")
    if labels is not None and (labels.dim() != 1 or len(labels) != len(feats)):
        raise VitlabError(f"{what} labels must be (N,) = ({len(feats)},), got {tuple(labels.shape)}")


def _num_classes(labels: torch.Tensor, num_classes: int | None) -> int:
    seen = int(labels.max()) + 1
    if num_classes is None:
        return seen
    if num_classes < seen or int(labels.min()) < 0:
        raise VitlabError(f"labels range over {int(labels.min())}..{seen - 1}, outside 0..{num_classes - 1}")
    return num_classes


@torch.no_grad()
def knn_votes(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor, k: int = 20,
              temperature: float = 0.07, num_classes: int | None = None, chunk: int = 1024) -> torch.Tensor:
    """(M, num_classes) votes: over the k training features most cosine-similar to each test feature,
    each neighbour adds exp(similarity / temperature) to its class (DINO's weighted k-NN).

    k is capped at the number of training features.
    """
    _check(train_feats, train_labels, "training")
    _check(test_feats, None, "test")
    if train_feats.shape[1] != test_feats.shape[1]:
        raise VitlabError(f"training features have {train_feats.shape[1]} dimensions, test {test_feats.shape[1]}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise VitlabError(f"k must be a positive int, got {k!r}")
    if not temperature > 0:
        raise VitlabError(f"temperature must be positive, got {temperature!r}")
    c = _num_classes(train_labels, num_classes)
    k = min(k, len(train_feats))
    train = F.normalize(train_feats.float(), dim=1)
    labels = train_labels.to(train.device).long()
    votes = []
    for i in range(0, len(test_feats), chunk):
        test = F.normalize(test_feats[i:i + chunk].float().to(train.device), dim=1)
        sim, idx = (test @ train.T).topk(k, dim=1)  # (m, k) the nearest neighbours
        weights = (sim / temperature).exp()
        votes.append(torch.zeros(len(test), c, device=train.device).scatter_add_(1, labels[idx], weights))
    return torch.cat(votes)


def knn_classify(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor, k: int = 20,
                 temperature: float = 0.07, num_classes: int | None = None) -> torch.Tensor:
    """(M,) predicted classes of DINO's weighted k-NN (see ``knn_votes``)."""
    return knn_votes(train_feats, train_labels, test_feats, k, temperature, num_classes).argmax(dim=1)


@dataclass
class LinearProbe:
    """A linear classifier on raw features (the standardisation folded in) and its accuracies."""

    linear: nn.Linear
    train_accuracy: float
    test_accuracy: float | None
    weight_decay: float
    loss: float  # the regularised training objective at the solution

    @torch.no_grad()
    def predict(self, feats: torch.Tensor) -> torch.Tensor:
        return self.linear(feats.to(self.linear.weight)).argmax(dim=1)


def linear_probe(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor | None = None,
                 test_labels: torch.Tensor | None = None, *, num_classes: int | None = None,
                 weight_decay: float = 1e-4, epochs: int = 200) -> LinearProbe:
    """Multinomial logistic regression on standardised features, full batch, by L-BFGS.

    Minimises mean cross-entropy + weight_decay / 2 * ||W||^2 (the bias is not penalised) from zero,
    ``epochs`` L-BFGS iterations at most (each a pass over all features, plus line-search passes);
    deterministic for given features. Computes in float64 on the CPU, float32 on a GPU.
    """
    _check(train_feats, train_labels, "training")
    if (test_feats is None) != (test_labels is None):
        raise VitlabError("give both test_feats and test_labels, or neither")
    if test_feats is not None:
        _check(test_feats, test_labels, "test")
    if not weight_decay >= 0:
        raise VitlabError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise VitlabError(f"epochs must be a positive int, got {epochs!r}")
    c = _num_classes(train_labels, num_classes)
    dtype = torch.float64 if train_feats.device.type == "cpu" else torch.float32
    x, y = train_feats.to(dtype), train_labels.to(train_feats.device).long()
    mu, sd = x.mean(0), x.std(0, unbiased=False)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))  # a constant feature stays as it is
    z = (x - mu) / sd
    w = torch.zeros(c, x.shape[1], dtype=dtype, device=x.device, requires_grad=True)
    b = torch.zeros(c, dtype=dtype, device=x.device, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=epochs, history_size=20, tolerance_grad=1e-9,
                            tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def objective():
        opt.zero_grad()
        loss = F.cross_entropy(z @ w.T + b, y) + 0.5 * weight_decay * (w * w).sum()
        loss.backward()
        return loss

    threads = torch.get_num_threads()
    if x.device.type == "cpu" and x.numel() * c < SMALL_PROBLEM:
        torch.set_num_threads(1)  # L-BFGS is many tiny ops: extra threads only wait on each other
    try:
        opt.step(objective)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        loss = float(F.cross_entropy(z @ w.T + b, y) + 0.5 * weight_decay * (w * w).sum())
        w_raw = w / sd  # logits of raw features: (x - mu) / sd @ w.T + b = x @ (w / sd).T + (b - (w / sd) @ mu)
        linear = nn.Linear(x.shape[1], c, device=train_feats.device, dtype=train_feats.dtype)
        linear.weight.copy_(w_raw)
        linear.bias.copy_(b - w_raw @ mu)
    probe = LinearProbe(linear, 0.0, None, float(weight_decay), loss)
    probe.train_accuracy = accuracy(probe.predict(train_feats), train_labels)
    if test_feats is not None:
        probe.test_accuracy = accuracy(probe.predict(test_feats), test_labels)
    return probe


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of predictions equal to the labels."""
    return float((predictions.cpu() == labels.cpu()).double().mean())


@torch.no_grad()
def set_head_from_probe(model: nn.Module, probe: LinearProbe) -> list[str]:
    """Make the probe the model's classifier, so the model predicts what the probe does; returns the heads' names.

    Every head (DeiT's two, whose mean is the eval output) gets the probe's weights; a different
    class count gets new heads first (``reset_classifier``).
    """
    c, d = probe.linear.weight.shape
    if getattr(model, "num_classes", c) != c:
        model.reset_classifier(c)
    heads = classifiers(model)
    if not heads:
        raise VitlabError(f"{type(model).__name__} has no classifier head to set")
    for name, head in heads.items():
        if head.weight.shape != (c, d):
            raise VitlabError(f"{name} maps {head.in_features} features to {head.out_features} classes; "
                              f"the probe maps {d} to {c}")
        head.weight.copy_(probe.linear.weight)
        head.bias.copy_(probe.linear.bias)
    return list(heads)
