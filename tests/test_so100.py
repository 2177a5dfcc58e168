"""SO-100 simulated twin: env checker, determinism, experts on their tasks, contract with Meta-World envs and
the store, robot units, bad task names."""

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import sim
from sim.so100 import TASKS

ROBOT = {"embodiment": "sawyer", "fleet_seed": 0, "train_units": [0, 1, 2, 4], "heldout_units": [7],
         "variation": {"camera_pos_mm": 10.0, "camera_rot_deg": 2.0, "light": 0.2, "color": 0.15, "mass_scale": 0.2,
                       "friction_scale": 0.2, "action_gain": 0.1, "action_latency_max": 2, "obs_noise_std": 0.001}}


def _rollout(env, actions, seed):
    obs, _ = env.reset(seed=seed)
    out = [obs["observation.state"].copy(), obs["observation.environment_state"].copy()]
    for a in actions:
        obs, r, term, trunc, _info = env.step(a)
        out += [obs["observation.state"].copy(), obs["observation.environment_state"].copy(), np.array([r])]
        if term or trunc:
            break
    return np.concatenate(out)


def test_env_checker_and_contract():
    env = sim.make_env("so100-push-cube", unit_id=1, robot_cfg=ROBOT)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert set(obs) == {"observation.state", "observation.environment_state"}
    assert obs["observation.state"].shape == (4,) and obs["observation.environment_state"].shape == (17,)
    assert set(info) == {"success", "episode_success", "progress"}
    assert tuple(info["progress"]) == sim.PROGRESS_KEYS
    assert env.unit.embodiment == "so100" and env.spec_dict()["control_hz"] == pytest.approx(30.0)
    mw_spec = {k: v for k, v in sim.make_env("push-v3").spec_dict().items() if k != "control_hz"}
    spec = env.spec_dict()
    assert {k: v["shape"] for k, v in spec.items() if k != "control_hz"} == {k: v["shape"] for k, v in mw_spec.items()}
    assert spec["action"]["names"] == mw_spec["action"]["names"]
    with pytest.raises(ValueError, match="unknown unit id 5"):
        sim.make_env("so100-reach", unit_id=5, robot_cfg=ROBOT)
    with pytest.raises(ValueError, match=r"action: expected shape \(4,\)"):
        env.step(np.zeros(3))


def test_bad_task_name_lists_choices():
    with pytest.raises(ValueError) as e:
        sim.make_env("so100-stack")
    assert all(t in str(e.value) for t in TASKS) and "push-v3" in str(e.value)
    assert sim.list_tasks({"name": "mix", "tasks": ["so100-reach", "push-v3"]}) == ["so100-reach", "push-v3"]


def test_deterministic_given_task_unit_seed_and_actions():
    actions = np.random.default_rng(0).uniform(-1, 1, (25, 4)).astype(np.float32)
    a = _rollout(sim.make_env("so100-pick-place", 2, ROBOT), actions, seed=3)
    b = _rollout(sim.make_env("so100-pick-place", 2, ROBOT), actions, seed=3)
    np.testing.assert_array_equal(a, b)
    c = _rollout(sim.make_env("so100-pick-place", 2, ROBOT), actions, seed=4)
    assert a.shape != c.shape or not np.array_equal(a, c)


def test_actions_move_the_end_effector_in_metres():
    env = sim.make_env("so100-reach")
    _obs, _ = env.reset(seed=0)
    x0 = env.tcp
    for _ in range(10):
        env.step(np.array([1.0, 0.0, 0.0, -1.0], dtype=np.float32))
    for _ in range(10):
        env.step(np.array([0.0, 0.0, 0.0, -1.0], dtype=np.float32))
    dx = env.tcp - x0
    assert 0.07 < dx[0] < 0.11 and abs(dx[1]) < 0.01 and abs(dx[2]) < 0.01   # 10 steps x 1 cm


def test_units_vary_the_robot():
    u0, u1 = sim.make_env("so100-reach", 0, ROBOT), sim.make_env("so100-reach", 1, ROBOT)
    assert u0.unit.to_dict() != u1.unit.to_dict()
    cube = u0.model.body("cube").id
    assert u0.model.body_mass[cube] != u1.model.body_mass[cube]
    assert not np.allclose(u0.action_scale, 0.01) and u0.unit.embodiment == u1.unit.embodiment == "so100"


@pytest.mark.parametrize("task", list(TASKS))
def test_experts_succeed(task):
    """10 episodes over three varied units (action gain, noise, mass, friction; unit 2 has one step of latency):
    >= 90%."""
    envs = dict(enumerate(sim.make_env(task, unit_id=u, robot_cfg=ROBOT) for u in (0, 1, 2)))
    assert envs[2].latency_steps == 1
    wins = 0
    for seed in range(10):
        env = envs[seed % 3]
        expert = sim.make_expert(env, seed=seed)
        obs, info = env.reset(seed=seed)
        for _ in range(env.max_episode_steps):
            obs, _r, term, trunc, info = env.step(expert.act(obs))
            if term or trunc:
                break
        wins += bool(info["episode_success"])
    assert wins >= 9, f"{task}: expert solved {wins}/10"


