"""Data sources decoded once into in-memory uint8 tensors, with an on-disk cache."""
from .sources import DATASETS, DataBundle, ImageSet, default_cache_dir, download_url, load_data, read_image

__all__ = ["DATASETS", "DataBundle", "ImageSet", "default_cache_dir", "download_url", "load_data", "read_image"]
