# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Re-running them is quick: the install step re-runs only when pyproject.toml changes, and a
# second `make demo` continues (or, finished, re-evaluates) the demo run in runs/toy-digits.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flowgrpo-installed
# this repository's venv: exactly the torch the tests run on, and the extras the tests need
# (`parquet` is left out: without pyarrow a .parquet prompt file is a tested one-line error)
TORCH := torch==2.13.0
EXTRAS := ocr,wandb,toy,dev
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test test-fast lint format bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel (a range would pull a multi-GB CUDA build)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowgrpo train trainer.resume=auto

test: $(STAMP)
	$(PY) -m pytest

# the local loop: everything but the tests that spawn ranks or train end to end (`slow`)
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests $(wildcard bench)
	$(VENV)/bin/ruff format --check src tests $(wildcard bench)

format: $(STAMP)
	$(VENV)/bin/ruff format src tests $(wildcard bench)
	$(VENV)/bin/ruff check --fix src tests $(wildcard bench)

bench: $(STAMP)
	$(PY) -m bench

docs: $(STAMP)
	$(PY) -m flowgrpo.config.docs --write

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
