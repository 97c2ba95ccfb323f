# tplib: `make reproduce` runs the reproduction, `make test` the test suite.
# Both create .venv (Python 3.11, CPU torch here, CUDA torch on GPU nodes) when it is missing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all test reproduce lab lint format bench clean

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# MODE=all (simulate, then measure on real local processes) | simulate | measure;
# FORCE=1 reruns notebooks whose results exist.
MODE  ?= all
FORCE ?=
reproduce: $(STAMP)
	$(PY) -m tplib reproduce --mode $(MODE) $(if $(filter 1,$(FORCE)),--force,)

bench: $(STAMP)
	$(PY) scripts/bench_slicing.py

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check tplib tests scripts
	$(VENV)/bin/ruff format --check tplib tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format tplib tests scripts
	$(VENV)/bin/ruff check --fix tplib tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
