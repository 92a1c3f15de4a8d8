"""The ViT paper's analyses for every vitlab family: attention maps, rollout, distances, embeddings, a report."""
from .attnlrp import attnlrp, lrp_rules
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
from .explain import METHODS, REGISTRY, Method, explain, explanation_methods
from .gradients import attention_gradients, gradient_saliency
from .libragrad import libra_rules, libragrad, libragrad_fullgrad, libragrad_ig
from .palrp import pa_lrp
from .relevance import relevance, relevance_from_maps
from .report import inspect_model
from .rollout import fuse_heads, grad_rollout, raw_attention, rollout

__all__ = [
    "METHODS", "REGISTRY", "AttentionMap", "Method", "attention_distance", "attention_gradients", "attention_maps",
    "attention_modules", "attnlrp", "capture_attention", "convit_gates", "embedding_filters", "explain",
    "explanation_methods",
    "filter_components", "fuse_heads", "gpsa_positional_attention", "grad_rollout", "gradient_saliency",
    "inspect_model", "libra_rules", "libragrad", "libragrad_fullgrad", "libragrad_ig", "lrp_rules",
    "mean_attention_distance", "patch_distances", "position_similarity",
    "pa_lrp", "positional_attention_distance", "raw_attention", "relevance", "relevance_from_maps", "rollout",
]
