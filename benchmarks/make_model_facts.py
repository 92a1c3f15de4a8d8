"""Count every registered model's parameters and multiply-adds into src/vitlab/models/facts.json, which
`vitlab models` reads instead of counting on every call (a row whose registration changed is counted again there,
and tests/test_models.py fails until this is run again).

    python benchmarks/make_model_facts.py
"""
from __future__ import annotations

from vitlab.models.summary import FACTS_FILE, write_facts

if __name__ == "__main__":
    n = write_facts()
    print(f"{n} models' facts in {FACTS_FILE}")
