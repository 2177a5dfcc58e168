"""Deployment through LeRobot's Robot API on the SO-100 twin (robot type fleetmind_so100_sim): the same loop as on
a real arm (fleet/deploy/deployer.py), a real exported policy, real safety limits, a real experience store.

LeRobot 0.6.1 is installed by ``make install``; ``make test`` runs these.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.lerobot
pytest.importorskip("lerobot.robots")

import torch
from lerobot.robots import make_robot_from_config

from fleet.deploy.deployer import (
    Deployer,
    RunConfig,
    build_robot_config,
    describe_limits,
    export_path,
    safety_limits,
)
from fleet.deploy.lerobot_bridge import JointMap
from fleet.deploy.so100_sim_robot import FleetmindSO100Sim, FleetmindSO100SimConfig

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
TINY = {"input_shapes": {"observation.state": [4], "observation.environment_state": [17],
                         "observation.images.corner": [32, 32, 3]},
        "dim": 32, "n_layers": 2, "n_heads": 2, "state_hidden": 32, "horizon": 8, "n_action_steps": 4,
        "num_inference_steps": 4, "image_channels": [8, 16],
        "aed": {"history_actions": 8, "group_size": 4, "memory_queries": 2, "tokenizer_vocab_size": 256},
        "mt_loss": {"weight": 0.01}}
WORKSPACE = [[-0.05, 0.39, 0.005], [0.29, 0.81, 0.28]]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A tiny real AED diffusion policy (random weights) exported by policies.export at 30 Hz."""
    from policies.export import export_checkpoint
    from tests.test_runtime import tiny_policy

    root = tmp_path_factory.mktemp("deploy_export")
    policy = tiny_policy({"observation.state": {"min": [-0.1, 0.4, 0.0, 0.0], "max": [0.3, 0.8, 0.3, 1.0]},
                          "observation.environment_state": {"min": [-1.0] * 17, "max": [1.0] * 17},
                          "action": {"min": [-1.0] * 4, "max": [1.0] * 4}},
                         **TINY, action_patch=4, condition_layers=0)   # the config's own denoiser defaults
    policy.save_pretrained(root / "ckpt")
    return export_checkpoint(root / "ckpt", root / "export", control_hz=30.0)


def _robot(tmp_path, **kw) -> FleetmindSO100Sim:
    cfg = FleetmindSO100SimConfig(calibration_dir=tmp_path / "calib", **{"render_cameras": ["corner"],
                                                                          "image_size": 32, **kw})
    robot = make_robot_from_config(cfg)  # LeRobot's own factory resolves the registered type
    assert type(robot) is FleetmindSO100Sim
    return robot


def _runtime(export):
    from policies.runtime import PolicyRuntime

    return PolicyRuntime.load(export)


class Injected:
    """The exported runtime with faults injected at given control steps of every episode: ``{step: "nan" | "slow"
    | action array}`` ("slow" sleeps ``slow_s`` before answering)."""

    def __init__(self, runtime, faults: dict, slow_s: float = 0.6):
        self.rt, self.faults, self.slow_s = runtime, faults, slow_s
        self.input_shapes, self.control_hz, self.meta = runtime.input_shapes, runtime.control_hz, runtime.meta
        self.step, self.returned_at = -1, {}

    def reset(self):
        self.rt.reset()
        self.step = -1

    def select_action(self, obs):
        self.step += 1
        a = self.rt.select_action(obs)
        fault = self.faults.get(self.step)
        if isinstance(fault, str) and fault == "slow":
            time.sleep(self.slow_s)
        elif isinstance(fault, str) and fault == "nan":
            a = a.copy()
            a[1] = np.nan
        elif fault is not None:
            a = np.asarray(fault, dtype=np.float32)
        self.returned_at[self.step] = time.perf_counter()
        return a


def _spy_sends(robot):
    """Record every action the robot receives (with its time) while still sending it."""
    sent, real = [], robot.send_action

    def send(action):
        sent.append((time.perf_counter(), dict(action)))
        return real(action)

    robot.send_action = send
    return sent


