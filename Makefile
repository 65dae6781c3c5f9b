# Two commands on a fresh machine with python3 and make:
#   make demo   install into .venv and run the tiny pipeline offline to results/chat.bin and results/release/
#   make test   install into .venv with the test extra and run the test suite
# Then `source .venv/bin/activate` for the `nanoeuler` and `snakemake` commands of README.md.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CORES  ?= 2

.PHONY: demo test test-all lint gpu-check compile-kernels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,cluster]'
	touch $(VENV)/.installed $(VENV)/.installed-lint $@

$(VENV)/.installed-lint: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[lint]'
	touch $(VENV)/.installed $@

# Targets go before --configfile (it takes every word after it). The rules run the `nanoeuler` beside
# the venv's snakemake; the last line says how to put both on PATH for the README's commands.
# `make demo DPO=1` adds the DPO stages (config/tiny-dpo.yaml: evaluate reports the DPO model too).
# The release folder (results/release/) costs a few seconds on top of the training.
DEMO_TARGETS := results/chat.bin results/samples.md results/metrics.json results/loss.png results/release/SHA256SUMS
DEMO_CONFIG  := config/tiny.yaml $(if $(filter 1,$(DPO)),config/tiny-dpo.yaml)
demo: $(VENV)/.installed
	$(BIN)/snakemake $(DEMO_TARGETS) --cores $(CORES) --configfile $(DEMO_CONFIG)
	@echo "make demo: done; 'source $(BIN)/activate' puts nanoeuler and snakemake on PATH"

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

# ruff's rules are [tool.ruff] in pyproject.toml; Snakemake's lint goes through a script that names the
# findings accepted by design and fails on any other.
lint: $(VENV)/.installed-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/lint_workflow.py $(BIN)/snakemake

# Every .cu file must compile; CI has nvcc but no GPU.
compile-kernels:
	@for f in nanoeuler/kernels/*.cu nanoeuler/kernels/bf16/*.cu nanoeuler/kernels/decode/*.cu; do [ -e "$$f" ] || continue; \
	  echo "nvcc $$f"; nvcc -arch=sm_90 -std=c++17 -c -o /dev/null "$$f" || exit 1; done

# On a GPU machine: gpu tests, kernel self-tests, GPU gradient check, a short 116M run.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf results logs .snakemake
