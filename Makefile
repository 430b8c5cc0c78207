# Every user-facing target installs what it needs first, so each works on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
DEMO_DIR ?= outputs/demo
DEMO_STEPS ?= 600
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core and one more, as one of them mostly waits on the Slurm cluster (its
# tests run first, one at a time): on 2 cores three took 661 s against 760 s with two, both cores ~99 % busy. Cores:
# the ones this process may use (core/host.usable_cpus, plain Python: its affinity, fewer under a cgroup CPU quota
# such as a container's --cpus, where nproc would count the host's). At most 9 (each holds torch and forks ranks);
# 0: no workers (pdb, -s). Counted only when `make test` runs (a recursive variable), not at every make.
DEFAULT_WORKERS = $(shell $(PYTHON) -c 'from hpctrain.core.host import usable_cpus; print(min(usable_cpus() + 1, 9))' \
  2>/dev/null || echo 3)

# --- shell quoting ------------------------------------------------------------------------------------------
# Every user-supplied variable reaches the shell only through $(call arg,VAR) / $(call args,VAR): its text
# exactly as given ($(value VAR): no make expansion, a `$` stays a `$`), single-quoted with each ' written
# as '\'' and each newline as $'\n' (make would otherwise run the text after a newline as a shell command of
# its own). So no value can run a command, and OUT='my shards' or OUT="bob's shards" is one path.
# args is for the list variables (CORPUS, PREP_ARGS): one literal word per whitespace-separated item. make
# itself splits them on whitespace, so an item cannot contain a space (call the Python module directly for
# that). PYTEST_ARGS is passed whole instead (see `test`).
# VENV, PYTHON and TORCH_VERSION are toolchain settings, not input: they must be plain words.
define nl


endef
shquote = '$(subst $(nl),'$$'\n'',$(subst ','\'',$(1)))'
arg = $(call shquote,$(value $(1)))
args = $(foreach w,$(value $(1)),$(call shquote,$(w)))
given = $(strip $(value $(1)))
# $(call need,VAR...): the shell command true when every VAR is non-blank, else false.
need = $(if $(strip $(foreach v,$(1),$(if $(call given,$(v)),,missing))),false,true)

.PHONY: install demo demo-data test lint bench bench-data bench-host bench-scale bench-ckpt bench-monitor bench-comm bench-eval bench-moe bench-world bench-gpu gpu-check tokenizer shards shards-slurm slurm-up slurm-down clean

# torch is installed pinned and first: an unpinned requirement would pull a newer CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev,track,eval]"
	touch $@

install: $(STAMP)

demo-data: install
	$(PY) -m hpctrain prep demo

# train.resume=never: a demo run already in DEMO_DIR is moved aside into DEMO_DIR/previous/ (never deleted).
# model=nano, 600 steps of 16 x 256 tokens at lr 6e-3: the lowest validation bits per byte found for ~5 min on 2 cores
# (docs/training.md#the-demo).
demo: install
	$(PY) -m hpctrain run_dir=$(call arg,DEMO_DIR) train.resume=never train.max_steps=$(call arg,DEMO_STEPS) \
		model=nano train.micro_batch=16 train.log_every=20 train.eval_every=100 optim.lr=6e-3 optim.warmup_steps=30
	$(PY) -m hpctrain summary $(call arg,DEMO_DIR)
	$(PY) -m hpctrain generate run_dir=$(call arg,DEMO_DIR) prompt="def " max_new_tokens=120

# PYTEST_ARGS reaches pytest whole, in PYTEST_ADDOPTS: pytest splits it like a shell (PYTEST_ARGS='-m "not slurm"'
# is two words) but never evaluates it. Bytecode is written even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, set on these machines): otherwise each worker rewrites every test module's asserts
# again (2.3 core-s measured) and each of the suite's ~290 fresh interpreters compiles hpctrain again (~0.1
# core-s each).
test: install
	PYTHONDONTWRITEBYTECODE= PYTEST_ADDOPTS=$(call arg,PYTEST_ARGS) $(PY) -m pytest -q -n $(if $(filter undefined,$(origin TEST_WORKERS)),$(DEFAULT_WORKERS),$(call arg,TEST_WORKERS)) \
		--dist loadgroup

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m hpctrain bench

bench-data: install
	$(PY) -m hpctrain bench data

bench-host: install
	$(PY) -m hpctrain bench host

# llama_1b (1.24 B parameters), fsdp dp=2, two bf16 steps: ~22.3 GiB free memory (make slurm-down first), ~2 min.
bench-scale: install
	$(PY) -m hpctrain bench scale

# What monitoring costs: the same 2-rank run with the monitor defaults and with everything off (target <= 1 %):
bench-monitor: install
	$(PY) -m hpctrain bench monitor

# Bytes per step per rank and the loss after N steps for each gradient-communication option (dp=2):
bench-comm: install
	$(PY) -m hpctrain bench comm

