"""Moved to ``vitlab.checkpoint``; this alias is kept for one release."""
from .checkpoint import CONFIG, WEIGHTS, load, read_config, read_weights, save

__all__ = ["CONFIG", "WEIGHTS", "load", "read_config", "read_weights", "save"]
