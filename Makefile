# substrax-tasks: set-up, checks, docs and the example pipeline.
#
#   make demo    run the example pipeline (dodo.py) on the local backend
#   make test    install what the tests need, then ruff, mypy and pytest
#   make test-fast  the unit tier only (no processes, no network): seconds
#
# Both do all the set-up on a fresh Debian 12 machine: a virtualenv in .venv
# with the project installed editable, and (as root) the system packages
# through apt-get. As another user the apt step is skipped and the missing
# tools are named. `make help` lists every target.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Touched after a successful install; remade when pyproject.toml changes.
STAMP := $(VENV)/.substrax-installed
PYTEST_ARGS ?=
# SkyPilot lives in its own virtualenv: the project never imports it, and
# runs its SDK helper with this python (the tests' SUBSTRAX_SKY_PYTHON).
SKY_VENV := .sky-venv
SKY_VERSION := 0.14.1
SKY_STAMP := $(SKY_VENV)/.substrax-sky-$(SKY_VERSION)
# The helper imports `sky`: the project's mypy checks it against $(SKY_VENV)
# (its mypy.ini names that python), not with the package's settings.
SKY_HELPER_MYPY := substrax_tasks/backends/skypilot/helper/mypy.ini
# remote/ must run on Python 3.8, which mypy 1.17+ can no longer check for:
# an older mypy in a venv of its own (remote/mypy.ini says what it checks).
MYPY38_VENV := .mypy38-venv
MYPY38 := $(MYPY38_VENV)/bin/mypy
# The doit task `make remote-run` calls (defined by the example dodo.py).
REMOTE_RUN_TASK ?= fit

# Tools the tests need, as `tool:debian-package` pairs.
TEST_TOOLS := bwrap:bubblewrap rsync:rsync sshd:openssh-server ssh:openssh-client ip:iproute2 strace:strace chromium:chromium tmux:tmux
# The example pipeline needs the sandbox and rsync only.
DEMO_TOOLS := bwrap:bubblewrap rsync:rsync

# $(call ensure-tools,PAIRS): install the packages of the missing tools with
# apt-get when root; otherwise name what is missing and go on.
define ensure-tools
missing=(); packages=(); \
for pair in $(1); do \
  tool=$${pair%%:*}; package=$${pair#*:}; \
  if ! command -v "$$tool" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$$tool" ]; then \
    missing+=("$$tool"); packages+=("$$package"); \
  fi; \
done; \
if [ $${#missing[@]} -gt 0 ]; then \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
    echo "==> installing $${packages[*]} (missing: $${missing[*]})"; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $${packages[*]}; \
  else \
    echo "==> warning: missing $${missing[*]}; tests and runs that need them cannot work." >&2; \
    echo "    as root: apt-get install -y $${packages[*]}" >&2; \
  fi; \
fi
endef

.PHONY: help install venv sky-venv system-deps demo-deps test test-fast test-e2e lint format typecheck docs demo remote-run bench bench-smoke bench-smoke-e2e clean distclean

help:
	@echo "substrax-tasks"
	@echo "  make demo        run the example pipeline (dodo.py) on the local backend"
	@echo "  make test        system packages (as root), then ruff, mypy and pytest"
	@echo "  make test-fast   the unit tier (pytest -m unit: no processes, no network), in seconds"
	@echo "  make test-e2e    (root) a one-node Slurm cluster here, SkyPilot launching on it, end to end"
	@echo "  make install     create $(VENV) and install the project with its test extras"
	@echo "  make sky-venv    install SkyPilot $(SKY_VERSION) into $(SKY_VENV) (for the SkyPilot tests)"
	@echo "  make lint        ruff check"
	@echo "  make format      ruff format (rewrites files)"
	@echo "  make typecheck   mypy (strict): the package, the SkyPilot helper (in $(SKY_VENV)), remote/ (3.8)"
	@echo "  make docs        build the documentation into site/ (mkdocs --strict)"
	@echo "  make remote-run  run the example's remote step on the configured backend, or on a"
	@echo "                   throwaway SSH host started here when none is configured"
	@echo "                   (SUBSTRAX_BACKEND=name picks another one)"
	@echo "  make bench       run every bench/bench_*.py"
	@echo "  make bench-smoke every bench/bench_*.py once at a small size, each checked to measure its"
	@echo "                   figures (bench/smoke.py; CI runs it after make test): a few minutes"
	@echo "  make bench-smoke-e2e  (root) the Slurm bed's benches (reuse, warm, preemption) at a small"
	@echo "                   size on a bed of their own: about 15 minutes, not in CI"
	@echo "  make clean       remove build output and caches (keeps $(VENV) and .substrax)"
	@echo "  make distclean   clean, and remove $(VENV)"

# ------------------------------------------------------------------ set-up

install: $(STAMP)

venv: $(BIN)/python

# A virtualenv from $(PYTHON) (>= 3.10). Debian ships venv and ensurepip in
# python3-venv: as root it is installed when missing. A failed attempt
# leaves no half-made .venv behind.
$(BIN)/python:
	@if ! command -v $(PYTHON) >/dev/null 2>&1 || ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing python3 and python3-venv"; \
	    apt-get update; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv; \
	  else \
	    echo "error: $(PYTHON) with the venv module is needed; as root: apt-get install -y python3 python3-venv" >&2; \
	    exit 1; \
	  fi; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
	  echo "error: substrax-tasks needs Python >= 3.10, but $(PYTHON) is $$($(PYTHON) -V 2>&1);" \
	       "run again with PYTHON=/path/to/python3.x" >&2; exit 1; }
	@echo "==> creating $(VENV) with $$($(PYTHON) -V 2>&1)"
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "==> installing substrax-tasks (editable) with its test extras into $(VENV)"
	$(BIN)/python -m pip install --disable-pip-version-check --quiet -e '.[test]'
	@# Bytecode now, as a pip install of the wheel would: with
	@# PYTHONDONTWRITEBYTECODE set, an editable install never writes it, and
	@# every doit would compile the package from source (~50-90 ms).
	$(BIN)/python -m compileall -q substrax_tasks remote
	@touch $@

