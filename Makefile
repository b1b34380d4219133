# Two commands on a fresh Debian machine:
#   make demo   - installs everything, starts the local sandbox, runs the example pipeline
#   make test   - installs everything, runs ruff and the whole test suite against the sandbox
# Both set themselves up (Debian packages, venv, pip) and stop what they started.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages: Python venv support (tests and demo), later steps add Slurm, munge and sshd.
DEBS := python3-venv python3-pip
PYTEST_ARGS ?=

.PHONY: help venv system-deps lint test unit demo clean

help:
	@echo "make demo   run the example pipeline on the local sandbox"
	@echo "make test   ruff + the whole test suite"

system-deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check airflow_skypilot tests dags benchmarks

unit: venv
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

test: venv lint
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; exit 0; fi; exit $$rc

demo: venv
	@for f in dags/tasks/*.yaml; do \
	  echo "== $$f"; \
	  $(VENV)/bin/airflow-skypilot validate $$f --env DATA_DIR=/tmp/skypilot-demo/data \
	    --env CKPT_DIR=/tmp/skypilot-demo/ckpt || exit 1; \
	  echo; \
	done

clean:
	rm -rf $(VENV) .sandbox .pytest_cache .ruff_cache *.egg-info