def test_deploy_sends_paced_actions_within_limits_and_commits(export_dir, tmp_path):
    from experience_dict.store import ExperienceStore

    robot = _robot(tmp_path)
    sends = _spy_sends(robot)
    run = RunConfig(max_steps=45, label="sim", stop_on_success=False, realtime=True, store_url=str(tmp_path / "s"),
                    seed=3)
    limits = safety_limits({"max_step_deg": 15, "max_step_gripper": 50, "workspace_m": WORKSPACE,
                            "deadline_s": 5.0}, JointMap())
    dep = Deployer(_runtime(export_dir), robot, run, limits, export_dir=str(export_dir))
    robot.connect()
    start_q = robot.joint_positions()
    t0 = time.perf_counter()
    [res] = dep.run_all()
    wall = time.perf_counter() - t0
    end_q = robot.joint_positions()
    robot.disconnect()
    assert res.steps == 45 and len(sends) == 45 and res.stop_reason == "max_steps"
    assert wall >= 44 / 30.0                                        # paced at the export's 30 Hz
    assert np.abs(end_q - start_q)[:5].max() > 2.0                  # the arm moved (degrees)
    sent, cur = np.array(res.sent), np.array(res.current)
    assert np.all(np.abs(sent - cur) <= np.array([15] * 5 + [50]) + 1e-9)
    lim = limits.joint_limits
    assert np.all((sent >= lim[:, 0] - 1e-9) & (sent <= lim[:, 1] + 1e-9))
    np.testing.assert_allclose([list(a.values()) for _, a in sends], sent)   # what the robot got = the filter's
    # the episode is in the store, labelled by the twin, with the policy's own observations and actions
    store = ExperienceStore.open(str(tmp_path / "s"))
    [meta] = store.episodes()
    ep = meta.episode_id
    assert ep == res.episode_id and meta.embodiment == "so100" and meta.task == "so100-reach"
    assert meta.length == 45 and meta.policy_version == -1 and meta.unit_id == 1000 and not meta.is_demo
    assert meta.success is False and meta.extra["deploy"]["robot_type"] == "fleetmind_so100_sim"
    data = store.load_episode(ep)
    assert data["observation.images.corner"].shape == (45, 32, 32, 3) and data["observation.images.corner"].std() > 1
    assert np.isfinite(data["action"]).all() and np.isfinite(data["progress.obj_to_target"]).all()
    np.testing.assert_allclose(data["observation.state"][0, :3], dep.bridge.fk(cur[0]), atol=1e-6)
    report = dep.report([res])
    assert report["committed"] == [ep] and len(report["episodes"][0]["policy_s"]) == 45
    json.dumps(report)


def test_nan_out_of_limit_and_missed_deadline_hold_the_arm(export_dir, tmp_path):
    rt = _runtime(export_dir)
    robot = _robot(tmp_path, render_cameras=["corner"])
    sends = _spy_sends(robot)
    store = str(tmp_path / "s")
    limits = safety_limits({"max_step_deg": 15, "max_step_gripper": 50, "workspace_m": WORKSPACE,
                            "deadline_s": 5.0, "max_misses": 1}, JointMap())   # no miss on a loaded CI machine
    robot.connect()

    # 1. NaN at step 6: held at the measured position, stop latched, nothing sent afterwards; committed (6 steps)
    inj = Injected(rt, {6: "nan"})
    dep = Deployer(inj, robot, RunConfig(max_steps=40, label="sim", realtime=False, store_url=store), limits)
    res = dep.run_episode(0)
    dep.close()  # the store writer (its shard lock) and the watchdog thread
    assert res.stop_reason == "non_finite" and res.steps == 7 and res.held == [False] * 6 + [True]
    np.testing.assert_array_equal(res.sent[-1], res.current[-1])
    assert [e.kind for e in res.events if e.kind == "non_finite"] == ["non_finite"]
    assert len(sends) == 7 and res.episode_id is not None
    assert np.array(sends[-1][1]["shoulder_pan.pos"]) == res.current[-1][0]

    # 2. a missed deadline at step 4: the hold goes out at the deadline, before the slow call returns; stop
    n0 = len(sends)
    inj = Injected(rt, {4: "slow"}, slow_s=1.5)
    short = safety_limits({"max_step_deg": 15, "max_step_gripper": 50, "workspace_m": WORKSPACE,
                           "deadline_s": 0.5, "max_misses": 1}, JointMap())
    dep = Deployer(inj, robot, RunConfig(max_steps=40, label="sim", realtime=False), short)
    res = dep.run_episode(1)
    dep.close()
    assert res.stop_reason == "deadline" and res.steps == 5 and res.held[-1] and not any(res.held[:-1])
    np.testing.assert_array_equal(res.sent[-1], res.current[-1])
    hold_t, hold = sends[-1]
    assert len(sends) - n0 == 5 and hold_t < inj.returned_at[4] - 0.5   # held well before the late answer
    np.testing.assert_allclose(list(hold.values()), res.current[-1])
    [ev] = [e for e in res.events if e.kind == "deadline"]
    assert ev.step == 4 and 0.49 <= ev.detail["held_after_s"] < 1.2

    # 2b. an action of the wrong dimension at step 3: the arm is held where it is, the episode ends, the report
    # is still written (and the episode committed with its 3 good steps)
    inj = Injected(rt, {3: np.zeros(7, np.float32)})
    dep = Deployer(inj, robot, RunConfig(max_steps=40, label="sim", realtime=False, store_url=str(tmp_path / "s2")),
                   limits)
    res = dep.run_episode(3)
    dep.close()
    assert res.stop_reason == "bad_action" and res.steps == 4 and res.held == [False] * 3 + [True]
    np.testing.assert_array_equal(res.sent[-1], res.current[-1])
    [ev] = [e for e in res.events if e.kind == "bad_action"]
    assert ev.step == 3 and ev.detail["shape"] == [7]
    report = json.loads(json.dumps(dep.report([res])))
    assert report["episodes"][0]["stop_reason"] == "bad_action" and report["committed"] == [res.episode_id]

    # 3. out-of-range actions into a tight pan limit and a low workspace ceiling: clipped, capped and held there
    tight = safety_limits({"max_step_deg": 15, "max_step_gripper": 50, "deadline_s": 5.0,
                           "joint_limits_deg": {"shoulder_pan": [-4.0, 4.0]},
                           "workspace_m": [WORKSPACE[0], [0.29, 0.81, 0.11]]}, JointMap())
    side = np.array([0.0, 6.0, 0.0, -1.0], dtype=np.float32)           # +y (turns the pan), far outside [-1, 1]
    up = np.array([0.0, 0.0, 6.0, -1.0], dtype=np.float32)             # then +z, into the ceiling
    inj = Injected(rt, {**dict.fromkeys(range(30), side), **dict.fromkeys(range(30, 60), up)})
    dep = Deployer(inj, robot, RunConfig(max_steps=60, label="sim", realtime=False, store_url=store), tight)
    res = dep.run_episode(2)
    dep.close()
    counts = res.to_dict()["safety_counts"]
    assert res.steps == 60 and counts["action_range"] == 60 and counts["joint_limit"] > 0 and counts["workspace"] > 0
    sent = np.array(res.sent)
    assert sent[:, 0].min() >= -4.0 - 1e-9 and sent[:30, 0].min() == -4.0      # pushed against the pan limit
    ee = np.array([dep.bridge.fk(s) for s in sent])
    ws_steps = [e.step for e in res.events if e.kind == "workspace"]
    assert ws_steps and ws_steps[0] > 0
    np.testing.assert_array_equal(sent[ws_steps], sent[np.array(ws_steps) - 1])  # the command is rejected
    assert ee[:, 2].max() <= 0.11 + 0.01                                     # the ceiling holds (servo lag aside)
    assert 0.10 < robot.env.tcp[2] <= 0.12 and robot.joint_positions()[0] >= -4.5
    robot.disconnect()

    from experience_dict.store import ExperienceStore

    eps = ExperienceStore.open(store).episodes()
    # the NaN episode (6 policy steps) and the out-of-range one; the deadline episode ran without a store
    assert sorted(e.length for e in eps) == [6, 60]


