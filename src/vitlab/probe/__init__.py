"""Frozen features: extract a backbone's pre-logits features once (cached), judge them by k-NN and a linear probe."""
from .classifiers import LinearProbe, accuracy, knn_classify, knn_votes, linear_probe, set_head_from_probe
from .features import extract_features, images_hash, weights_hash

__all__ = ["LinearProbe", "accuracy", "extract_features", "images_hash", "knn_classify", "knn_votes",
           "linear_probe", "set_head_from_probe", "weights_hash"]
