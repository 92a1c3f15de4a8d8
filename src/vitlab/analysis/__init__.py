"""The ViT paper's analyses for every vitlab family: attention maps, rollout, distances, embeddings, a report."""
from .capture import AttentionMap, attention_maps, attention_modules, capture_attention
from .distance import (
    attention_distance,
    convit_gates,
    gpsa_positional_attention,
    mean_attention_distance,
    patch_distances,
    positional_attention_distance,
)
from .embeddings import embedding_filters, filter_components, position_similarity
from .report import inspect_model
from .rollout import (
    METHODS,
    attention_gradients,
    explain,
    explanation_methods,
    fuse_heads,
    grad_rollout,
    raw_attention,
    relevance,
    relevance_from_maps,
    rollout,
)

__all__ = [
    "METHODS", "AttentionMap", "attention_distance", "attention_gradients", "explain", "explanation_methods",
    "raw_attention", "relevance", "relevance_from_maps", "attention_maps", "attention_modules", "capture_attention",
    "convit_gates", "embedding_filters", "filter_components", "fuse_heads", "gpsa_positional_attention",
    "grad_rollout", "inspect_model", "mean_attention_distance", "patch_distances", "position_similarity",
    "positional_attention_distance", "rollout",
]