class ExpertRuntime:
    """The SO-100 scripted expert behind the runtime interface (it reads the twin's true state)."""

    control_hz = 30.0

    def __init__(self, robot):
        self.robot, self.expert = robot, None
        self.input_shapes = {"observation.state": [4], "observation.environment_state": [17]}
        self.meta = {}

    def reset(self):
        self.expert = None

    def select_action(self, obs):
        import sim

        if self.expert is None:
            self.expert = sim.make_expert(self.robot.env, seed=0)
        return self.expert.act(obs)


def test_expert_through_the_bridge_succeeds_and_matches_the_twin(tmp_path):
    """EE deltas -> the bridge's IK -> joint targets -> the LeRobot sim robot: the twin's own trajectory, and
    so100-reach solved, for a non-trivial calibration shared by the robot and the bridge."""
    import sim

    signs, offsets = [1, -1, 1, -1, 1], [3.0, 95.0, -88.0, -2.5, 10.0]
    robot = _robot(tmp_path, render_cameras=[], joint_signs=signs, joint_offsets_deg=offsets)
    jm = JointMap(signs, offsets)
    free = safety_limits({"max_step_deg": 1e6, "max_step_gripper": 1e6, "workspace_m": WORKSPACE,
                          "deadline_s": None}, jm)
    rt = ExpertRuntime(robot)
    dep = Deployer(rt, robot, RunConfig(episodes=3, max_steps=150, label="sim", realtime=False, seed=10), free, jm)
    robot.connect()
    tcps = []
    real_step = robot.env.step_joint_targets

    def step_and_record(q, jaw):
        out = real_step(q, jaw)
        tcps.append(robot.env.tcp)
        return out

    robot.env.step_joint_targets = step_and_record
    results = dep.run_all()
    robot.disconnect()
    assert [r.success for r in results] == [True, True, True]
    assert all(r.stop_reason == "success" and not r.events for r in results)
    # the same seed and expert on the plain twin (env.step: its own EE controller) gives the same tcp path
    env = sim.make_env("so100-reach")
    env.reset(seed=10)
    expert = sim.make_expert(env, seed=0)
    ref = []
    for _ in range(results[0].steps):
        env.step(expert.act(None))
        ref.append(env.tcp)
    np.testing.assert_allclose(np.array(tcps[:results[0].steps]), np.array(ref), atol=1e-6)


