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
from configs.schema import RULES, ConfigError, _get, check, declared_keys, problems


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("config", overrides=list(overrides))


def test_defaults_pass_and_every_rule_names_a_real_key():
    from omegaconf import OmegaConf

    c = cfg()
    check(c)
    raw = OmegaConf.to_container(c, resolve=False)
    known, _ = declared_keys()
    assert [k for k in RULES if not _get(raw, k)[0] and k not in known] == []   # no rule for a key no YAML declares


@pytest.mark.parametrize("override,line", [
    ("fleet.units=0", "fleet.units: expected an integer >= 1, given 0"),
    ("train.batch_size=-1", "train.batch_size: expected an integer >= 1, given -1"),
    ("fert.replay_ratio=1.5", "fert.replay_ratio: expected a number >= 0 and <= 1, given 1.5"),
    ("device=tpu", "device: expected one of ['auto', 'cpu', 'cuda'], given 'tpu'"),
    ("store.on_corrupt=ignore", "store.on_corrupt: expected one of ['raise', 'skip'], given 'ignore'"),
    ("store.image_clevel=12", "store.image_clevel: expected an integer 0..9 (Blosc's zstd levels), given 12"),
    ("store.image_codec=png", "store.image_codec: expected one of ['delta-zstd', 'zstd', 'h264'], given 'png'"),
    ("store.image_crf=52", "store.image_crf: expected an integer 0..51 (libx264's CRF), given 52"),
    ("fleet.episodes_per_unit=0", "fleet.episodes_per_unit: expected null or an integer >= 1, given 0"),
    ("train.lr=0", "train.lr: expected a number > 0, given 0"),
    ("store.url=/proc/fleetmind/store", "store.url: expected a creatable directory"),
    ("job.base_steps=0", "job.base_steps: expected an integer >= 1, given 0"),
    ("chaos.targets={worker: -1}", "chaos.targets: expected a mapping of worker / learner / server to odds >= 0"),
    ("+fleet.unitz=2", "fleet.unitz: unknown key (no component reads it"),
    ("fleet.policy_server=sometimes", "fleet.policy_server: expected true, false or 'auto', given 'sometimes'"),
    # numeric values that reach a model or a robot, and the rules between them
    ("policy.num_inference_steps=0", "policy.num_inference_steps: expected an integer >= 1, given 0"),
    ("policy.num_inference_steps=200", "policy.num_inference_steps: expected <= policy.num_train_timesteps (100)"),
    ("policy.n_action_steps=32", "policy.n_action_steps: expected <= policy.horizon (16), given 32"),
    ("policy.n_heads=5", "policy.dim: expected a multiple of policy.n_heads (5), given 96"),
    ("policy.aed.group_size=5", "policy.aed.history_actions: expected a multiple of policy.aed.group_size (5)"),
    ("deploy.safety.max_step_deg=0", "deploy.safety.max_step_deg: expected null or a finite number > 0, given 0"),
    ("deploy.safety.deadline_s=-1", "deploy.safety.deadline_s: expected null or a finite number > 0, given -1"),
    ("robot.variation.mass_scale=1.5", "robot.variation.mass_scale: expected a number >= 0 and <= 1, given 1.5"),
    ("task.max_episode_steps=0", "task.max_episode_steps: expected an integer >= 1, given 0"),
    ("policy.dropout=nan", "policy.dropout: expected a number >= 0 and <= 1, given nan"),
])
def test_each_bad_value_is_named(override, line):
    with pytest.raises(ConfigError) as e:
        check(cfg(override))
    assert line in str(e.value)


def test_typed_groups_are_the_one_source_of_their_defaults():
    """Every typed group (configs/typed.py) composes to its dataclass's defaults (no YAML holds them; the root
    config's presets, e.g. ``train.seed: ${seed}``, follow their source); a misspelt key or a wrong type is refused
    while composing, naming the key; every field carries a docstring."""
    import dataclasses
    import inspect

    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from configs.typed import TYPED_GROUPS

    c = cfg("seed=3")
    for group, cls in TYPED_GROUPS.items():
        assert not (REPO / "configs" / group / "default.yaml").exists(), group   # presets only, if any
        node = OmegaConf.to_container(c[group], resolve=True)
        expected = cls().to_dict()
        if group == "train":
            expected["seed"] = 3
        if group == "deploy":   # an interpolation default follows its source
            expected["export"]["registry_url"] = c.fleet.registry_url
        assert node == expected, group
        src = inspect.getsource(inspect.getmodule(cls))
        for sub in (cls, *getattr(cls, "_nested", {}).values()):
            body = src.split(f"class {sub.__name__}(", 1)[1]
            for f in dataclasses.fields(sub):
                after = body.split(f"\n    {f.name}: ", 1)[1].split("\n", 2)[1].lstrip()
                assert after.startswith('"""'), f"{group}: {sub.__name__}.{f.name} has no docstring"
        name = dataclasses.fields(cls)[0].name
        with pytest.raises(ConfigCompositionException, match=f"{name}x"):
            cfg(f"{group}.{name}x=1")
    with pytest.raises(ConfigCompositionException, match="train.steps"):
        cfg("train.steps=true")
    with pytest.raises(ConfigCompositionException, match="train.wandb.nmae"):
        cfg("train.wandb.nmae=x")


