"""sim/: Meta-World envs, robot units, rendering, scripted experts (real MuJoCo, small)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

import sim
from sim.units import ModelVariation, RobotUnit, parse_units

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def group(name: str, option: str):
    """The composed ``name`` group with ``option`` selected (its typed defaults, then the preset)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose("config", overrides=[f"{name}={option}"])[name]


ROBOT = group("robot", "default")
NOMINAL = group("robot", "nominal")
QUICK = group("task", "mw_quick")
STATE = group("obs", "state")
VISION = group("obs", "vision")


def rollout(env, seed: int, steps: int, action_seed: int = 0) -> list:
    """Observations, rewards, infos of ``steps`` random actions (fixed action seed) after ``reset(seed)``."""
    rng = np.random.default_rng(action_seed)
    obs, info = env.reset(seed=seed)
    out = [obs, info]
    for _ in range(steps):
        obs, reward, terminated, truncated, info = env.step(rng.uniform(-1, 1, 4).astype(np.float32))
        out += [obs, reward, info]
        if terminated or truncated:
            break
    return out


def same(a, b) -> bool:
    """Bit-for-bit equality of nested dicts/lists of arrays and scalars."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


@pytest.mark.parametrize("task", ["reach-v3", "drawer-close-v3", "assembly-v3"])
def test_gymnasium_env_checker(task):
    from gymnasium.utils.env_checker import check_env

    env = sim.make_env(task, 1, ROBOT, STATE, QUICK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # infinite Box bounds of object state are intended
        check_env(env, skip_render_check=True)
    env.close()


def test_observation_action_contract():
    env = sim.make_env("push-v3", 2, ROBOT, STATE, QUICK)
    obs, info = env.reset(seed=3)
    assert set(obs) == {"observation.state", "observation.environment_state"}
    assert obs["observation.state"].shape == (4,) and obs["observation.state"].dtype == np.float32
    assert obs["observation.environment_state"].shape == (17,)
    # the goal is visible (Meta-World MT setting): last 3 entries equal the env's target position
    np.testing.assert_allclose(obs["observation.environment_state"][14:], env.raw_observation[36:39], atol=0.01)
    assert np.any(env.raw_observation[36:39] != 0)
    obs, reward, _, _, info = env.step(np.zeros(4, np.float32))
    assert isinstance(reward, float) and isinstance(info["success"], bool)
    assert tuple(info["progress"]) == sim.PROGRESS_KEYS
    assert all(isinstance(v, float) for v in info["progress"].values())
    spec = env.spec_dict()
    json.dumps(spec)
    json.dumps(env.unit.to_dict())
    assert spec["control_hz"] == 80.0 and spec["action"]["names"] == ["dx", "dy", "dz", "gripper"]
    assert spec["observation.environment_state"]["shape"] == [17]
    assert RobotUnit.from_dict(json.loads(json.dumps(env.unit.to_dict()))) == env.unit
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros(3, np.float32))
    env.close()


def test_progress_keys_same_for_all_tasks():
    for task in ["reach-v3", "pick-place-v3", "door-open-v3", "stick-pull-v3"]:
        env = sim.make_env(task, 0, NOMINAL, STATE, QUICK)
        _, info = env.reset(seed=0)
        assert tuple(info["progress"]) == sim.PROGRESS_KEYS
        _, _, _, _, info = env.step(env.action_space.sample())
        assert tuple(info["progress"]) == sim.PROGRESS_KEYS
        env.close()


def test_determinism_bit_for_bit():
    """Same (task, unit, seed) + same actions => identical trajectory, even after other episodes ran."""
    a = sim.make_env("push-v3", 3, ROBOT, STATE, QUICK)
    b = sim.make_env("push-v3", 3, ROBOT, STATE, QUICK)
    rollout(a, seed=99, steps=40, action_seed=7)  # dirty env a with another episode first
    ta, tb = rollout(a, seed=5, steps=60), rollout(b, seed=5, steps=60)
    assert same(ta, tb)
    assert not same(ta, rollout(b, seed=6, steps=60))  # another seed: another episode
    other_unit = sim.make_env("push-v3", 1, ROBOT, STATE, QUICK)
    assert not same(ta, rollout(other_unit, seed=5, steps=60))


def test_unit_variation_differs_between_units_and_repeats_per_unit():
    u1, u1_again, u2 = RobotUnit.draw(1, ROBOT), RobotUnit.draw(1, ROBOT), RobotUnit.draw(2, ROBOT)
    assert u1 == u1_again and u1 != u2
    assert RobotUnit.draw(1, NOMINAL) == RobotUnit(unit_id=1)  # zero ranges give the nominal robot
    # applied to models: two builds of one unit give identical models, another unit differs
    e1, e1b, e2 = (sim.make_env("push-v3", u, ROBOT, STATE, QUICK) for u in (1, 1, 2))
    fields = ("cam_pos", "cam_quat", "light_diffuse", "geom_rgba", "body_mass", "geom_friction")
    for f in fields:
        assert np.array_equal(getattr(e1.mj_model, f), getattr(e1b.mj_model, f)), f
        assert not np.array_equal(getattr(e1.mj_model, f), getattr(e2.mj_model, f)), f
    assert not np.array_equal(e1.action_scale, e2.action_scale)
    # re-applying (every reset) never compounds
    before = e1.mj_model.body_mass.copy(), e1.mj_model.cam_quat.copy()
    for s in range(3):
        e1.reset(seed=s)
    assert np.array_equal(before[0], e1.mj_model.body_mass) and np.array_equal(before[1], e1.mj_model.cam_quat)


def test_units_are_stratified_so_training_and_heldout_blocks_cover_the_same_ranges():
    """Every aligned block of ``stratify_block`` ids takes one value per stratum of each physical range."""
    block, r = int(ROBOT.stratify_block), ROBOT.variation
    assert block == 4
    for units in ([0, 1, 2, 3], [100, 101, 102, 103], [4, 5, 6, 7]):
        draws = [RobotUnit.draw(u, ROBOT) for u in units]
        for name, values, half in (("friction", [d.friction_scale - 1 for d in draws], r.friction_scale),
                                   ("mass", [d.mass_scale - 1 for d in draws], r.mass_scale),
                                   ("gain z", [d.action_gain[2] - 1 for d in draws], r.action_gain),
                                   ("obs noise", [2 * d.obs_noise_std / r.obs_noise_std - 1 for d in draws], 1.0)):
            strata = sorted(int((v / half + 1) / 2 * block) for v in values)
            assert strata == list(range(block)), (units, name, values)
    # two blocks are different draws; the same id draws the same unit; 0 turns stratification off
    assert RobotUnit.draw(0, ROBOT).friction_scale != RobotUnit.draw(100, ROBOT).friction_scale
    assert RobotUnit.draw(5, ROBOT) == RobotUnit.draw(5, ROBOT)
    iid = OmegaConf.merge(ROBOT, {"stratify_block": 0})
    assert [round(RobotUnit.draw(u, iid).friction_scale, 2) for u in range(4)] == [1.11, 1.19, 1.10, 1.13]
    with pytest.raises(ValueError, match="stratify_block"):
        RobotUnit.draw(0, OmegaConf.merge(ROBOT, {"stratify_block": -1}))


def test_model_variation_targets_table_and_objects_only():
    env = sim.make_env("push-v3", 0, None, STATE, QUICK)
    m = env.mj_model
    var = ModelVariation(m)
    nominal_mass = m.body_mass.copy()
    unit = RobotUnit(unit_id=0, mass_scale=1.5, table_rgb_delta=(0.1, 0.1, 0.1))
    var.apply(unit, env.mj_data)
    obj = m.body("obj").id
    assert m.body_mass[obj] == pytest.approx(1.5 * nominal_mass[obj])
    assert m.body_mass[m.body("right_l0").id] == nominal_mass[m.body("right_l0").id]  # the robot is untouched
    assert len(var.table_geoms) > 0 and all(m.geom_bodyid[g] == m.body("tablelink").id for g in var.table_geoms)


def test_train_and_heldout_units_disjoint():
    train, heldout = sim.unit_lists(ROBOT)
    assert train and heldout and not set(train) & set(heldout)
    bad = OmegaConf.merge(ROBOT, {"heldout_units": [3, 200]})
    with pytest.raises(ValueError, match=r"\[3\]"):
        sim.unit_lists(bad)
    assert parse_units("0:4") == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        parse_units([1, 1])


def test_images_shape_dtype_and_upright():
    obs_cfg = OmegaConf.merge(VISION, {"cameras": ["corner", "topview"], "image_size": 48})
    env = sim.make_env("reach-v3", 0, ROBOT, obs_cfg, QUICK)
    obs, _ = env.reset(seed=0)
    for cam in ("corner", "topview"):
        img = obs[f"observation.images.{cam}"]
        assert img.shape == (48, 48, 3) and img.dtype == np.uint8 and img.std() > 5
        assert env.observation_space[f"observation.images.{cam}"].contains(img)
    # corner is rotated 180 deg back: upright, the plain grey backdrop fills the top rows and the table and robot
    # the bottom ones (the raw render has them the other way round)
    img = obs["observation.images.corner"].astype(float)
    raw = env._renderer._r
    raw.update_scene(env.mj_data, camera="corner")
    unrotated = raw.render().astype(float)
    assert np.array_equal(np.flip(unrotated, (0, 1)), img)
    assert img[:8].std() < img[-8:].std() and unrotated[-8:].std() < unrotated[:8].std()
    env.close()


def test_episode_termination_after_success():
    env = sim.make_env("reach-v3", 0, NOMINAL, STATE, {"max_episode_steps": 150, "steps_after_success": 3})
    expert = sim.make_expert(env)
    obs, _ = env.reset(seed=1)
    first, t = None, 0
    while True:
        obs, _, terminated, truncated, info = env.step(expert.act(obs))
        t += 1
        if info["success"] and first is None:
            first = t
        if terminated or truncated:
            break
    assert terminated and not truncated and t == first + 3 and info["episode_success"]
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(4, np.float32))
    short = sim.make_env("push-v3", 0, NOMINAL, STATE, {"max_episode_steps": 5})
    short.reset(seed=0)
    flags = [short.step(np.zeros(4, np.float32))[3] for _ in range(5)]
    assert flags == [False] * 4 + [True]


@pytest.mark.slow
def test_experts_solve_quick_tasks_on_units():
    """Scripted experts >= 90% success on each mw_quick task over train and held-out units (incl. latency 2)."""
    units = [0, 1, 100, 101]
    assert {RobotUnit.draw(u, ROBOT).action_latency for u in units} >= {0, 2}  # harder units are in the sample
    for task in sim.list_tasks(QUICK):
        wins = n = 0
        for u in units:
            env = sim.make_env(task, u, ROBOT, STATE, QUICK)
            expert = sim.make_expert(env, noise_std=0.0, seed=u)
            for seed in range(3):
                obs, info = env.reset(seed=seed)
                done = False
                while not done:
                    obs, _, terminated, truncated, info = env.step(expert.act(obs))
                    done = terminated or truncated
                wins, n = wins + info["episode_success"], n + 1
            env.close()
        assert wins / n >= 0.9, f"{task}: expert success {wins}/{n}"


def test_expert_noise_is_seeded():
    env = sim.make_env("push-v3", 0, NOMINAL, STATE, QUICK)
    env.reset(seed=0)
    a = [sim.make_expert(env, noise_std=0.3, seed=4).act() for _ in range(2)]
    b = sim.make_expert(env, noise_std=0.3, seed=4).act()
    c = sim.make_expert(env, noise_std=0.0).act()
    assert np.array_equal(a[0], a[1]) and np.array_equal(a[0], b) and not np.array_equal(a[0], c)
    assert a[0].dtype == np.float32 and a[0].shape == (4,) and np.all(np.abs(a[0]) <= 1)


def test_bad_names_list_valid_choices():
    with pytest.raises(ValueError, match="push-v3"):
        sim.make_env("push-v9", 0, ROBOT, STATE, QUICK)
    with pytest.raises(ValueError, match="corner2"):
        sim.make_env("push-v3", 0, ROBOT, OmegaConf.merge(VISION, {"cameras": ["cornr"]}), QUICK)
    with pytest.raises(ValueError, match=r"train_units \[0, 1, 2, .*15\].*heldout_units \[100, 101, 102, 103\]"):
        sim.make_env("push-v3", 50, ROBOT, STATE, QUICK)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        sim.list_tasks({"name": "x", "tasks": ["reach-v3", "nope"]})


def test_suites():
    assert len(sim.list_tasks()) == 50
    mw50 = group("task", "mw50")
    assert sorted(sim.list_tasks(mw50)) == sorted(sim.list_tasks())
    mw10 = group("task", "mw10")
    assert len(set(sim.list_tasks(mw10))) == 10 and len(sim.list_tasks(QUICK)) == 3


def test_action_latency_queues_actions():
    cfg = OmegaConf.merge(NOMINAL, {"variation": {"action_latency_max": 2}, "train_units": "0:40"})
    unit = next(u for u in range(40) if RobotUnit.draw(u, cfg).action_latency == 2)
    env = sim.make_env("reach-v3", unit, cfg, STATE, QUICK)
    obs0, _ = env.reset(seed=0)
    push = np.array([1.0, 0.0, 0.0, -1.0], np.float32)
    xs = [env.step(push)[0]["observation.state"][0] for _ in range(8)]
    assert len(env.pending_actions) == 2 and np.array_equal(env.pending_actions[-1], push)
    assert abs(xs[1] - obs0["observation.state"][0]) < 1e-3  # steps 1-2 execute the hold action
    assert xs[7] - obs0["observation.state"][0] > 0.01  # then the pushes arrive: the hand moves +x
    expert = sim.make_expert(env, latency_compensation=True)
    predicted = expert._predicted_observation()
    np.testing.assert_allclose(predicted[:3] - env.raw_observation[:3], 2 * push[:3] * env.action_scale)


def test_no_gl_backend_error_names_what_to_install():
    """Without a GL backend, state-only envs work and an image env fails naming the packages to install."""
    import subprocess
    import sys

    code = ("import sim\n"
            "sim.make_env('reach-v3').reset(seed=0)\n"
            "try:\n"
            "    sim.make_env('reach-v3', obs_cfg={'images': True})\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    env = {**__import__("os").environ, "MUJOCO_GL": "disable"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert "libegl1" in out.stdout and "libosmesa6" in out.stdout and "MUJOCO_GL=osmesa" in out.stdout


def test_a_registered_suite_is_taken_wherever_a_task_name_is():
    """``sim.register_suite``: a new suite's tasks are made by its own factory (no if-chain to edit); task names
    stay unique across suites; unknown names list every suite's tasks."""
    import sim

    made = []

    def make(task, unit_id, robot_cfg, obs_cfg, task_cfg, render_mode):
        made.append(task)
        return sim.make_env("reach-v3", unit_id, robot_cfg, obs_cfg, task_cfg, render_mode)

    sim.register_suite("toy", "sawyer", lambda: ["toy-reach"], make, lambda env, **kw: sim.make_expert(env, **kw))
    try:
        assert sim.list_tasks({"tasks": ["toy-reach", "push-v3"]}) == ["toy-reach", "push-v3"]
        assert sim.suite_of("toy-reach").name == "toy" and sim.suite_of("so100-reach").embodiment == "so100"
        env = sim.make_env("toy-reach", unit_id=0)
        obs, _ = env.reset(seed=1)
        env.step(sim.make_expert(env).act(obs))
        assert made == ["toy-reach"]
        with pytest.raises(ValueError, match="already belong to suite 'toy'"):
            sim.register_suite("toy2", "sawyer", lambda: ["toy-reach"], make, make)
        with pytest.raises(ValueError, match="already registered"):
            sim.register_suite("toy", "sawyer", lambda: ["other"], make, make)
    finally:
        sim._SUITES.pop("toy", None)
    with pytest.raises(ValueError, match="unknown task 'toy-reach'; valid tasks: metaworld: .*so100: so100-"):
        sim.check_task("toy-reach")