# Downstream-evaluation throughput (requests/s): hpctrain's scorer against lm-eval's own hf model on the export:
bench-eval: install
	$(PY) -m hpctrain bench eval

# An MoE layer's tokens/s with grouped GEMM against the per-expert loop, and expert parallelism's all-to-all bytes:
bench-moe: install
	$(PY) -m hpctrain bench moe

# One rank of an 8- to 8,192-rank job under PyTorch's fake process group: start-up, the stop vote, the peaks'
# gather, the checkpoint's save plans and metadata, as the world grows (~2 min):
bench-world: install
	$(PY) -m hpctrain bench world

# Training stall per checkpoint, sync vs train.ckpt_async=true, against the disk's O_DIRECT write speed:
# llama_350m (4.2 GB checkpoints), ~11 GiB memory and ~9 GB free disk under outputs/, ~2 min.
bench-ckpt: install
	$(PY) -m hpctrain bench ckpt

# llama_1b bf16 at 2048 tokens on one GPU: hpctrain (largest micro-batch that fits) against a plain transformers
# loop, tokens/s and MFU; BENCH_GPU_ARGS passes more (e.g. --variants hpctrain,eager,logits-loss). ~3 min on an H100.
BENCH_GPU_ARGS ?=
bench-gpu: install
	$(PY) -m hpctrain bench gpu $(call args,BENCH_GPU_ARGS)

# On a GPU node: the GPU-marked tests, then the throughput run, in one table (outputs/gpu-check/table.txt).
# Without a CUDA device the tests are skipped with their reason. Under 8 minutes on one H100.
gpu-check: install
	$(PY) -m hpctrain gpu-check

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
PREP_SBATCH_ARGS ?=
# Not exported to recipes (after the ?= defaults: unexport defines a variable, empty): make would expand
# their values to build the recipes' environment (a $(shell ...) in one would run); the recipes pass them as
# quoted arguments instead.
unexport CORPUS OUT TOKENIZER VOCAB SEQ_LEN WORKERS SHARD_MB TEXT_FIELD PREP_ARGS PREP_SBATCH_ARGS \
  DEMO_DIR DEMO_STEPS PYTEST_ARGS BENCH_GPU_ARGS

tokenizer: install
	@$(call need,CORPUS OUT) || { echo "usage: make tokenizer CORPUS='raw/*.jsonl' VOCAB=32000 OUT=DIR [TEXT_FIELD=text]" >&2; exit 2; }
	$(PY) -m hpctrain prep tokenizer --corpus $(call args,CORPUS) --vocab $(call arg,VOCAB) --out $(call arg,OUT) \
		--text-field $(call arg,TEXT_FIELD)

shards: install
	@$(call need,CORPUS OUT) || { echo "usage: make shards CORPUS='raw/*.jsonl' OUT=DIR [TOKENIZER=DIR | VOCAB=N] [SEQ_LEN= WORKERS= SHARD_MB= TEXT_FIELD= PREP_ARGS=]" >&2; exit 2; }
	$(PY) -m hpctrain prep shards --corpus $(call args,CORPUS) --out $(call arg,OUT) \
		$(if $(call given,TOKENIZER),--tokenizer $(call arg,TOKENIZER),--vocab-size $(call arg,VOCAB)) \
		--seq-len $(call arg,SEQ_LEN) --shard-mb $(call arg,SHARD_MB) --text-field $(call arg,TEXT_FIELD) \
		$(if $(call given,WORKERS),--workers $(call arg,WORKERS)) $(call args,PREP_ARGS)

# Slurm job array + dependent merge job (run on a login node; needs TOKENIZER, e.g. from `make tokenizer`).
shards-slurm: install
	@$(call need,CORPUS OUT TOKENIZER) || { echo "usage: make shards-slurm CORPUS='raw/*.jsonl' OUT=DIR TOKENIZER=DIR [SEQ_LEN= SHARD_MB= PREP_ARGS=] [PREP_SBATCH_ARGS='--array=0-63 --cpus-per-task=32']" >&2; exit 2; }
	PYTHON=$(PY) PREP_SBATCH_ARGS=$(call arg,PREP_SBATCH_ARGS) bash sbatch/preprocess.sbatch \
		--corpus $(call args,CORPUS) --out $(call arg,OUT) --tokenizer $(call arg,TOKENIZER) \
		--seq-len $(call arg,SEQ_LEN) --shard-mb $(call arg,SHARD_MB) --text-field $(call arg,TEXT_FIELD) \
		$(call args,PREP_ARGS)

# A local multi-node Slurm cluster (root + apt; Debian/Ubuntu). Never started implicitly by `make test`.
slurm-up:
	bash sbatch/local_cluster.sh up

slurm-down:
	bash sbatch/local_cluster.sh down

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache build *.egg-info
