"""SO-100 bridge (fleet/deploy/lerobot_bridge.py) in the core environment, without LeRobot: joint conventions, forward
kinematics against the twin's own tcp, EE actions -> joint targets giving the twin's trajectory, feature checks."""

import mujoco
import numpy as np
import pytest

import sim
from fleet.deploy.lerobot_bridge import MOTOR_KEYS, JointMap, SO100Bridge, sim_feature_names
from sim.so100.env import JAW_CLOSED, JAW_OPEN

STATE_ONLY = {"observation.state": [4], "observation.environment_state": [17]}
CALIBRATED = JointMap(signs=[1, -1, 1, -1, 1], offsets_deg=[3.0, 95.0, -88.0, -2.5, 10.0])


def _lerobot_obs(env, jm: JointMap) -> dict:
    """What a LeRobot SO-101 calibrated as ``jm`` would read from the twin's arm (degrees, gripper 0..100)."""
    q = env.arm_joints
    obs = dict(zip(MOTOR_KEYS[:5], jm.arm_to_robot(q).tolist()))
    obs["gripper.pos"] = jm.pos_from_opening(env.gripper_opening())
    obs.update(zip(sim_feature_names(), env.observation()["observation.environment_state"].tolist()))
    return obs


def test_joint_map_round_trips_and_limits_follow_the_mjcf_ranges():
    q = np.array([0.3, -1.2, 1.4, 0.2, -2.0])
    np.testing.assert_allclose(CALIBRATED.arm_to_mjcf(CALIBRATED.arm_to_robot(q)), q, atol=1e-12)
    np.testing.assert_allclose(CALIBRATED.arm_to_robot(q)[1], -np.rad2deg(-1.2) + 95.0)
    ident = JointMap().limits()
    np.testing.assert_allclose(ident[0], [-126.0507, 126.0507], atol=1e-3)    # Rotation range +-2.2 rad
    np.testing.assert_allclose(ident[2], [0.0, 179.9993], atol=1e-3)           # Elbow 0..3.14158 rad
    np.testing.assert_allclose(ident[5], [0.0, 100.0])
    lim = CALIBRATED.limits()
    np.testing.assert_allclose(lim[1], np.sort(-np.rad2deg([-3.14158, 0.2]) + 95.0))  # sign -1 swaps the ends
    assert JointMap().pos_from_command(-1.0) == 100.0 and JointMap().pos_from_command(1.0) == 0.0
    with pytest.raises(ValueError, match="joint_signs"):
        JointMap(signs=[1, 1, 2, 1, 1])
    with pytest.raises(ValueError, match="joint_offsets_deg"):
        JointMap(offsets_deg=[0, 0, 0])


def test_policy_state_is_the_twins_state_through_forward_kinematics():
    env = sim.make_env("so100-push-cube")
    bridge = SO100Bridge(STATE_ONLY, ["dx", "dy", "dz", "gripper"], CALIBRATED)
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    for _ in range(15):
        env.step(rng.uniform(-1, 1, 4).astype(np.float32))
    mujoco.mj_forward(env.model, env.data)  # after mj_step, site positions lag qpos by one physics substep
    twin = env.observation()
    got = bridge.policy_observation(_lerobot_obs(env, CALIBRATED))
    np.testing.assert_allclose(got["observation.state"][:3], twin["observation.state"][:3], atol=1e-6)
    assert got["observation.state"][3] == pytest.approx(twin["observation.state"][3], abs=1e-6)
    np.testing.assert_array_equal(got["observation.environment_state"], twin["observation.environment_state"])
    assert got["observation.state"].dtype == np.float32


def test_ee_actions_through_the_bridge_drive_the_arm_like_the_twin():
    """Expert actions -> bridge (FK, the twin's IK, joint map) -> joint targets -> the twin's joints: the same
    trajectory as ``env.step`` with the same actions, for a non-trivial calibration."""
    ref, arm = sim.make_env("so100-pick-place"), sim.make_env("so100-pick-place")
    bridge = SO100Bridge(STATE_ONLY, ["dx", "dy", "dz", "gripper"], CALIBRATED)
    ref.reset(seed=5)
    arm.reset(seed=5)
    expert = sim.make_expert(ref, seed=0)
    bridge.reset(_lerobot_obs(arm, CALIBRATED))
    success = False
    for step in range(60):
        a = expert.act(None)
        _, _, term, _, info_ref = ref.step(a)
        targets = bridge.propose(a, _lerobot_obs(arm, CALIBRATED), step)
        bridge.sent(targets)
        q = CALIBRATED.arm_to_mjcf(targets[:5])
        jaw = JAW_CLOSED + CALIBRATED.opening_from_pos(targets[5]) * (JAW_OPEN - JAW_CLOSED)
        _, _, _, _, info = arm.step_joint_targets(q, jaw)
        np.testing.assert_allclose(arm.tcp, ref.tcp, atol=1e-6)
        assert info["success"] == info_ref["success"]
        success |= info["success"]
        if term:
            break
    assert success and np.linalg.norm(arm.cube - arm._cube_init) > 0.02      # it really picked the cube
    assert bridge.events.counts == {}


