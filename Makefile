# nanopt: `make demo` runs the whole lifecycle on the CPU; `make test` runs the test suite.
# Everything installs into .venv. On a machine without an NVIDIA GPU torch comes as the small CPU build (from a
# local wheelhouse in pip's find-links if it has one, else PyTorch's CPU index); with one (nvidia-smi works), as the
# normal CUDA build from PyPI.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
NANOPT := $(VENV)/bin/nanopt
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION   ?= 2.13.*

.PHONY: install demo test lint bench clean-demo help

help:
	@echo "make install   create .venv with nanopt, torch (CPU or CUDA build) and the dev tools"
	@echo "make demo      tokenize the built-in corpus, train runs/demo on the CPU, evaluate it"
	@echo "make test      run the test suite (CPU; GPU tests skip without CUDA)"
	@echo "make lint      ruff, and the import contract (.importlinter: each layer imports only from below)"
	@echo "make bench     the benchmark scripts in bench/"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing the CUDA build of torch"; \
		$(PIP) install -q "torch==$(TORCH_VERSION)"; \
	else \
		echo "No NVIDIA GPU: installing the CPU build of torch"; \
		if $(PIP) install -q --dry-run --no-deps --no-index "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
			$(PIP) install -q "torch==$(TORCH_VERSION)"; \
		else \
			$(PIP) install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX) \
				--extra-index-url https://pypi.org/simple; \
		fi; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $@

# The demo: the built-in corpus (Python's own standard library) -> a tiny Llama trained on the CPU -> eval.
demo: install
	@test -f data/stdlib/meta.json || $(NANOPT) tokenize --out data/stdlib
	$(NANOPT) train runs/demo
	$(NANOPT) eval runs/demo

# Two workers (pytest-xdist), so the suite keeps both cores busy; each is given whole files, so a file's module
# fixtures (trained runs) are built once and its tests keep their order. A plain `pytest` stays one process.
test: install
	$(PY) -m pytest -n 2 --dist loadfile

lint: install
	$(PY) -m ruff check nanopt tests bench
	$(VENV)/bin/lint-imports --no-cache

bench: install
	$(PY) bench/bench_tokenize.py

clean-demo:
	rm -rf runs/demo/checkpoints runs/demo/metrics.jsonl runs/demo/*.png runs/demo/eval.json
