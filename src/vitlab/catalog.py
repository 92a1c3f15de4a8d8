"""The registered models as ``models/facts.json`` lists them (class, input size, parameters, multiply-adds an
image), read without importing torch or building a model: what ``vitlab models`` prints.

``benchmarks/make_model_facts.py`` counts the facts once (``models.summary``); a test fails while a registered name
is missing from them or registered otherwise, so the file and the registry agree.
"""
from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import VitlabError

FACTS_FILE = Path(__file__).parent / "models" / "facts.json"


def matching(names: Iterable[str], pattern: str) -> list[str]:
    """The names matching a shell-style pattern (``vit_*``; a plain word matches names containing it), sorted."""
    if not any(ch in pattern for ch in "*?["):
        pattern = f"*{pattern}*"
    return sorted(n for n in names if fnmatch.fnmatch(n, pattern))


def read_facts(path: Path = FACTS_FILE) -> dict[str, dict[str, Any]]:
    """The counted facts by model name ({} where the file is missing or unreadable)."""
    try:
        return json.loads(path.read_text())["models"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _giga(n: int) -> str:
    g = n / 1e9
    return f"{g:.2f}" if g >= 0.1 else f"{g:.4f}"


def model_table(pattern: str = "*", path: Path = FACTS_FILE) -> str:
    """A text table of the models matching ``pattern``: name, class, input size, parameters (M) and GMACs
    (forward multiply-adds of one image at the default input size, every matrix product counted)."""
    facts = read_facts(path)
    if not facts:
        raise VitlabError(f"the model facts file {path} is missing or unreadable; accepted: the file "
                          "benchmarks/make_model_facts.py writes (reinstall vitlab, or run that script)")
    names = matching(facts, pattern)
    if not names:
        return f"no model matches {pattern!r}"
    rows = [(n, facts[n]["class"], "x".join(map(str, facts[n]["input"][1:])), f"{facts[n]['params'] / 1e6:.2f}",
             _giga(facts[n]["macs"])) for n in names]
    header = ("model", "class", "input", "params (M)", "GMACs")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])
