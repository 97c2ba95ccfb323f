# tplib: `make reproduce` runs the reproduction, `make test` the test suite.
# Both create .venv (Python 3.11) when it is missing: torch==2.13.0 from pip's index (the
# CPU wheel on this kind of machine), or from TORCH_INDEX, e.g. a CUDA build with
# TORCH_INDEX=https://download.pytorch.org/whl/cu128 (run `make clean` first to switch).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SOURCES := tplib tests scripts
TORCH_INDEX ?=
# PYTHON given on the command line or in the environment: gpu-check runs that
# interpreter as it is (an offline GPU node's own torch), with no venv and no install.
GPU_PYTHON_GIVEN := $(filter command line environment,$(origin PYTHON))
GPU_PY := $(if $(GPU_PYTHON_GIVEN),$(PYTHON),$(PY))

.PHONY: all test test-fast test-browser reproduce lab lint format bench gpu-check gpu-check-rehearsal clean

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --disable-pip-version-check \
	  --index-url $(TORCH_INDEX) torch==2.13.0,)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# Lint and type-check first. Then the suite in two passes: the tests that run in pytest's
# own process on two workers (pytest-xdist; each torch on one thread), and after them, on
# their own, the tests that start processes or run notebooks (tests/conftest.py marks
# them), whose 2-process pipelines need both cores. pytest exits 5 when a pass collects no
# tests, which is not a failure of the suite.
test: lint
	@OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 \
	  -m "not (system or notebook)"; rc=$$?; \
	if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; \
	$(PY) -m pytest -q -p no:cacheprovider -m "system or notebook"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The fast tier, for the edit-test loop: under 2 minutes on 2 cores. pytest only, no lint
# (make lint for that). It leaves out the tests marked slow, system (they start processes),
# notebook and cuda (tests/conftest.py marks them), but keeps one runtime exactness case per
# schedule (marked fast); each hypothesis property tries a few examples. Two pytest-xdist
# workers, each torch on one thread.
test-fast: $(STAMP)
	@HYPOTHESIS_PROFILE=quick OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 \
	  -m "fast or not (slow or system or notebook or cuda)"; rc=$$?; \
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

# On an NVIDIA GPU, in under 8 minutes: device info, the CUDA exactness tests, a multi-rank
# run, Figure 3, slicing's and keyed dropout's cost, MFU and memory against the model, into
# results/gpu/<device>/ (and an archive of it in $GPU_CHECK_OUT when set). Without a GPU it
# says so and exits 0; with a GPU that torch cannot use it fails, saying why.
# `make gpu-check PYTHON=python3` runs the node's own Python as it is.
gpu-check: $(if $(GPU_PYTHON_GIVEN),,$(STAMP))
	$(GPU_PY) scripts/gpu_check.py --out results/gpu

# The same check, every step on the CPU at small sizes (make test runs it too).
gpu-check-rehearsal: $(if $(GPU_PYTHON_GIVEN),,$(STAMP))
	GPU_CHECK_DRY=1 $(GPU_PY) scripts/gpu_check.py --out build/gpu-check

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
