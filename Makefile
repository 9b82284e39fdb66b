# nanopt: `make demo` runs the whole lifecycle on the CPU; `make test` runs the test suite.
# Everything installs into .venv. On a machine without an NVIDIA GPU torch comes as the small CPU build (from a
# local wheelhouse in pip's find-links if it has one, else PyTorch's CPU index); with one (nvidia-smi lists a GPU), as
# the normal CUDA build from PyPI, checked to see the GPU. A .venv holding a CPU build gets the CUDA build the first
# time `make install` runs on a machine with a GPU.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
NANOPT := $(VENV)/bin/nanopt
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION   ?= 2.13.*
# "cuda" where an NVIDIA GPU answers, else "cpu": the install stamp names it, so a .venv made on a CPU machine (or
# before the driver worked) is looked at again on a machine with a GPU.
HOST_TORCH := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# pip without its configuration files and find-links, for the CUDA build from PyPI: a local wheelhouse of CPU wheels
# in find-links (development machines have one) would win, as torch 2.13.0+cpu sorts above 2.13.0 and matches.
PIP_PYPI := PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS=

.PHONY: install check-gpu-torch demo demo-smoke test test-slow test-deep lint docs bench clean-demo help

help:
	@echo "make install   create .venv with nanopt, torch (CPU or CUDA build) and the dev tools"
	@echo "make demo      tokenize the built-in corpus, train runs/demo on the CPU, evaluate it"
	@echo "make test      run the test suite, the tests marked slow left out (CPU; GPU tests skip without CUDA)"
	@echo "make test-slow the tests marked slow: kill loops, many-rank ladders, the GPU session's smoke run"
	@echo "make test-deep the fuzz and property tests of files from strangers, 300 examples each"
	@echo "make demo-smoke make demo's three commands, short, in a temporary folder (CI runs it; ~1-2 minutes)"
	@echo "make lint      ruff, and the import contract (.importlinter: each layer imports only from below)"
	@echo "make docs      write docs/config.md, the model.json / train.json reference, from the config schema"
	@echo "make bench     the tokenizer benchmark only (bench/bench_tokenize.py); the other scripts in bench/ are"
	@echo "               run one at a time, as bench/RESULTS.md shows for each (several need a GPU)"

install: $(VENV)/.installed-$(HOST_TORCH)

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if [ "$*" = cuda ] && $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') is a CPU build, on a machine with an NVIDIA GPU: replacing it"; \
		$(PIP) uninstall -q -y torch; \
	fi
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ "$*" = cuda ]; then \
		echo "NVIDIA GPU found: installing the CUDA build of torch from PyPI"; \
		$(PIP_PYPI) $(PIP) install -q "torch==$(TORCH_VERSION)"; \
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
	@$(MAKE) --no-print-directory check-gpu-torch
	touch $@

# Where nvidia-smi lists a GPU, torch must be a CUDA build that can use it; else say why (the driver) and fail.
check-gpu-torch:
	@if nvidia-smi -L >/dev/null 2>&1 && ! build=$$($(PY) -c 'import sys, torch; v = torch.version.cuda; \
			print(torch.__version__, f"(built for CUDA {v})" if v else "(a CPU build)"); \
			sys.exit(not (v and torch.cuda.is_available()))'); then \
		driver=$$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1); \
		echo "error: this machine has an NVIDIA GPU (driver $$driver), but torch $$build cannot use it." \
			"Hint: \`rm -f $(VENV)/.installed-*; make install\` replaces a CPU build; a CUDA build needs a" \
			"driver that supports its CUDA version (nvidia-smi shows the highest it supports): update the" \
			"driver, or install a torch built for an older CUDA, e.g. $(PIP) install --force-reinstall torch" \
			"--index-url https://download.pytorch.org/whl/cu126" >&2; \
		exit 1; \
	fi

# The demo: the built-in corpus (Python's own standard library) -> a tiny Llama trained on the CPU -> eval.
demo: install
	@test -f data/stdlib/meta.json || $(NANOPT) tokenize --out data/stdlib
	$(NANOPT) train runs/demo
	$(NANOPT) eval runs/demo

# The demo's smoke test (CI, after make test): make demo's three commands on the same corpus and configs, short,
# in a temporary folder that is removed afterwards, so runs/ and data/ stay as they are. The built-in corpus up to
# 100K train tokens (16K each for val and test), a copy of runs/demo's two configs trained 12 steps (one
# evaluation, one checkpoint), then `nanopt eval` of it (16K test tokens, short samples).
SMOKE_STEPS ?= 12
demo-smoke: install
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; start=$$(date +%s); \
	mkdir -p "$$tmp/runs/demo"; cp runs/demo/model.json runs/demo/train.json "$$tmp/runs/demo/"; \
	$(NANOPT) tokenize --out "$$tmp/data/stdlib" --max-tokens 100K --val-tokens 16K --test-tokens 16K; \
	$(NANOPT) train "$$tmp/runs/demo" --set max_steps=$(SMOKE_STEPS) --set eval_interval=$(SMOKE_STEPS) \
		--set checkpoint_interval=$(SMOKE_STEPS) --set eval_tokens=16K; \
	$(NANOPT) eval "$$tmp/runs/demo" --tokens 16K --max-new-tokens 32; \
	test -f "$$tmp/runs/demo/eval.json"; \
	echo "demo-smoke: passed in $$(( $$(date +%s) - start )) s"

# Two workers (pytest-xdist), so the suite keeps both cores busy; each is given whole files, so a file's module
# fixtures (trained runs) are built once and its tests keep their order. A plain `pytest` stays one process.
test: install
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow"

# CI runs these two after `make test` and `make lint` (.ci/run); each is also worth a run before a release.
test-slow: install
	$(PY) -m pytest -n 2 --dist loadfile -m slow

FUZZ_TESTS := tests/test_fuzz_run_files.py tests/test_untrusted_data.py tests/test_checkpoint_meta_properties.py \
	tests/test_task_files_bounded.py tests/test_import_index_fuzz.py
test-deep: install
	NANOPT_FUZZ_EXAMPLES=300 $(PY) -m pytest -n 2 --dist loadfile $(FUZZ_TESTS)

lint: install
	$(PY) -m ruff check nanopt tests bench scripts
	$(VENV)/bin/lint-imports --no-cache

# The reference pages made from the code: docs/config.md from the config schema (a test fails when it is stale).
docs: install
	$(PY) scripts/config_reference.py

# Only the tokenizer benchmark: the others take a GPU, several ranks or many minutes, and each is run on its own
# (bench/RESULTS.md gives every one's command and what it printed).
bench: install
	$(PY) bench/bench_tokenize.py

clean-demo:
	rm -rf runs/demo/checkpoints runs/demo/metrics.jsonl runs/demo/*.png runs/demo/eval.json
