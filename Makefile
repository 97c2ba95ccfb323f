# tplib: `make reproduce` runs the reproduction, `make test` the test suite.
# Both create .venv (Python 3.11, CPU torch here, CUDA torch on GPU nodes) when it is missing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SOURCES := tplib tests scripts

.PHONY: all test test-browser reproduce lab lint format bench gpu-check clean

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# Lint and type-check first; pytest exits 5 when it collects no tests, which is not a
# failure of the suite.
test: lint
	@$(PY) -m pytest -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# MODE=all (simulate, then measure on real local processes) | simulate | measure.
# An interrupted run resumes where it stopped; FORCE=1 starts a new run regardless.
MODE  ?= all
FORCE ?=
# The explorer in JupyterLab in headless Chromium (tests/test_explorer_browser.py; make
# test runs it too where Chromium is installed, and says it skipped it where not).
test-browser: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[browser]'
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else echo "install Debian's chromium (as root: apt-get install chromium)"; exit 1; fi; }
	$(PY) -m pytest -q -p no:cacheprovider -rs tests/test_explorer_browser.py

# LAUNCHER=slurm: one SLURM array task per configuration; SBATCH_ARGS="--partition=..."
# go to its sbatch line, NO_WAIT=1 returns once submitted (run it again to gather).
reproduce: $(STAMP)
	$(PY) -m tplib reproduce --mode $(MODE) $(if $(filter 1,$(FORCE)),--force,) \
	  $(if $(LAUNCHER),--launcher $(LAUNCHER),) \
	  $(if $(SBATCH_ARGS),--sbatch-args '$(SBATCH_ARGS)',) $(if $(filter 1,$(NO_WAIT)),--no-wait,)

bench: $(STAMP)
	$(PY) scripts/bench_slicing.py

# On an NVIDIA GPU: device info, the CUDA exactness tests, a multi-rank run and Figure 3,
# into results/gpu/. Without a GPU it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out results/gpu

# JupyterLab refuses to start as root (a container's user) without --allow-root.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root,) notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format $(SOURCES)
	$(VENV)/bin/ruff check --fix $(SOURCES)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis .mypy_cache
