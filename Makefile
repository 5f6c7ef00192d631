# jupyter-gpulease: every target bootstraps what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= $(CURDIR)/.demo
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint bench soak system-deps venv clean help

help:
	@echo "make demo   - broker with 4 simulated GPUs + JupyterLab with the extension and a demo notebook"
	@echo "make test   - lint, type-check and run the whole test suite"
	@echo "make bench  - run the benchmarks and rewrite BENCHMARKS.md"
	@echo "make lint   - ruff and mypy"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	# link the sidebar's build output so `cd labextension && jlpm build` is picked up without reinstalling
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyter labextension develop --overwrite .
	touch $(STAMP)

# System packages the tests need (Debian): installed only when run as root and missing.
system-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1; then \
		echo "Installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check lease_broker jupyter_gpulease benchmarks tests
	$(BIN)/mypy

test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks

demo: $(STAMP)
	bash scripts/demo.sh "$(DEMO_DIR)"

clean:
	rm -rf $(VENV) .demo build dist
