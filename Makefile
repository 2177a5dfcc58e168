# fleetmind: `make run` (the main job on its embedded default) and `make test` (the test suite).
# Each target creates the virtualenv in $(VENV) when it is missing.
# fleetmind needs Python 3.12 (LeRobot 0.6.1 does): the first Python 3.12 found, python3.12 on PATH, then pyenv's;
# override with PY=/path/to/python3.12
PY ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
        $(shell $(p) -c "import sys; sys.version_info[:2] == (3, 12) and print('$(p)')" 2>/dev/null)))
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fleetmind-installed
export MUJOCO_GL ?= egl
export WANDB_MODE ?= offline
export RAY_AUTH_MODE ?= disabled
export PYTHONUNBUFFERED := 1

.PHONY: install run test test-fast test-lerobot sim-check clean

install: $(STAMP)

# One environment: fleetmind with its fleet, dev and lerobot extras (LeRobot 0.6.1) and its LeRobot plugins
# (plugins/README.md) on Python 3.12, resolved together (`pip check`). torch 2.11 + torchvision 0.26 first: LeRobot 0.6.1 caps torch < 2.12 (docs/DEPENDENCIES.md).
# A $(VENV) left by an older checkout on another Python is made anew.
PLUGINS := $(wildcard plugins/lerobot_*_fleetmind)

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	@test -n "$(PY)" || { echo "fleetmind needs Python 3.12 (LeRobot 0.6.1 does), and none was found (python3.12 on PATH or pyenv's): install it or pass PY=/path/to/python3.12"; exit 1; }
	@if test -x $(BIN)/python && ! $(BIN)/python -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then \
	  echo "$(VENV) is not Python 3.12: making it anew"; rm -rf $(VENV); fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.11.*" "torchvision==0.26.*"
	$(BIN)/python -m pip install -q -e ".[fleet,dev,lerobot]" $(addprefix -e ,$(PLUGINS))   # + fleetmind's LeRobot plugins
	$(BIN)/python -m pip check
	$(BIN)/python -c "import torch, mujoco, metaworld, ray, zarr, lerobot; from lerobot.datasets.lerobot_dataset import LeRobotDataset"
	touch $@

run: $(STAMP)
	$(BIN)/python scripts/run.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest tests $(ARGS)

# the LeRobot tests alone (make test runs them too)
test-lerobot: $(STAMP)
	$(BIN)/python -m pytest tests/with_lerobot -m lerobot $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(ARGS)

sim-check: $(STAMP)
	$(BIN)/python scripts/sim_check.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun wandb