def test_bad_actions_and_missing_features_are_named():
    env = sim.make_env("so100-reach")
    env.reset(seed=0)
    bridge = SO100Bridge({**STATE_ONLY, "observation.images.corner": [32, 32, 3]}, ["dx", "dy", "dz", "gripper"])
    obs = _lerobot_obs(env, JointMap())
    bridge.reset(obs)
    q_before = bridge.controller.q_cmd.copy()
    assert np.isnan(bridge.propose(np.array([np.nan, 0, 0, 0]), obs)).all()
    np.testing.assert_array_equal(bridge.controller.q_cmd, q_before)          # IK state untouched by a NaN
    clipped = bridge.propose(np.array([4.0, 0.0, 0.0, -1.0]), obs, step=2)
    assert bridge.events.counts == {"action_range": 1} and bridge.events.events[0].step == 2
    bridge.reset(obs)
    np.testing.assert_allclose(bridge.propose(np.array([1.0, 0.0, 0.0, -1.0]), obs), clipped)
    motors = dict.fromkeys(MOTOR_KEYS, float)
    with pytest.raises(ValueError, match="does not provide.*fleetmind_so100_sim"):
        bridge.check_robot({**motors, "corner": (32, 32, 3)}, motors, "so101_follower")
    with pytest.raises(ValueError, match=r"robot camera 'corner'.*cameras: \['front'\]"):
        bridge.check_robot({**motors, **dict.fromkeys(sim_feature_names(), float), "front": (480, 640, 3)},
                           motors, "so101_follower")
    with pytest.raises(ValueError, match="gives no joint readings"):
        bridge.check_robot({"front": (480, 640, 3)}, motors, "koch_follower")
    mapped = SO100Bridge({"observation.state": [4], "observation.images.corner": [32, 32, 3]},
                         ["dx", "dy", "dz", "gripper"], cameras={"corner": "front"})
    mapped.check_robot({**motors, "front": (480, 640, 3)}, motors, "so101_follower")
    frame = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    pobs = mapped.policy_observation({**obs, "front": frame})
    assert pobs["observation.images.corner"].shape == (32, 32, 3) and pobs["observation.images.corner"].dtype == np.uint8
    with pytest.raises(ValueError, match="end-effector actions"):
        SO100Bridge(STATE_ONLY, [f"{j}.pos" for j in range(6)])
    with pytest.raises(ValueError, match="no mapping to an SO-100 robot"):
        SO100Bridge({"observation.velocity": [3]}, ["dx", "dy", "dz", "gripper"])
    # a mixed fleet's policy (obs.embodiment_feature) is told it drives an SO-100, as its twin units told it
    from sim.units import EMBODIMENTS, embodiment_onehot

    mixed = SO100Bridge({**STATE_ONLY, "observation.embodiment": [len(EMBODIMENTS)]}, ["dx", "dy", "dz", "gripper"])
    got = mixed.policy_observation(obs)["observation.embodiment"]
    np.testing.assert_array_equal(got, embodiment_onehot("so100"))
    assert got.dtype == np.float32 and got[EMBODIMENTS.index("so100")] == 1 and got.sum() == 1
    with pytest.raises(ValueError, match="one-hot over"):
        SO100Bridge({"observation.embodiment": [5]}, ["dx", "dy", "dz", "gripper"])


def test_bridges_are_chosen_by_embodiment():
    """``make_bridge``: the deploy loop takes an embodiment's bridge from a registry, not a hard-wired class."""
    from fleet.deploy.lerobot_bridge import BRIDGES, EmbodimentBridge, make_bridge, register_bridge

    b = make_bridge("so100", STATE_ONLY, ["dx", "dy", "dz", "gripper"], joint_map=JointMap())
    assert isinstance(b, SO100Bridge) and isinstance(b, EmbodimentBridge)
    with pytest.raises(ValueError, match=r"no bridge for 'ur5'; known: \['so100'\]"):
        make_bridge("ur5", STATE_ONLY, ["dx", "dy", "dz", "gripper"])
    with pytest.raises(ValueError, match="already has a bridge"):
        register_bridge("so100", SO100Bridge)
    assert set(BRIDGES) == {"so100"}