def test_so100_episode_commits_to_the_store(tmp_path):
    from experience_dict.store import ExperienceStore

    env = sim.make_env("so100-reach", 0, ROBOT, {"images": True, "cameras": ["corner"], "image_size": 32})
    store = ExperienceStore.create_or_open(str(tmp_path / "s"), spec=env.spec_dict(), control_hz=env.spec_dict()["control_hz"])
    w = store.writer("unit-0000")
    obs, info = env.reset(seed=0)
    w.begin_episode(unit_id=0, embodiment=env.unit.embodiment, task=env.task, policy_version=-1, seed=0, is_demo=True)
    expert = sim.make_expert(env)
    for _ in range(40):
        a = expert.act(obs)
        nobs, r, term, trunc, info = env.step(a)
        w.add_step(obs, a, r, info["progress"])
        obs = nobs
        if term or trunc:
            break
    ep = w.commit(success=info["episode_success"])
    reader = ExperienceStore.open(str(tmp_path / "s"))
    meta = reader.episode(ep)
    assert meta.embodiment == "so100" and meta.success
    data = reader.load_episode(ep)
    assert data["observation.images.corner"].shape[1:] == (32, 32, 3) and data["observation.images.corner"].std() > 1


def test_a_mixed_fleet_tells_its_robots_apart():
    """``obs.embodiment_feature``: both robots observe ``observation.embodiment`` (their one-hot, in the spec and the
    observation space, which the env checker holds them to); each robot runs its own episode length
    (``task.max_episode_steps_by_embodiment``) and reports its own control rate; their specs differ in the rate only,
    so one store takes both; an unknown embodiment is refused."""
    from sim.units import EMBODIMENTS, embodiment_onehot

    obs_cfg = {"embodiment_feature": True}
    task_cfg = {"max_episode_steps": 7, "max_episode_steps_by_embodiment": {"sawyer": 4}}
    specs, lengths = {}, {}
    for task, emb, hz in (("reach-v3", "sawyer", 80.0), ("so100-reach", "so100", 30.0)):
        env = sim.make_env(task, unit_id=1, robot_cfg=ROBOT, obs_cfg=obs_cfg, task_cfg=task_cfg)
        check_env(env, skip_render_check=True)
        obs, _ = env.reset(seed=0)
        np.testing.assert_array_equal(obs["observation.embodiment"], embodiment_onehot(emb))
        assert obs["observation.embodiment"][EMBODIMENTS.index(emb)] == 1.0 and env.control_hz == hz
        specs[emb] = env.spec_dict()
        assert specs[emb]["observation.embodiment"]["names"] == list(EMBODIMENTS)
        for t in range(1, 10):
            _, _, term, trunc, _ = env.step(np.zeros(4, np.float32))
            if term or trunc:
                lengths[emb] = t
                break
        env.close()
    assert lengths == {"sawyer": 4, "so100": 7}
    strip = lambda s: {k: (v["shape"], v["dtype"]) for k, v in s.items() if isinstance(v, dict)}
    assert strip(specs["sawyer"]) == strip(specs["so100"]) and specs["sawyer"]["control_hz"] != specs["so100"]["control_hz"]
    with pytest.raises(ValueError, match="unknown embodiment 'ur5'; known: sawyer, so100"):
        embodiment_onehot("ur5")


def test_the_twins_corner_camera_sees_the_arm_and_the_objects_upright():
    """The twin's ``corner`` camera (segmentation render of the same camera): the cube, the goal and the arm's
    moving links are in the frame for every task's placements, the arm not cut by the image border, and the
    observation image is upright (the twin's cameras are not rolled like Meta-World's corner cameras)."""
    import mujoco

    for task in TASKS:
        env = sim.make_env(task, unit_id=0, obs_cfg={"images": True, "cameras": ["corner"], "image_size": 64})
        m = env.model
        r = mujoco.Renderer(m, 64, 64)
        r.enable_segmentation_rendering()
        arm = {i for i in range(m.ngeom) if m.body(m.geom_bodyid[i]).name.startswith("so_arm100_right/")
               and m.body(m.geom_bodyid[i]).name != "so_arm100_right/Base"}
        for seed in range(3):
            env.reset(seed=seed)
            r.update_scene(env.data, camera="corner")
            seg = r.render()
            ids, types = seg[..., 0], seg[..., 1]
            geoms = ids * (types == int(mujoco.mjtObj.mjOBJ_GEOM)) - (types != int(mujoco.mjtObj.mjOBJ_GEOM))
            sites = set(ids[types == int(mujoco.mjtObj.mjOBJ_SITE)].tolist())
            assert m.geom("cube").id in set(geoms.ravel().tolist()), (task, seed)
            assert m.site("goal").id in sites or task == "so100-push-cube", (task, seed)   # push: goal on the table
            on_arm = np.isin(geoms, list(arm))
            assert on_arm.sum() > 40, (task, seed)
            assert not on_arm[0].any() and not on_arm[:, 0].any() and not on_arm[:, -1].any(), (task, seed)
            # upright: the table (near the camera) fills the bottom rows, the arm is above them
            assert np.argwhere(on_arm)[:, 0].mean() < 40
        r.close()
        env.close()