def test_twin_ends_a_trial_at_max_steps_and_writes_its_outcome(tmp_path):
    """The twin as a trial of fleetmind's evaluation (``scripts/twin_vs_eval.py --lerobot``): after ``max_steps``
    actions it holds still (a rollout's return to its start pose changes nothing) and writes the trial's outcome
    once; the expert through the bridge reaches the simulator's success, which the outcome records."""
    import json

    from fleet.deploy.lerobot_bridge import MOTOR_KEYS

    res = tmp_path / "results.jsonl"
    robot = _robot(tmp_path, render_cameras=[], seed=10, max_steps=12, result_file=str(res))
    robot.connect()
    hold = {k: robot.get_observation()[k] for k in MOTOR_KEYS}
    away = {**hold, "shoulder_pan.pos": hold["shoulder_pan.pos"] + 20.0}
    for _ in range(12):
        robot.send_action(away)
    assert robot.episode_over and json.loads(res.read_text())["steps"] == 12
    moved = robot.joint_positions()
    for _ in range(5):   # past max_steps: nothing is applied
        robot.send_action(hold)
    np.testing.assert_array_equal(robot.joint_positions(), moved)
    robot.disconnect()
    lines = [json.loads(x) for x in res.read_text().splitlines()]
    assert lines == [{"task": "so100-reach", "unit_id": None, "seed": 10, "steps": 12, "success": False,
                      "first_success_step": None}]
    # the expert solves the trial: its outcome is the simulator's success, written at disconnect
    res2 = tmp_path / "expert.jsonl"
    robot = _robot(tmp_path, render_cameras=[], seed=10, max_steps=300, result_file=str(res2))
    free = safety_limits({"max_step_deg": 1e6, "max_step_gripper": 1e6, "workspace_m": WORKSPACE,
                          "deadline_s": None}, JointMap())
    dep = Deployer(ExpertRuntime(robot), robot, RunConfig(episodes=1, max_steps=300, label="sim", realtime=False,
                                                          seed=10), free, JointMap())
    robot.connect()
    (r,) = dep.run_all()
    robot.disconnect()
    (out,) = [json.loads(x) for x in res2.read_text().splitlines()]
    assert r.success and out["success"] and out["seed"] == 10 and 0 < out["first_success_step"] <= out["steps"]
    with pytest.raises(ValueError, match="max_steps"):
        _robot(tmp_path, max_steps=0)


def test_deploy_runs_a_point_cloud_export_with_each_units_depth_calibration(tmp_path):
    """A point-cloud policy through fleetmind's own deploy path (``scripts/deploy.py``): the twin gives its depth
    images, the bridge makes the cloud with the calibration of the trial's unit (its cameras are jittered per unit),
    re-read at every episode start; a deploy without the depth cameras named is refused in one line."""
    from fleet.deploy.deployer import RunConfig as DeployRun
    from policies.export import export_checkpoint
    from policies.runtime import PolicyRuntime
    from tests.test_runtime import tiny_policy

    tiny_policy({"observation.state": {"min": [-0.3, -0.45, 0.0, 0.0], "max": [0.3, 0.05, 0.4, 1.0]},
                 "observation.point_cloud": {"min": [-0.3, -0.45, 0.0], "max": [0.3, 0.05, 0.4]},
                 "action": {"min": [-1.0] * 4, "max": [1.0] * 4}}, point_channels=[8, 16],
                input_shapes={"observation.state": [4], "observation.point_cloud": [64, 3]}).save_pretrained(
        tmp_path / "ckpt")
    export = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", control_hz=30.0)
    robot = _robot(tmp_path, render_cameras=[], depth_cameras=["corner", "topview"], depth_size=40,
                   fleet_robot=_fleet_robot())
    trials = tmp_path / "trials.json"
    trials.write_text(json.dumps([{"seed": 3, "unit_id": 101}, {"seed": 4, "unit_id": 103}]))
    dep = Deployer(PolicyRuntime.load(export), robot,
                   DeployRun(episodes=2, max_steps=6, label="sim", realtime=False, trials=str(trials)),
                   safety_limits({"deadline_s": None}, JointMap()), JointMap(), depth_cameras=["corner", "topview"])
    seen = []
    real = dep.bridge.policy_observation

    def observe(obs):
        seen.append((robot.unit_id, {c: cam.to_dict() for c, cam in dep.bridge.depth_cameras.items()},
                     robot.depth_calibration()))
        return real(obs)

    dep.bridge.policy_observation = observe
    robot.connect()
    try:
        results = dep.run_all()
    finally:
        robot.disconnect()
    assert [r.steps for r in results] == [6, 6]
    # every cloud (the warm-up's on the nominal twin included) made with the calibration of the robot as built then
    assert {u for u, _, _ in seen} >= {101, 103} and all(used == own for _, used, own in seen)
    by_unit = {u: used for u, used, _ in seen}
    assert by_unit[101] != by_unit[103]
    with pytest.raises(ValueError, match="only the simulated robot"):
        Deployer(PolicyRuntime.load(export), type("Arm", (), {"observation_features": {}, "action_features": {}})(),
                 DeployRun(episodes=1), depth_cameras=["corner"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
           "WANDB_MODE": "offline", "HF_LEROBOT_CALIBRATION": str(tmp_path / "calib")}
    cmd = [sys.executable, "scripts/deploy.py", f"deploy.run.export_dir={export}", "deploy.run.label=sim",
           "deploy.robot.task=so100-reach", "deploy.run.episodes=1", "deploy.run.max_steps=5",
           "deploy.run.realtime=false", f"hydra.run.dir={tmp_path / 'run'}"]
    bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert bad.returncode != 0 and "deploy.bridge.depth_cameras" in bad.stderr
    ok = subprocess.run([*cmd, "deploy.bridge.depth_cameras=[corner,topview]", "+deploy.robot.depth_size=40"],
                        cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert ok.returncode == 0, ok.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "deploy_report.json").read_text())
    assert [e["actions_sent"] for e in report["episodes"]] == [5]


def far_from_home(robot, observation) -> bool:
    """A success classifier for the test below (label=classifier): the arm left its home pose (degrees)."""
    return bool(abs(observation["shoulder_lift.pos"] + 90.0) > 1.0 or abs(observation["elbow_flex.pos"] - 90.0) > 1.0)


