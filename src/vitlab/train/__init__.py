"""Training: recipe -> data -> augmentation -> model -> loss -> AdamW -> run folder."""
from .recipe import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe", "train", "evaluate_model"]


def __getattr__(name):  # the trainer pulls in data and plotting code: import it on first use
    if name == "train":
        from .trainer import train
        return train
    if name == "evaluate_model":
        from .evaluate import evaluate_model
        return evaluate_model
    raise AttributeError(name)
