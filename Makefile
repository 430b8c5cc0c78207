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

.PHONY: install demo demo-data test lint bench bench-data tokenizer shards shards-slurm slurm-up slurm-down clean

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
	$(PY) -m data_prep.bench
	$(PY) -m hpctrain.bench_data

# --- data preparation (data_prep/) ---------------------------------------------------------------
CORPUS ?=
OUT ?=
TOKENIZER ?=
VOCAB ?= 32000
SEQ_LEN ?= 2048
WORKERS ?=
SHARD_MB ?= 64
TEXT_FIELD ?= text
PREP_ARGS ?=
quote_globs = $(foreach g,$(CORPUS),'$(g)')

tokenizer: install
	@test -n "$(CORPUS)" -a -n "$(OUT)" || { echo "usage: make tokenizer CORPUS='raw/*.jsonl' VOCAB=32000 OUT=DIR [TEXT_FIELD=text]" >&2; exit 2; }
	$(PY) -m data_prep.tokenizer --corpus $(quote_globs) --vocab $(VOCAB) --out '$(OUT)' --text-field '$(TEXT_FIELD)'

shards: install
	@test -n "$(CORPUS)" -a -n "$(OUT)" || { echo "usage: make shards CORPUS='raw/*.jsonl' OUT=DIR [TOKENIZER=DIR | VOCAB=N] [SEQ_LEN= WORKERS= SHARD_MB= TEXT_FIELD= PREP_ARGS=]" >&2; exit 2; }
	$(PY) -m data_prep.shards --corpus $(quote_globs) --out '$(OUT)' \
		$(if $(TOKENIZER),--tokenizer '$(TOKENIZER)',--vocab-size $(VOCAB)) --seq-len $(SEQ_LEN) \
		--shard-mb $(SHARD_MB) --text-field '$(TEXT_FIELD)' $(if $(WORKERS),--workers $(WORKERS)) $(PREP_ARGS)

# Slurm job array + dependent merge job (run on a login node; needs TOKENIZER, e.g. from `make tokenizer`).
shards-slurm: install
	@test -n "$(CORPUS)" -a -n "$(OUT)" -a -n "$(TOKENIZER)" || { echo "usage: make shards-slurm CORPUS='raw/*.jsonl' OUT=DIR TOKENIZER=DIR [SEQ_LEN= SHARD_MB= PREP_ARGS=] [PREP_SBATCH_ARGS='--array=0-63 --cpus-per-task=32']" >&2; exit 2; }
	PYTHON=$(PY) bash sbatch/preprocess.sbatch --corpus $(quote_globs) --out '$(OUT)' --tokenizer '$(TOKENIZER)' \
		--seq-len $(SEQ_LEN) --shard-mb $(SHARD_MB) --text-field '$(TEXT_FIELD)' $(PREP_ARGS)

# A local multi-node Slurm cluster (root + apt; Debian/Ubuntu). Never started implicitly by `make test`.
slurm-up:
	bash sbatch/local_cluster.sh up

slurm-down:
	bash sbatch/local_cluster.sh down

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache build *.egg-info
