"""The notebooks in docs/notebooks/ run top to bottom on their small budgets (VITLAB_NOTEBOOK_QUICK=1), as a user
runs them in Jupyter: no cell raises, and every cell tagged "figure" shows its figure in the executed copy."""
from __future__ import annotations

import os

import pytest
from conftest import ROOT, SHARED

NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("[0-9][0-9]_*.py"))
CIFAR10 = SHARED / "data" / "cifar10-jpg.tar.gz"


def test_there_are_the_three_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_"]


@pytest.fixture(scope="module")
def notebook_env(tmp_path_factory):
    """One data cache for the notebooks of a session, the helper module importable, the archive found."""
    if not CIFAR10.is_file():
        pytest.skip(f"the CIFAR-10 archive is not at {CIFAR10} (set VITLAB_SHARED to the folder holding data/)")
    pytest.importorskip("jupytext", reason="pip install 'vitlab[notebooks]'")
    pytest.importorskip("nbclient", reason="pip install 'vitlab[notebooks]'")
    pytest.importorskip("ipykernel", reason="pip install 'vitlab[notebooks]'")
    cache = tmp_path_factory.mktemp("notebook-cache")
    return {"VITLAB_NOTEBOOK_QUICK": "1", "VITLAB_CIFAR10": str(CIFAR10), "VITLAB_CACHE": str(cache),
            "OMP_NUM_THREADS": "2"}


def figures(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_runs_top_to_bottom_and_shows_its_figures(path, notebook_env, tmp_path, monkeypatch):
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    for name, value in notebook_env.items():
        monkeypatch.setenv(name, value)
    # the kernel imports this tree's vitlab and the notebooks' helper (cifar10.py), as Jupyter opened beside it does
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(path.parent), str(ROOT / "src"),
                                                      *filter(None, [os.environ.get("PYTHONPATH")])]))
    nb = jupytext.read(path)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    executed = tmp_path / f"{path.stem}.ipynb"
    nbformat.write(nb, executed)
    cells = nbformat.read(executed, as_version=4).cells
    errors = [out for cell in cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
    tagged = [cell for cell in cells if "figure" in cell.metadata.get("tags", [])]
    assert len(tagged) >= 3, path.name
    assert all(figures(cell) >= 1 for cell in tagged), [cell.source[:80] for cell in tagged if not figures(cell)]
