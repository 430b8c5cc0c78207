# Every user-facing target installs what it needs first, so each works on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
DEMO_DIR ?= outputs/demo
DEMO_STEPS ?= 300
PYTEST_ARGS ?=

.PHONY: install demo demo-data test lint bench bench-data clean

# torch is installed pinned and first: an unpinned requirement would pull a newer CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(STAMP)

demo-data: install
	$(PY) -m data_prep.demo

demo: install
	rm -rf $(DEMO_DIR)
	$(PY) -m hpctrain run_dir=$(DEMO_DIR) train.max_steps=$(DEMO_STEPS) train.log_every=20 \
		train.eval_every=100 optim.lr=3e-3 optim.warmup_steps=30
	$(PY) -m hpctrain.metrics $(DEMO_DIR)
	$(PY) -m hpctrain.generate run_dir=$(DEMO_DIR) prompt="def " max_new_tokens=120

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m hpctrain.bench

bench-data: install
	$(PY) -m hpctrain.bench_data

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache build *.egg-info
