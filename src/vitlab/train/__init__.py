"""Training: recipe -> data -> augmentation -> model -> task (loss, evaluation) -> optimiser -> run folder."""
from .recipe import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe", "train"]


def __getattr__(name):  # the trainer pulls in data and plotting code: import it on first use, not with the recipe
    if name == "train":
        from .trainer import train
        return train
    raise AttributeError(name)
