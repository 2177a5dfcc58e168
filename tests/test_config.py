"""The config schema (configs/schema.py): every listed value checked before any work, each problem named."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from configs.schema import RULES, ConfigError, _get, check, problems


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("config", overrides=list(overrides))


def test_defaults_pass_and_every_rule_names_a_real_key():
    from omegaconf import OmegaConf

    c = cfg()
    check(c)
    raw = OmegaConf.to_container(c, resolve=False)
    assert [k for k in RULES if not _get(raw, k)[0]] == []          # no rule for a key that does not exist


@pytest.mark.parametrize("override,line", [
    ("fleet.units=two", "fleet.units: expected an integer >= 1, given 'two'"),
    ("train.batch_size=-1", "train.batch_size: expected an integer >= 1, given -1"),
    ("fert.replay_ratio=1.5", "fert.replay_ratio: expected a number >= 0 and <= 1, given 1.5"),
    ("device=tpu", "device: expected one of ['auto', 'cpu', 'cuda'], given 'tpu'"),
    ("store.on_corrupt=ignore", "store.on_corrupt: expected one of ['raise', 'skip'], given 'ignore'"),
    ("fleet.episodes_per_unit=0", "fleet.episodes_per_unit: expected null or an integer >= 1, given 0"),
    ("train.lr=0", "train.lr: expected a number > 0, given 0"),
    ("store.url=/proc/fleetmind/store", "store.url: expected a creatable directory"),
    ("train.steps=true", "train.steps: expected an integer >= 1, given True"),
])
def test_each_bad_value_is_named(override, line):
    with pytest.raises(ConfigError) as e:
        check(cfg(override))
    assert line in str(e.value)


def test_all_problems_at_once_and_interpolations_follow_their_source(tmp_path):
    bad = problems(cfg("fleet.units=0", "eval.processes=0", f"store.url={tmp_path}/ok"))
    assert bad == ["fleet.units: expected an integer >= 1, given 0", "eval.processes: expected an integer >= 1, given 0"]
    assert cfg("fleet.units=3").job.fleet_units == 3               # one name: job.fleet_units follows fleet.units
    (tmp_path / "file").write_text("x")
    assert problems(cfg(f"store.url={tmp_path}/file")) == [
        f"store.url: expected a directory (a file is in the way), given '{tmp_path}/file'"]


@pytest.mark.parametrize("script,args", [("scripts/run.py", ["fleet.units=two"]),
                                         ("scripts/train.py", ["train.batch_size=-1"]),
                                         ("scripts/fleet.py", ["fleet.units=two"])])
def test_scripts_refuse_a_bad_value_before_any_work(script, args, tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, script, *args, f"hydra.run.dir={tmp_path}/out", f"store.url={tmp_path}/s"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"})
    assert p.returncode == 1 and "invalid config (nothing was run)" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 4
    assert not (tmp_path / "s").exists() and time.monotonic() - t0 < 120
