# tplib: `make reproduce` runs the reproduction, `make test` the test suite.
# Both create .venv (Python 3.11, CPU torch here, CUDA torch on GPU nodes) when it is missing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SOURCES := tplib tests scripts

.PHONY: all test reproduce lab lint format bench gpu-check clean

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
reproduce: $(STAMP)
	$(PY) -m tplib reproduce --mode $(MODE) $(if $(filter 1,$(FORCE)),--force,)

bench: $(STAMP)
	$(PY) scripts/bench_slicing.py

# On an NVIDIA GPU: device info, the CUDA exactness tests, a multi-rank run and Figure 3,
# into results/gpu/. Without a GPU it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out results/gpu

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format $(SOURCES)
	$(VENV)/bin/ruff check --fix $(SOURCES)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis .mypy_cache
