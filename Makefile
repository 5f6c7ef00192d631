# jupyter-gpulease: every target bootstraps what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# `make demo` installs only what the demo needs (the broker, the extension, JupyterLab: the demo extra), not the
# test, dev or ray extras; a venv that `make test` made already has all of it
DEMO_STAMP := $(VENV)/.demo-stamp
# JupyterHub's proxy for the tests that start a real Hub (npm; an ignored folder, found by tests/hub_process.py)
HUB_PROXY := .hub-proxy/node_modules/.bin/configurable-http-proxy
DEMO_DIR ?= $(CURDIR)/.demo
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint ts-check screenshots bench soak system-deps venv clean help

help:
	@echo "make demo   - broker with 4 simulated GPUs + JupyterLab with the extension and a demo notebook"
	@echo "make test   - lint, type-check, the sidebar's lint and unit tests, and the whole test suite"
	@echo "make bench  - run the benchmarks and rewrite BENCHMARKS.md"
	@echo "make soak   - 1,000 clients for 60 s, %%gpu soak, faults, security, fuzzing: BENCHMARKS.md figures"
	@echo "make lint   - ruff, mypy and the architecture contracts (import-linter)"
	@echo "make screenshots - the docs' pictures of the sidebar, taken from the real UI by a browser test"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev,ray]'
	# link the sidebar's build output so `cd labextension && jlpm build` is picked up without reinstalling
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyter-builder develop --overwrite .
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	[ $(STAMP) -nt pyproject.toml ] || $(BIN)/python -m pip install -q -e '.[demo]'
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyter-builder develop --overwrite .
	touch $(DEMO_STAMP)

# System packages the tests need (Debian): installed only when run as root and missing
# (chromium: browser tests; slurm-wlm, slurm-client, munge: the Slurm tests start a real Slurm).
system-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1; then \
		echo "Installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null 2>&1; then \
		echo "Installing Debian's Slurm and munge for the multi-node (Slurm) tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			slurm-wlm munge slurm-client >/dev/null; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check lease_broker jupyter_gpulease gpulease_protocol benchmarks tests
	$(BIN)/mypy
	$(BIN)/lint-imports

$(HUB_PROXY):
	npm install --silent --no-audit --no-fund --prefix .hub-proxy configurable-http-proxy@5

test: $(STAMP) system-deps $(HUB_PROXY) lint ts-check
	$(BIN)/python -m pytest

# The sidebar's linter (eslint, typescript-eslint) and unit tests (node --test over tsc's output), deps from its lockfile
ts-check: $(STAMP)
	cd labextension && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm install --immutable >/dev/null && \
		PATH="$(CURDIR)/$(BIN):$$PATH" jlpm lint && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm test

# The docs' pictures of the sidebar (the README's), taken by the browser tests from the real UI
screenshots: $(STAMP) system-deps
	GPULEASE_UPDATE_DOCS_IMAGES=1 $(BIN)/python -m pytest -q -p no:randomly \
		tests/test_browser.py::test_gpu_cell_run_from_the_ui_shows_in_the_sidebar

# the peers the cell benchmark measures beside %%gpu (ipyparallel; Ray comes with the ray extra)
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,dev,ray,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks

# 1,000 clients for 60 s, a %%gpu soak, the fault/security/fuzz tests with more fuzzing: rewrites the
# "Load and soak" and "Reliability" sections of BENCHMARKS.md (about 10 minutes)
soak: $(STAMP)
	GPULEASE_SOAK_SECONDS=$${GPULEASE_SOAK_SECONDS:-60} GPULEASE_FUZZ_EXAMPLES=$${GPULEASE_FUZZ_EXAMPLES:-100} \
		$(BIN)/python -m benchmarks --only load --only reliability

demo: $(DEMO_STAMP)
	bash scripts/demo.sh "$(DEMO_DIR)"

clean:
	rm -rf $(VENV) .demo build dist .hub-proxy

# The checks that need a real NVIDIA GPU (issue 33: real NVML, the CUDA checkpoint API on ~10 GiB, the pickling
# baseline), one bounded run writing gpu_check.json to $$OUT: the machine's own python3 (with PyTorch), not the venv
.PHONY: gpu-check
gpu-check: ; PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py
