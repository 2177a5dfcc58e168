# fleetmind: `make run` (the main job on its embedded default) and `make test` (the test suite).
# Each target creates the virtualenv in $(VENV) when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fleetmind-installed
export MUJOCO_GL ?= egl
export WANDB_MODE ?= offline
export RAY_AUTH_MODE ?= disabled
export PYTHONUNBUFFERED := 1

.PHONY: install run test test-fast sim-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: the CPU wheel on machines that carry it, else the registry's build for this platform
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q "torch>=2.4,<2.15"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

run: $(STAMP)
	$(BIN)/python scripts/run.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest tests $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(ARGS)

sim-check: $(STAMP)
	$(BIN)/python scripts/sim_check.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun wandb