$(MYPY38): | $(BIN)/python
	@$(BIN)/python -m venv $(MYPY38_VENV)
	@$(MYPY38_VENV)/bin/python -m pip install --disable-pip-version-check --quiet 'mypy>=1.14,<1.17'

sky-venv: $(SKY_STAMP)

# About 90 s and 460 MB the first time. A failed install leaves no stamp.
$(SKY_STAMP): | $(BIN)/python
	@echo "==> installing SkyPilot $(SKY_VERSION) into $(SKY_VENV) (its own virtualenv)"
	@rm -rf $(SKY_VENV)
	@$(PYTHON) -m venv $(SKY_VENV)
	@$(SKY_VENV)/bin/python -m pip install --disable-pip-version-check --quiet 'skypilot==$(SKY_VERSION)' || { \
	  echo "error: installing skypilot==$(SKY_VERSION) from the package index failed (is it reachable?)" >&2; \
	  rm -rf $(SKY_VENV); exit 1; }
	@touch $@

system-deps:
	@$(call ensure-tools,$(TEST_TOOLS))

demo-deps:
	@$(call ensure-tools,$(DEMO_TOOLS))

# ------------------------------------------------------------------ checks

# pytest runs last, so the output ends with its summary line. Two workers
# (pytest-xdist), each given whole test files so a module's fixtures are made
# once: most of the suite waits on processes, sshd and polls, and both cores
# then have work (bench/README.md has the figures). The files go longest
# first (tests/file_seconds.txt, tests/support/file_order.py), not xdist's
# most-tests-first, so no long file starts last with one worker left alone.
# PYTEST_ARGS=-n0 runs it in one process.
test: system-deps install sky-venv $(MYPY38)
	@echo "==> ruff check"
	@$(BIN)/ruff check .
	@echo "==> mypy"
	@$(BIN)/mypy
	@$(BIN)/mypy --config-file $(SKY_HELPER_MYPY)
	@$(MYPY38) --config-file remote/mypy.ini
	@echo "==> pytest"
	@$(BIN)/python -m pytest --ignore=tests/e2e -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The tests marked `unit` run in this process only (tests/support/unit_tier.py makes
# spawning a process or opening a connection fail them): no apt, no SkyPilot.
test-fast: install
	@$(BIN)/python -m pytest tests/unit -p no:cacheprovider $(PYTEST_ARGS)

# The end-to-end tier (root only): a one-node Slurm cluster on this machine
# (tests/support/testbeds/slurm_cluster.py: munge, slurmctld, slurmd, an sshd and a
# throwaway cluster user), SkyPilot launching on it through its SDK helper.
# The bed goes down again even when a test fails or make is interrupted; its
# own output goes to $(E2E_BED).log, shown when something fails (and the bed's
# daemon logs are then kept in $(E2E_BED)/logs). The output ends with pytest's
# summary line. One bed per checkout: the folder is named after $(CURDIR).
E2E_BED ?= /tmp/sxt-e2e-$(shell printf '%s' '$(CURDIR)' | sha1sum | cut -c1-8)
E2E_PYTEST_ARGS ?= -rA

test-e2e: system-deps install sky-venv
	@echo "==> Slurm test bed up in $(E2E_BED) (its log: $(E2E_BED).log)"
	@set +e; \
	bed=tests/support/testbeds/slurm_cluster.py; log="$(E2E_BED).log"; \
	trap 'exit 130' INT; trap 'exit 143' TERM; \
	trap 'rc=$$?; trap "" INT TERM; keep=(); [ $$rc -eq 0 ] || keep=(--keep-logs); \
	  if ! $(BIN)/python "$$bed" down --root "$(E2E_BED)" "$${keep[@]}" >>"$$log" 2>&1; then \
	    echo "error: the Slurm test bed did not come down cleanly:" >&2; tail -n 30 "$$log" >&2; rc=1; \
	  elif [ $$rc -eq 0 ]; then rm -f "$$log"; \
	  else echo "==> kept: the bed log $$log and the daemon logs in $(E2E_BED)/logs" >&2; fi; \
	  exit $$rc' EXIT; \
	if ! $(BIN)/python "$$bed" up --root "$(E2E_BED)" >"$$log" 2>&1; then \
	  echo "error: the Slurm test bed did not come up:" >&2; tail -n 40 "$$log" >&2; exit 1; \
	fi; \
	echo "==> pytest tests/e2e"; \
	SUBSTRAX_E2E_BED="$(E2E_BED)" $(BIN)/python -m pytest tests/e2e $(E2E_PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .

typecheck: install sky-venv $(MYPY38)
	$(BIN)/mypy
	$(BIN)/mypy --config-file $(SKY_HELPER_MYPY)
	$(MYPY38) --config-file remote/mypy.ini

docs: install
	$(BIN)/mkdocs build --strict --site-dir site

# ------------------------------------------------------------------ running

# doit reads its settings (sqlite3 dep file) from [tool.doit] in pyproject.toml.
demo: demo-deps install
	$(BIN)/doit

# The example's remote step on the configured backend; with no remote
# configured, on a throwaway SSH host started here (in a network namespace
# as root, on 127.0.0.1 otherwise) and stopped afterwards, even on failure.
# scripts/remote_run.sh says when a remote counts as configured.
REMOTE_RUN_TOOLS := $(DEMO_TOOLS) ssh:openssh-client sshd:openssh-server

remote-run: install
	@$(call ensure-tools,$(REMOTE_RUN_TOOLS))
	@BIN=$(BIN) REMOTE_RUN_TASK=$(REMOTE_RUN_TASK) scripts/remote_run.sh

# Every script runs, even after one fails; the failures are named at the end.
bench: install
	@shopt -s nullglob; scripts=(bench/bench_*.py); failed=(); \
	if [ $${#scripts[@]} -eq 0 ]; then echo "no bench/bench_*.py yet"; exit 0; fi; \
	for script in "$${scripts[@]}"; do \
	  echo "==> $$script"; \
	  $(BIN)/python "$$script" || failed+=("$$script"); \
	done; \
	if [ $${#failed[@]} -gt 0 ]; then echo "bench: failed: $${failed[*]}" >&2; exit 1; fi

# Every bench script as shipped, at a size that takes seconds, its figures
# checked (bench/smoke.py): a moved helper or a changed rule fails the build,
# not the next measurement. CI runs it after `make test` (.ci/run), outside
# `make test` so that its output still ends with pytest's summary line.
bench-smoke: system-deps install
	@$(BIN)/python bench/smoke.py

# The Slurm bed's benches at a small size (root): each brings its own bed up
# and down, about 15 minutes in all; not part of CI (bench/README.md).
bench-smoke-e2e: system-deps install sky-venv
	@$(BIN)/python bench/smoke.py --e2e

# ------------------------------------------------------------------ cleaning

# Run records (.substrax/) and doit's database (.doit.db) are kept: a run may
# still hold folders or machines (see `substrax-compute teardown`).
clean:
	rm -rf site build dist .mypy_cache .ruff_cache .pytest_cache
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -type d -print0 \
	  | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) $(MYPY38_VENV)
