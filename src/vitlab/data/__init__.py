"""Data sources decoded once into a memory-mapped on-disk store, and batched augmentation."""
from .sources import DATASETS, DataBundle, ImageSet, default_cache_dir, download_url, load_data, read_image
from .views import eval_view

__all__ = ["DATASETS", "DataBundle", "ImageSet", "default_cache_dir", "download_url", "eval_view", "load_data",
           "read_image"]