def test_operator_and_classifier_labels_decide_what_is_committed(tmp_path):
    from experience_dict.store import ExperienceStore

    robot = _robot(tmp_path, render_cameras=[])
    answers = iter(["maybe", "y", "", "n"])
    prompts = []

    def operator(prompt):
        prompts.append(prompt)
        return next(answers)

    store = str(tmp_path / "s")
    run = RunConfig(episodes=3, max_steps=8, label="operator", realtime=False, store_url=store)
    dep = Deployer(ExpertRuntime(robot), robot, run, input_fn=operator)
    results = dep.run_all()
    assert [r.success for r in results] == [True, None, False] and len(prompts) == 4
    assert "success? [y/n" in prompts[0] and [r.label_source for r in results] == ["operator", "none", "operator"]
    assert results[1].episode_id is None                   # no label, not committed
    metas = ExperienceStore.open(store).episodes()
    assert sorted((m.seed, m.success) for m in metas) == [(0, True), (2, False)]
    run = RunConfig(episodes=1, max_steps=8, label="classifier", success_classifier="tests.with_lerobot.test_deploy:far_from_home",
                    realtime=False, store_url=store)
    [res] = Deployer(ExpertRuntime(robot), robot, run).run_all()
    assert res.success is True and res.label_source == "classifier" and res.episode_id is not None
    robot.disconnect()
    with pytest.raises(ValueError, match="label=classifier needs"):
        Deployer(ExpertRuntime(robot), robot, RunConfig(label="classifier"))


