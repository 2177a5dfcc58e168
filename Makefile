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

LEROBOT_VENV ?= .venv-lerobot
LBIN := $(LEROBOT_VENV)/bin
LSTAMP := $(LEROBOT_VENV)/.fleetmind-installed
# LeRobot 0.6.1 needs Python >= 3.12 (and torch < 2.12): its own venv, made with $(PY312)
# the first Python 3.12 found: python3.12 on PATH, then pyenv's; override with PY312=/path/to/python3.12
PY312 ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
           $(shell $(p) -c "import sys; sys.version_info[:2] == (3, 12) and print('$(p)')" 2>/dev/null)))
LEROBOT06_VENV ?= .venv-lerobot06
L6BIN := $(LEROBOT06_VENV)/bin
L6STAMP := $(LEROBOT06_VENV)/.fleetmind-installed

.PHONY: install install-lerobot install-lerobot06 run test test-fast test-lerobot test-lerobot06 sim-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: the CPU wheel on machines that carry it, else the registry's build for this platform
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q "torch>=2.4,<2.15"
	$(BIN)/python -m pip install -q -e ".[fleet,dev]"
	touch $@

# The LeRobot environment (its own venv; LeRobot 0.4.4 pins torch<2.11, so it is installed with --no-deps beside
# torch 2.14.1 + torchvision 0.29.1, then its other runtime dependencies from requirements-lerobot.txt).
install-lerobot: $(LSTAMP)

$(LSTAMP): pyproject.toml requirements-lerobot.txt
	test -x $(LBIN)/python || $(PY) -m venv $(LEROBOT_VENV)
	$(LBIN)/python -m pip install -q --upgrade pip
	$(LBIN)/python -c "import torchvision" 2>/dev/null || $(LBIN)/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(LBIN)/python -m pip install -q -e ".[fleet,dev]"
	$(LBIN)/python -m pip install -q --no-deps "lerobot==0.4.4"
	$(LBIN)/python -m pip install -q -r requirements-lerobot.txt
	$(LBIN)/python -c "import lerobot, diffusers, torchvision; from lerobot.datasets.lerobot_dataset import LeRobotDataset"
	touch $@

# The LeRobot 0.6.1 environment: resolved as one environment (no --no-deps) with fleetmind's extras, torch 2.11 and
# torchvision 0.26 first (LeRobot 0.6.1 caps torch < 2.12); docs/DEPENDENCIES.md "LeRobot 0.6.1".
install-lerobot06: $(L6STAMP)

$(L6STAMP): pyproject.toml
	@test -n "$(PY312)" || { echo "LeRobot 0.6.1 needs Python 3.12, and none was found (python3.12 on PATH or pyenv's): install it or pass PY312=/path/to/python3.12"; exit 1; }
	test -x $(L6BIN)/python || $(PY312) -m venv $(LEROBOT06_VENV)
	$(L6BIN)/python -m pip install -q --upgrade pip
	$(L6BIN)/python -m pip install -q "torch==2.11.*" "torchvision==0.26.*"
	$(L6BIN)/python -m pip install -q "lerobot[dataset,feetech]==0.6.1" -e ".[fleet,dev]"
	$(L6BIN)/python -m pip check
	$(L6BIN)/python -c "import lerobot, torch; from lerobot.datasets.lerobot_dataset import LeRobotDataset"
	touch $@

run: $(STAMP)
	$(BIN)/python scripts/run.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest tests $(ARGS)

test-lerobot: $(LSTAMP)
	$(LBIN)/python -m pytest tests/with_lerobot -m lerobot $(ARGS)

test-lerobot06: $(L6STAMP)
	$(L6BIN)/python -m pytest tests/with_lerobot -m lerobot $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(ARGS)

sim-check: $(STAMP)
	$(BIN)/python scripts/sim_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(LEROBOT_VENV) $(LEROBOT06_VENV) outputs multirun wandb
