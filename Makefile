# `make run` trains on the embedded default data set; `make test` runs the tests (all but the slow ones: marked so, or over
# 2 s in tests/durations.json, which `make durations` records), `make test-all` all of them; both first check that the
# imports follow the layers declared in pyproject.toml
# (lint-imports), then run the tests in one process per core (pytest-xdist), each on one torch thread
# (tests/conftest.py); `test-all` ends by naming its 25 slowest tests, so that one growing slow is seen. Each creates
# .venv on first use: `run` installs what running needs (PyTorch pinned by constraints.txt), `test` and `test-all`
# add the test extras (pytest, pytest-xdist, ruff, import-linter, selenium, onnx, ...).
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# a test module goes to one worker whole, so its module-scoped fixtures (a trained run several tests read) run once
PYTEST := $(PY) -m pytest -q -n auto --dist loadscope

$(RUN_STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $@

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

install: $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/vitlab train --out runs/digits-$$(date +%Y%m%d-%H%M%S)

test: $(TEST_STAMP)
	$(VENV)/bin/lint-imports
	$(PYTEST) -m "not slow"

test-all: $(TEST_STAMP)
	$(VENV)/bin/lint-imports
	$(PYTEST) --durations=25

# the seconds of every test, recorded over the whole set: tests over 2 s join the slow ones (tests/conftest.py)
durations: $(TEST_STAMP)
	$(PYTEST) --record-durations tests/durations.json

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

.PHONY: install run test test-all durations lint
