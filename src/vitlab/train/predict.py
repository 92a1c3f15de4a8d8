"""Moved to ``vitlab.infer``; this alias is kept for one release."""
from ..infer.eval import center_crop, evaluate_folder, scale_size
from ..infer.predict import class_probabilities, predict_files

__all__ = ["center_crop", "class_probabilities", "evaluate_folder", "predict_files", "scale_size"]
