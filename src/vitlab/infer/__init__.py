"""Inference with a saved model: class probabilities for image files, metrics on a data set's test split."""
from .eval import evaluate_folder
from .predict import class_probabilities, predict_files, prepare_image

__all__ = ["class_probabilities", "evaluate_folder", "predict_files", "prepare_image"]
