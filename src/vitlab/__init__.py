"""vitlab: build, train, distil and understand Vision Transformers."""
from .checkpoint import load, save
from .models import create_model, list_models

__version__ = "0.1.0"
__all__ = ["__version__", "create_model", "list_models", "load", "save"]