def test_composing_and_checking_the_config_imports_neither_sim_nor_mujoco():
    """Registering the typed groups, composing and checking the config load no ``sim``, MuJoCo or Meta-World:
    ``sim``'s import probes the GL backend, which in the LeRobot environments must come after LeRobot's imports
    (tests/with_lerobot/conftest.py; the other order segfaults there), and a refused config stays quick."""
    code = ("import sys, configs.typed\n"
            "from hydra import compose, initialize_config_dir\n"
            "from configs.schema import check\n"
            f"with initialize_config_dir(config_dir={str(REPO / 'configs')!r}, version_base=None):\n"
            "    c = compose('config', overrides=['task=mw10', 'robot=shifted', 'obs=vision'])\n"
            "check(c)\n"
            "print(sorted(m for m in ('sim', 'mujoco', 'metaworld') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_train_config_partial_and_nested_values():
    """A trainer's partial dict takes TrainConfig's defaults, a partial nested mapping the nested defaults; every
    bad value, nested ones included, is named at once; train_policy refuses an unknown key before any work."""
    from policies.aed_diffusion.training import train_policy
    from policies.train_config import TrainConfig

    t = TrainConfig.from_dict({"steps": 7, "wandb": {"name": "x"}})
    assert (t.steps, t.batch_size, t.num_threads, t.wandb.name, t.wandb.enabled, t.wandb.mode) == (
        7, 64, 1, "x", True, "offline")
    assert t.to_dict()["wandb"] == {"enabled": True, "project": "fleetmind", "mode": "offline", "name": "x"}
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"lr": 0, "wandb": {"mode": "loud"}, "episodes": {"success": "yes"}})
    assert "train.lr: expected a number > 0, given 0" in str(e.value)
    assert "train.wandb.mode: expected one of ['offline', 'online', 'disabled'], given 'loud'" in str(e.value)
    assert "train.episodes.success: expected null or true or false, given 'yes'" in str(e.value)
    with pytest.raises(ConfigError, match="unknown keys \\['stpes'\\]"):
        train_policy({"stpes": 3}, "/nonexistent/never-made")
    assert not Path("/nonexistent/never-made").exists()


def test_every_group_option_declares_what_it_sets_and_free_form_subtrees_stay_open():
    """Every option of every config group composes without an unknown key; script-specific subtrees (``+bench.*``,
    ``+store.storage_options``) are accepted, a misspelt key anywhere else is not."""
    from configs.schema import unknown_keys

    for group in sorted(p for p in (REPO / "configs").iterdir() if p.is_dir() and not p.name.startswith("_")):
        for option in sorted(group.glob("*.yaml")):
            assert [p for p in problems(cfg(f"{group.name}={option.stem}")) if "unknown key" in p] == [], option
    c = cfg("+bench.cluster=true", "+store.storage_options={endpoint_url: x}")
    assert problems(c) == []
    assert any("sim.check: unknown keys ['extra']" in p for p in problems(cfg("+sim.check.extra=2")))
    assert unknown_keys({"task": {"tasks": [], "sute": "x"}, "job": {}, "fleet": {}}) == ["task.sute"]


def test_all_problems_at_once_and_interpolations_follow_their_source(tmp_path):
    bad = problems(cfg("fleet.units=0", "eval.processes=0", f"store.url={tmp_path}/ok"))
    assert sorted(bad) == ["eval.processes: expected an integer >= 1, given 0", "fleet.units: expected an integer >= 1, given 0"]
    assert "fleet_units" not in cfg().job and "trials_per_task" not in cfg().job   # one quantity, one name
    (tmp_path / "file").write_text("x")
    assert problems(cfg(f"store.url={tmp_path}/file")) == [
        f"store.url: expected a directory (a file is in the way), given '{tmp_path}/file'"]


