"""vitlab: build, train, distil and understand Vision Transformers.

From Python: ``vitlab.fit(model, data, **options)`` trains as ``vitlab train`` does and returns the trained model,
its history and its figures; ``vitlab.evaluate``, ``vitlab.predict``, ``vitlab.explain``, ``vitlab.inspect`` (the
report of ``vitlab inspect``) and ``vitlab.pretrain`` (``help(vitlab.fit)``, docs/python.md).
"""
import importlib

__version__ = "0.1.0"
__all__ = ["FitResult", "InspectResult", "__version__", "create_model", "evaluate", "explain", "fit", "inspect",
           "list_models", "load", "predict", "pretrain", "save"]
API = ("FitResult", "InspectResult", "evaluate", "explain", "fit", "inspect", "predict", "pretrain")
# imported on first use, not with vitlab, so `vitlab models` starts without torch
LAZY = {"load": "checkpoint", "save": "checkpoint", "create_model": "models", "list_models": "models"}


def __getattr__(name: str):  # the Python API pulls in the trainer: imported on first use, not with vitlab
    if name in API:
        from . import api
        return getattr(api, name)
    if name in LAZY:
        return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'vitlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API, *LAZY])
