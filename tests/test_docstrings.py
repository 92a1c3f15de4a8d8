"""Every example in the public API's docstrings and the README's Python block runs, as written, on small data:
the examples of ``vitlab.fit``, ``evaluate``, ``predict``, ``explain``, ``inspect``, ``pretrain``, ``create_model``,
``load``, ``save`` and ``list_models`` run in one namespace, in the order a notebook would (fit's ``result`` is what
the next ones use). Two things are made small, nothing else is changed: ``keras.datasets.cifar10.load_data()``
(which would download) gives 64 + 32 arrays of CIFAR-10's shape, and every run trains one epoch (or a few seconds
of a time budget, and a resumed one a few seconds more) on a fifth of its training images."""
from __future__ import annotations

import functools
import inspect
import re
import textwrap
import types

import numpy as np
import pytest
import torch
from conftest import ROOT

import vitlab
from vitlab import api

# in the order their examples build on each other
DOCUMENTED = ("fit", "evaluate", "predict", "explain", "inspect", "create_model", "save", "load", "list_models",
              "pretrain")


def example(obj) -> str:
    """The ``Example::`` block of a docstring, dedented (one line naming the object when it has none)."""
    doc = inspect.getdoc(obj) or ""
    found = re.search(r"Example::\n\n((?:[ ]{4}.*\n|\n)+)", doc + "\n")
    assert found, f"{obj.__name__}'s docstring has no Example:: block"
    return textwrap.dedent(found.group(1))


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has no Python block"
    return "\n".join(blocks)


def cifar10_like(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (n, 32, 32, 3) images and uint8 (n, 1) labels, as keras.datasets.cifar10.load_data gives them."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, (n, 1)).astype(np.uint8))


@pytest.fixture
def small_runs(tmp_path, monkeypatch):
    """Runs in a fresh folder that train one epoch (a time budget: six seconds) on a fifth of their images."""
    fit = api.fit

    @functools.wraps(fit)
    def small_fit(*args, **options):
        if options.get("resume") is not None:
            if options.get("time_budget") is not None:  # going on: a few seconds more than the run had
                options["time_budget"] = min(float(options["time_budget"]), 0.2)
        else:
            if options.get("time_budget") is not None:
                options["time_budget"] = min(float(options["time_budget"]), 0.1)
            else:
                options["epochs"] = 1
            options.setdefault("train_fraction", 0.2)
            options.setdefault("threads", 1)
        return fit(*args, **options)

    monkeypatch.setattr(api, "fit", small_fit)  # vitlab.fit and pretrain (which calls fit) alike
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


def test_every_public_function_has_an_example():
    for name in DOCUMENTED:
        assert example(getattr(vitlab, name)).strip()


def test_the_docstring_examples_run(small_runs):
    keras = types.SimpleNamespace(datasets=types.SimpleNamespace(cifar10=types.SimpleNamespace(
        load_data=lambda: (cifar10_like(64, 0), cifar10_like(32, 1)))))
    namespace = {"vitlab": vitlab, "keras": keras, "np": np}
    for name in DOCUMENTED:
        code = example(getattr(vitlab, name))
        try:
            exec(compile(code, f"<{name}'s example>", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - named, with its example, for the reader of the failure
            raise AssertionError(f"vitlab.{name}'s example fails: {type(e).__name__}: {e}\n{code}") from e
    assert isinstance(namespace["result"], vitlab.FitResult) and namespace["heat"].ndim == 2
    assert (small_runs / "my_vit" / "config.json").is_file()


def test_the_readme_python_block_runs(small_runs):
    namespace: dict = {}
    exec(compile(readme_python(), "<README.md>", "exec"), namespace)
    assert isinstance(namespace["result"], vitlab.FitResult)