@pytest.mark.parametrize("script,args", [("scripts/run.py", ["fleet.units=0"]),
                                         ("scripts/run.py", ["+job.fleet_unitz=2"]),
                                         ("scripts/train.py", ["train.batch_size=-1"]),
                                         ("scripts/rollout.py", ["fleet.units=0"])])
def test_scripts_refuse_a_bad_value_before_any_work(script, args, tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, script, *args, f"hydra.run.dir={tmp_path}/out", f"store.url={tmp_path}/s"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"})
    assert p.returncode == 1 and "invalid config (nothing was run)" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 4
    assert not (tmp_path / "s").exists() and time.monotonic() - t0 < 120


def test_the_fleetmind_command_runs_the_scripts_and_refuses_unknown_commands(tmp_path):
    """``fleetmind <command>`` (fleet/cli.py, the console script) is the script itself: the same config check,
    the same one-line error; an unknown command lists the known ones."""
    env = {**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-m", "fleet.cli", "train", "train.batch_size=-1",
                        f"hydra.run.dir={tmp_path}/out"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       check=False, env=env)
    assert p.returncode == 1 and "train.batch_size: expected an integer >= 1, given -1" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "fleet.cli", "trian"], capture_output=True, text=True, timeout=60,
                       check=False, env=env)
    assert p.returncode == 2 and "unknown command 'trian'" in p.stderr and "train " in p.stderr


def test_collect_demos_runs_on_the_demonstration_units_of_a_range_config(tmp_path):
    """``scripts/collect_demos.py`` with the default robot config (``train_units: "0:16"``, a range string) runs the
    scripted expert on ``robot.demo_units`` (0-3), round-robin, into a real store; ``store.demos.units`` wins."""
    from experience_dict.store import ExperienceStore

    env = {**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled", "MUJOCO_GL": "egl"}
    for extra, want in (([], {0, 1, 2, 3}), (["store.demos.units=[7]"], {7})):
        url = tmp_path / f"s{len(extra)}"
        p = subprocess.run([sys.executable, "scripts/collect_demos.py", "task.tasks=[reach-v3]",
                            "store.demos.per_task=5", f"store.url={url}", f"hydra.run.dir={tmp_path}/out", *extra],
                           cwd=REPO, capture_output=True, text=True, timeout=300, check=False, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        eps = ExperienceStore.open(str(url)).episodes(is_demo=True)
        assert len(eps) == 5 and {int(m.unit_id) for m in eps} == want


def test_every_arm_and_fert_part_reads_the_typed_fert_group():
    """Every arm's ``fert`` overrides (fleet/experiment/arms.py) make a valid FertConfig; the retries and the critic take a
    left-out key from their dataclass and refuse an unknown one, naming it."""
    from fleet.experiment.arms import ARMS, fert_config
    from fleet.experiment.protocol import retry_plan
    from fleet.fert.config import FertConfig

    base = {"fert": FertConfig().to_dict()}
    for arm in ARMS.values():
        fc = FertConfig.from_dict(fert_config(base, arm)["fert"])
        for k, v in arm.fert.items():
            got = getattr(fc, k)
            assert (got.to_dict().items() >= v.items()) if isinstance(v, dict) else got == v, (arm.name, k)
    fails = [{"task": "reach-v3", "unit_id": 1, "seed": 5, "episode_id": "e", "success": False}]
    plan = retry_plan(fails, {"attempts": 2}, 1, heldout=[100], budget=10)
    assert plan[0]["explore"]["action_noise_std"] == pytest.approx(0.2 * 1.3) and plan[0]["explore"]["hold_steps"] == 8
    with pytest.raises(ConfigError, match="fert.retry: unknown keys \\['atempts'\\]"):
        retry_plan(fails, {"atempts": 2}, 0, heldout=[100], budget=10)


def test_one_default_for_steps_after_success():
    """The env, FERT's algorithm (its gate's tail, the critic's success step) and a deploy run all fall back to
    ``TaskConfig``'s ``steps_after_success`` when none is given (issue 50: FERT used 0 where the envs used 10)."""
    from types import SimpleNamespace

    from configs.sim_groups import TaskConfig
    from fleet.deploy.config import DeployConfig
    from fleet.fert.algorithm import FertAlgorithm
    from sim import make_env

    want = TaskConfig().steps_after_success
    assert want == 10
    assert FertAlgorithm.steps_after_success.fget(SimpleNamespace(cfg={})) == want
    assert FertAlgorithm.steps_after_success.fget(SimpleNamespace(cfg={"task": {"steps_after_success": 3}})) == 3
    assert DeployConfig().run.steps_after_success == want
    assert make_env("reach-v3", 0, task_cfg={"max_episode_steps": 20}).steps_after_success == want