def test_clear_errors_for_bad_exports_and_robots(export_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_path(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown robot type 'so999_follower'.*fleetmind_so100_sim.*so101_follower"):
        build_robot_config({"type": "so999_follower"})
    with pytest.raises(ValueError, match="fields `bogus` are not valid"):
        build_robot_config({"type": "so101_follower", "port": "/dev/null", "bogus": 1})
    real = make_robot_from_config(build_robot_config({"type": "so101_follower", "port": "/dev/null",
                                                      "calibration_dir": str(tmp_path / "c"), "id": "arm0",
                                                      "use_degrees": True}))
    with pytest.raises(ValueError, match="observation.environment_state.*'so101_follower' does not provide"):
        Deployer(_runtime(export_dir), real, RunConfig(label="operator"), robot_type="so101_follower")
    no_deg = make_robot_from_config(build_robot_config({"type": "so101_follower", "port": "/dev/null",
                                                        "calibration_dir": str(tmp_path / "c"), "id": "arm1",
                                                        "use_degrees": False}))
    with pytest.raises(ValueError, match="use_degrees=false.*in degrees"):
        Deployer(_StateOnly(_runtime(export_dir)), no_deg, RunConfig(label="operator"), robot_type="so101_follower")
    robot = _robot(tmp_path, render_cameras=[])
    with pytest.raises(ValueError, match=r"robot camera 'corner'.*its cameras: \[\]"):
        Deployer(_runtime(export_dir), robot, RunConfig(label="sim"))
    with pytest.raises(ValueError, match="label=sim needs the simulated robot"):
        Deployer(_StateOnly(_runtime(export_dir)), real, RunConfig(label="sim"))
    with pytest.raises(ValueError, match="policy runs at 80.0 Hz"):
        Deployer(_StateOnly(_runtime(export_dir)), robot, RunConfig(label="sim", control_hz=80.0))


class _StateOnly:
    """The runtime seen as a policy reading the state only (feature checks, no acting)."""

    def __init__(self, rt):
        self.rt, self.control_hz, self.meta = rt, rt.control_hz, rt.meta
        self.input_shapes = {"observation.state": [4]}


@pytest.mark.slow
def test_deploy_script_runs_an_export_on_the_simulated_robot(export_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
           "WANDB_MODE": "offline", "HF_LEROBOT_CALIBRATION": str(tmp_path / "calib")}
    cmd = [sys.executable, "scripts/deploy.py", f"deploy.run.export_dir={export_dir}", "deploy.run.label=sim",
           "deploy.run.episodes=2", "deploy.run.max_steps=20", "deploy.run.realtime=false",
           "deploy.safety.deadline_s=5",
           f"deploy.run.store_url={tmp_path / 'store'}", f"hydra.run.dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "deploy_report.json").read_text())
    assert report["robot_type"] == "fleetmind_so100_sim" and report["control_hz"] == 30.0
    assert [e["actions_sent"] for e in report["episodes"]] == [20, 20] and len(report["committed"]) == 2
    assert report["safety"]["max_step"] == [15.0] * 5 + [50.0]
    bad = subprocess.run(cmd[:3] + ["deploy.robot.type=so999_follower", f"hydra.run.dir={tmp_path / 'run2'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert bad.returncode != 0 and "unknown robot type 'so999_follower'" in bad.stderr
    assert "so101_follower" in bad.stderr
    bad = subprocess.run(cmd[:2] + [f"hydra.run.dir={tmp_path / 'run3'}"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=env, check=False)
    assert bad.returncode != 0 and "deploy.run.export_dir is not set" in bad.stderr


def test_safety_defaults_are_the_yaml_limits_and_off_needs_an_explicit_null(export_dir, tmp_path, caplog):
    """The Python API's defaults are a composed config's (fleet.deploy.config.SafetyConfig, their one source); 0
    is refused (it is not "no limit"); NaN and
    negative limits are refused; switching a limit off takes an explicit null, which is logged; the limits in
    force are logged before the first action."""
    import logging

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import configs.typed  # noqa: F401 - registers the typed groups
    from fleet.deploy.config import SafetyConfig

    with initialize_config_dir(str(REPO / "configs"), version_base=None):
        yaml = OmegaConf.to_container(compose("config").deploy.safety, resolve=True)   # what a composed run gets
    assert yaml == SafetyConfig().to_dict() and yaml["max_step_deg"] == 15.0 and yaml["deadline_s"] == 0.25
    jm = JointMap()
    d, y = safety_limits({}, jm), safety_limits(yaml, jm)
    assert d.to_dict() == y.to_dict()
    assert np.all(np.isfinite(d.max_step)) and d.max_step[0] == 15.0 and d.max_step[5] == 50.0
    assert d.workspace is not None and d.deadline_s == 0.25
    for bad in ({"max_step_deg": 0}, {"max_step_gripper": 0}):
        with pytest.raises(ValueError, match="=0: a step limit of 0"):
            safety_limits(bad, jm)
    for bad in ({"max_step_deg": float("nan")}, {"max_step_deg": -5}, {"deadline_s": -1.0}):
        with pytest.raises(ValueError):
            safety_limits(bad, jm)
    with pytest.raises(ValueError, match="unknown keys"):
        safety_limits({"max_step": 10}, jm)
    caplog.set_level(logging.WARNING, logger="fleetmind.deploy")
    off = safety_limits({"max_step_deg": None, "workspace_m": None}, jm)
    assert np.all(np.isinf(off.max_step[:5])) and off.max_step[5] == 50.0 and off.workspace is None
    assert "switched off" in caplog.text and "max_step_deg" in caplog.text and "workspace_m" in caplog.text
    assert "OFF" in describe_limits(off) and "OFF" not in describe_limits(d)

    robot = _robot(tmp_path)
    caplog.set_level(logging.INFO, logger="fleetmind.deploy")
    dep = Deployer(_runtime(export_dir), robot, RunConfig(max_steps=2, label="sim", realtime=False))
    assert dep.limits.to_dict() == d.to_dict()                       # safety=None: the conservative defaults
    dep.run_all()
    robot.disconnect()
    assert "safety limits in force" in caplog.text


# ---------------------------------------------------------------------------------------------- robot units
def _fleet_robot() -> dict:
    """The robot config fleetmind's evaluation draws its units from by default (``robot`` group defaults)."""
    from configs.sim_groups import RobotConfig

    return RobotConfig().to_dict()


def test_twin_built_as_a_unit_has_its_parameters_and_latency(tmp_path):
    """unit_id builds the twin as that fleet unit, as sim.make_env does for the evaluation (cube mass and
    friction, camera jitter); its action gain is offered to the bridge and its latency delays the joint targets;
    the default stays the nominal twin; an unknown unit is refused, naming the valid ones."""
    import sim
    from sim.units import RobotUnit

    ref = sim.make_env("so100-reach", unit_id=101, robot_cfg=_fleet_robot())
    ref.reset(seed=0)
    assert ref.latency_steps == 1 and ref.unit.action_gain != (1.0, 1.0, 1.0)   # a unit worth testing
    robot = _robot(tmp_path, render_cameras=[], unit_id=101)
    robot.connect()
    m, r = robot.env.model, ref.model
    assert robot.unit_id == 101 and robot.unit == ref.unit == RobotUnit.draw(101, {**_fleet_robot(),
                                                                                    "embodiment": "so100"})
    np.testing.assert_array_equal(m.body_mass, r.body_mass)
    np.testing.assert_array_equal(m.geom_friction, r.geom_friction)
    np.testing.assert_array_equal(m.cam_pos, r.cam_pos)
    np.testing.assert_allclose(robot.action_scale_m, 0.01 * np.array(ref.unit.action_gain))
    assert robot.latency_steps == 1
    # latency: each target is applied one control period later; the first period holds the arm, gripper open
    from sim.so100.env import JAW_OPEN

    home = robot.env.arm_joints
    a = robot.joint_positions() + np.array([10.0, -10.0, 10.0, 0.0, 0.0, -50.0])
    b = a + np.array([5.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    robot.send_action(dict(zip(robot.action_features, a)))
    np.testing.assert_allclose(robot.env.data.ctrl[:6], [*home, JAW_OPEN])
    robot.send_action(dict(zip(robot.action_features, b)))
    np.testing.assert_allclose(robot.env.data.ctrl[:5], robot.joint_map.arm_to_mjcf(a[:5]))
    robot.reset_scene(3, unit_id=102)     # another unit: rebuilt as it
    assert robot.unit_id == 102 and robot.unit == sim.make_env("so100-reach", 102, _fleet_robot()).unit
    assert robot.latency_steps == 0
    with pytest.raises(ValueError, match=r"unknown unit id 999.*heldout_units \[100, 101, 102, 103\]"):
        robot.reset_scene(3, unit_id=999)
    assert robot.unit_id == 102 and robot.is_connected               # the twin is kept
    robot.disconnect()
    nominal = _robot(tmp_path, render_cameras=[])                    # the default: today's nominal twin
    nominal.connect()
    assert nominal.unit_id is None and nominal.unit == RobotUnit(0, embodiment="so100")
    assert nominal.latency_steps == 0 and np.allclose(nominal.action_scale_m, 0.01)
    nominal.disconnect()
    with pytest.raises(ValueError, match="unknown unit id 999"):
        FleetmindSO100SimConfig(unit_id=999)


def test_deploy_plays_the_evaluation_trials_on_their_units(tmp_path):
    """deploy.run.trials (here an evaluation's episodes file): each episode on its trial's unit with its reset
    seed; the scripted expert's EE actions through the bridge (the unit's gain handed over) and the twin built as
    the unit (its latency) trace the same tcp path as sim.make_env's env.step on that unit."""
    import sim

    trials = [{"task": "so100-reach", "unit_id": 101, "seed": 10, "success": False, "length": 300},
              {"task": "so100-reach", "unit_id": 103, "seed": 11, "episode_id": "x"}]
    path = tmp_path / "episodes.json"
    path.write_text(json.dumps(trials))
    robot = _robot(tmp_path, render_cameras=[])
    free = safety_limits({"max_step_deg": 1e6, "max_step_gripper": 1e6, "workspace_m": WORKSPACE,
                          "deadline_s": None}, JointMap())
    dep = Deployer(ExpertRuntime(robot), robot, RunConfig(trials=str(path), episodes=7, max_steps=120, label="sim",
                                                          realtime=False), free)
    assert dep.episodes == 2
    tcps, real = [], robot.send_action

    def send(action):
        out = real(action)
        tcps[-1].append(robot.env.tcp)
        return out

    robot.send_action = send
    robot.connect()
    orig_reset = robot.reset_scene

    def reset_scene(seed=None, unit_id=None):
        tcps.append([])
        return orig_reset(seed, unit_id=unit_id)

    robot.reset_scene = reset_scene
    results = dep.run_all()
    robot.disconnect()
    assert [(r.unit_id, r.seed) for r in results] == [(101, 10), (103, 11)]
    assert all(r.success for r in results) and [len(t) for t in tcps[-2:]] == [r.steps for r in results]
    from sim.units import RobotUnit

    gain = RobotUnit.draw(103, _fleet_robot()).action_gain
    np.testing.assert_allclose(dep.bridge.action_scale_m, 0.01 * np.array(gain))   # the last unit's gain
    for tr, res, path_ in zip(trials, results, tcps[-2:], strict=True):
        env = sim.make_env("so100-reach", unit_id=tr["unit_id"], robot_cfg=_fleet_robot())
        env.reset(seed=tr["seed"])
        expert = sim.make_expert(env, seed=0)
        ref = []
        for _ in range(res.steps):
            env.step(expert.act(None))
            ref.append(env.tcp)
        # metres; exact without latency, 0.2 mm on unit 101: the env's first (hold) step still runs its IK
        np.testing.assert_allclose(np.array(path_), np.array(ref), atol=1e-3)
    report = json.loads(json.dumps(dep.report(results)))
    assert [(e["unit_id"], e["seed"]) for e in report["episodes"]] == [(101, 10), (103, 11)]


def test_trial_lists_are_checked_and_the_noise_follows_the_episode_seed(export_dir, tmp_path):
    from fleet.deploy.deployer import load_trials

    assert load_trials([{"seed": 4}, {"seed": 5, "unit_id": 100, "task": "so100-reach"}]) == [
        {"seed": 4, "unit_id": None, "task": None}, {"seed": 5, "unit_id": 100, "task": "so100-reach"}]
    for bad, msg in (([], "non-empty list"), ([{"unit_id": 100}], r"\[0\]: expected an integer seed"),
                     ([{"seed": 1}, {"seed": 2, "unit_id": -1}], r"\[1\]: expected an integer unit_id"),
                     ([3], r"\[0\]: expected a mapping")):
        with pytest.raises(ValueError, match=msg):
            load_trials(bad)
    with pytest.raises(FileNotFoundError, match="no trial file"):
        load_trials(str(tmp_path / "none.json"))
    rt = _runtime(export_dir)
    robot = _robot(tmp_path, render_cameras=["corner"])
    with pytest.raises(ValueError, match="trial of task 'so100-push-cube'"):
        Deployer(rt, robot, RunConfig(label="sim", trials=[{"seed": 1, "task": "so100-push-cube"}]))
    real = make_robot_from_config(build_robot_config({"type": "so101_follower", "port": "/dev/null",
                                                      "calibration_dir": str(tmp_path / "c"), "id": "arm0"}))
    with pytest.raises(ValueError, match="names robot unit 100.*'so101_follower' cannot be built"):
        Deployer(_StateOnly(rt), real, RunConfig(label="operator", trials=[{"seed": 1, "unit_id": 100}]),
                 robot_type="so101_follower")
    limits = safety_limits({"deadline_s": 5.0}, JointMap())
    robot.connect()

    def play(seed_noise: bool) -> np.ndarray:
        run = RunConfig(trials=[{"seed": 21, "unit_id": 100}], max_steps=12, label="sim", realtime=False,
                        seed_noise=seed_noise)
        dep = Deployer(rt, robot, run, limits)
        [res] = [dep.run_episode(0)]
        dep.close()
        assert res.unit_id == 100 and res.seed == 21
        return np.array(res.proposed)

    first, again, unseeded = play(True), play(True), play(False)
    robot.disconnect()
    np.testing.assert_array_equal(first, again)            # the same trial, the same noise: the same actions
    assert np.abs(first - unseeded).max() > 1e-6           # torch's global generator: other actions


def test_float_rounding_at_a_joint_limit_is_clipped_without_an_event():
    """The IK lands on a joint range end to within ~1e-14 degrees: clipped, but no joint_limit event (a real
    excess still is one)."""
    from fleet.deploy.safety import SafetyFilter

    limits = safety_limits({}, JointMap())
    hi = limits.joint_limits[3, 1]                               # wrist_flex's upper limit, degrees
    cur = np.array([0.0, -90.0, 90.0, hi - 1.0, 0.0, 50.0])
    f = SafetyFilter(limits, fk=lambda j: np.array([0.1, 0.6, 0.1]))
    over = cur.copy()
    over[3] = np.nextafter(hi, np.inf)                           # one float step beyond: 1.4e-14 degrees
    sent, ev = f.filter(over, cur)
    assert over[3] > hi and sent[3] == hi and ev == []
    over[3] = hi + 0.5
    sent, ev = f.filter(over, cur)
    assert sent[3] == hi and [e.kind for e in ev] == ["joint_limit"]


@pytest.mark.lerobot
def test_twin_robots_depth_cameras_give_the_fleets_point_cloud(tmp_path):
    """The same path for a real robot (issue 49, item 2): the twin as a LeRobot robot gives depth images and their
    calibration as an RGB-D sensor would; the deploy bridge turns them into the policy's ``observation.point_cloud``
    with the fleet's own function, equal to what the fleet's SO-100 env observes in the same state."""
    import sim
    from fleet.deploy.lerobot_bridge import SO100Bridge

    robot = _robot(tmp_path, depth_cameras=["corner", "topview"], depth_size=48)
    robot.connect()
    try:
        feats = robot.observation_features
        assert feats["corner_depth"] == (48, 48, 1) and feats["topview_depth"] == (48, 48, 1)
        calib = robot.depth_calibration()
        shapes = {"observation.state": [4], "observation.point_cloud": [96, 3]}
        bridge = SO100Bridge(shapes, ["dx", "dy", "dz", "gripper"], depth_cameras=calib)
        bridge.check_robot(feats, robot.action_features, "fleetmind_so100_sim")
        env = sim.make_env("so100-reach", obs_cfg={"point_cloud": True, "point_cameras": ["corner", "topview"],
                                                    "point_image_size": 48, "num_points": 96})
        for seed in (0, 3):
            robot.reset_scene(seed)
            own, _ = env.reset(seed=seed)
            got = bridge.policy_observation(robot.get_observation())["observation.point_cloud"]
            assert got.shape == (96, 3) and got.dtype == np.float32
            np.testing.assert_array_equal(got, own["observation.point_cloud"])
        # a robot without the depth images is refused, naming what it lacks
        with pytest.raises(ValueError, match="corner_depth"):
            bridge.check_robot({k: v for k, v in feats.items() if not k.endswith("_depth")}, robot.action_features,
                               "so100_follower")
        with pytest.raises(ValueError, match="depth cameras"):
            SO100Bridge(shapes, ["dx", "dy", "dz", "gripper"])
        env.close()
    finally:
        robot.disconnect()


@pytest.mark.lerobot
def test_twin_robots_rgbd_cameras_give_the_fleets_coloured_point_cloud(tmp_path):
    """obs.point_color through a robot: the twin's depth cameras with depth_color give depth-aligned colour images
    (``<camera>_depth_rgb``); the bridge makes the cloud and its colours with the fleet's own function, equal to what
    the fleet's env observes; a robot without the colour images is refused, naming them."""
    import sim
    from fleet.deploy.lerobot_bridge import SO100Bridge

    robot = _robot(tmp_path, depth_cameras=["corner"], depth_size=40, depth_color=True)
    robot.connect()
    try:
        feats = robot.observation_features
        assert feats["corner_depth_rgb"] == (40, 40, 3)
        shapes = {"observation.state": [4], "observation.point_cloud": [64, 3], "observation.point_colors": [64, 3]}
        bridge = SO100Bridge(shapes, ["dx", "dy", "dz", "gripper"], depth_cameras=robot.depth_calibration())
        bridge.check_robot(feats, robot.action_features, "fleetmind_so100_sim")
        env = sim.make_env("so100-reach", obs_cfg={"point_cloud": True, "point_cameras": ["corner"],
                                                    "point_image_size": 40, "num_points": 64, "point_color": True})
        robot.reset_scene(2)
        own, _ = env.reset(seed=2)
        got = bridge.policy_observation(robot.get_observation())
        np.testing.assert_array_equal(got["observation.point_cloud"], own["observation.point_cloud"])
        assert got["observation.point_colors"].dtype == np.uint8
        np.testing.assert_array_equal(got["observation.point_colors"], own["observation.point_colors"])
        with pytest.raises(ValueError, match="corner_depth_rgb"):
            bridge.check_robot({k: v for k, v in feats.items() if not k.endswith("_depth_rgb")},
                               robot.action_features, "so100_follower")
        env.close()
    finally:
        robot.disconnect()
