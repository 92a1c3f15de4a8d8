import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VITLAB_SHARED", ROOT.parent / "shared"))
PARITY = SHARED / "parity"

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private vitlab cache for the test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("VITLAB_CACHE", str(d))
    return d
