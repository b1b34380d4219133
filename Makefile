# Two commands on a fresh Debian machine, as root (the sandbox starts slurmd, munge and sshd):
#   make demo   - installs everything, starts the local sandbox, runs the example pipeline with
#                 a node failure under the training job, prints the placements and the result
#   make test   - installs everything, runs ruff and the whole test suite against the sandbox
# Both set themselves up (Debian packages, venv, pip) and stop the sandbox they started, also
# when interrupted (Ctrl-C, SIGTERM).

SHELL := /bin/bash
# Debian's own Python where there is one (python3-venv is installed for it); else python3
PYTHON ?= $(shell [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml .ci/constraints.txt | sha1sum | cut -c1-12)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Python venv support; real Slurm (controller, node daemon, client, munge); sshd for the login
# nodes; util-linux/procps/iproute2/curl for the job scripts and the sandboxes' process control;
# shellcheck and docker-compose for the static checks of docker/ (no Docker engine is needed);
# chromium renders the UI pages headless in tests/e2e/test_ui_browser.py (driven over the
# DevTools protocol: no chromedriver); postgresql and redis-server for the production-shaped
# deployment test (tests/e2e/deployment.py runs its own postmaster and redis on free loopback
# ports under a temp dir; the services the packages install are not used). rsync is the
# reference the workdir filter is tested against (SkyPilot sends a workdir with it).
DEBS := python3-venv python3-pip python3-dev gcc slurmctld slurmd slurm-client munge \
        openssh-server openssh-client util-linux procps iproute2 curl ca-certificates \
        shellcheck docker-compose chromium postgresql redis-server rsync
PYTEST_ARGS ?=

.PHONY: help venv system-deps lint unit test demo sandbox sandbox-down sandbox-status clean

help:
	@echo "make demo            run the example pipeline on the local sandbox (with a failover)"
	@echo "make test            ruff + the whole test suite (starts and stops the sandbox)"
	@echo "make sandbox         start the sandbox (Slurm clusters, Kubernetes API, AWS) and leave it up"
	@echo "make sandbox-down    stop it"

system-deps:
	@missing=""; for p in $(DEBS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || \
	    missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

# Installed with the versions the suite last ran green with (.ci/constraints.txt). The Debian
# packages are checked on every run (system-deps: a dpkg-query per package, no apt when none is
# missing), before the venv, not only when the venv is made: a package added to DEBS gets
# installed where a venv exists already.
$(STAMP): pyproject.toml .ci/constraints.txt | system-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]" -c .ci/constraints.txt
	@# the build's egg-info next to the sources would make tests that put the checkout on
	@# PYTHONPATH see the provider's entry points twice ("Plugin already registered")
	@rm -rf airflow_skypilot.egg-info
	@rm -f $(VENV)/.installed-* && touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .

unit: venv
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

sandbox: venv
	$(PY) -m tests.sandbox up

sandbox-down:
	@if [ -x $(PY) ]; then $(PY) -m tests.sandbox down; fi
	@if [ -x $(PY) ] && [ -d .sandbox-b ]; then SKYPILOT_SANDBOX_DIR=$(CURDIR)/.sandbox-b \
		SKYPILOT_SANDBOX_PORT_BASE=$$(( $${SKYPILOT_SANDBOX_PORT_BASE:-28000} + 500 )) \
		$(PY) -m tests.sandbox down; fi

sandbox-status: venv
	$(PY) -m tests.sandbox status

# Two shards at once, each on sandboxes of its own, stopped whatever pytest says
# (tests/run_suite.sh); `make test PYTEST_ARGS=tests/unit` runs just those, on one sandbox set.
# Both exec their runner, so the SIGTERM make passes on reaches it; each stops the sandbox
# itself on its end, an error, Ctrl-C or SIGTERM.
test: venv lint
	@export PY=$(PY); exec tests/run_suite.sh $(PYTEST_ARGS)

# tests/sandbox/demo.py --sandbox: up, the demo, down (in a finally)
demo: venv
	@exec $(PY) -m tests.sandbox.demo --sandbox

clean: sandbox-down
	rm -rf $(VENV) .sandbox .sandbox-b .pytest_cache .ruff_cache *.egg-info
