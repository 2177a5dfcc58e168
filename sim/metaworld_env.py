"""Meta-World v3 tasks as Gymnasium envs with LeRobot-style dict observations, robot units and progress signals.

Built on Meta-World 3.1.1's own task classes (``metaworld.env_dict.ALL_V3_ENVIRONMENTS``) set up the way its
goal-observable MT envs are (goal visible, goals drawn from the env's seeded ``np_random``), and wrapped so that
observations follow docs/INTERFACES.md, a ``RobotUnit``'s variation is applied, and episodes end a fixed number
of steps after the first success.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.base_env import HOLD_ACTION, UnitEnv
from sim.gl import ROTATED_CAMERAS
from sim.stability import SIM_UNSTABLE
from sim.units import CAMERAS, ModelVariation, RobotUnit, check_unit, feature_spec

PROGRESS_KEYS = ("near_object", "grasp_success", "grasp_reward", "in_place_reward", "obj_to_target",
                 "unscaled_reward")
CONTROL_HZ = 80.0  # Meta-World: timestep 2.5 ms x frame_skip 5
STATE_NAMES = ["ee_x", "ee_y", "ee_z", "gripper"]
ENV_STATE_NAMES = ([f"obj1_{k}" for k in ("x", "y", "z", "q0", "q1", "q2", "q3")]
                   + [f"obj2_{k}" for k in ("x", "y", "z", "q0", "q1", "q2", "q3")] + ["goal_x", "goal_y", "goal_z"])
ACTION_NAMES = ["dx", "dy", "dz", "gripper"]
_ENV_POS_DIMS = np.array([0, 1, 2, 7, 8, 9, 14, 15, 16])  # position entries of environment_state (noise goes here)
MW_MAX_PATH_LENGTH = 500  # Meta-World's episode length limit (its benchmark's; one episode here stays within it)


def _all_tasks() -> list[str]:
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    return list(ALL_V3_ENVIRONMENTS)


def check_task(task: str) -> None:
    """Raise ValueError naming the valid choices unless ``task`` is a Meta-World v3 task name."""
    valid = _all_tasks()
    if task not in valid:
        raise ValueError(f"unknown task {task!r}; valid Meta-World v3 tasks: {', '.join(valid)}")


class MetaWorldEnv(UnitEnv):
    """One Meta-World v3 task on one robot unit.

    Observation (dict, float32 unless noted):
        ``observation.state`` (4,): end-effector (hand) position x, y, z in metres (world frame) and gripper
        opening (finger distance / 0.1 m, 0..1), plus the unit's observation noise on x, y, z.
        ``observation.environment_state`` (17,): object 1 position (m) + quaternion, object 2 position +
        quaternion (zeros when the task has one object), goal position (m); noise on present positions.
        ``observation.images.<camera>`` (H, W, 3) uint8 RGB, upright, when ``obs_cfg.images``.
    Action: (4,) float32 in [-1, 1]: end-effector displacement x, y, z (Meta-World: 1 cm per unit, times the
        unit's per-axis ``action_gain``) and gripper effort (absolute, +1 closes). Actions are cast to float32
        and clipped; with ``action_latency`` L the action executed at step t is the one given at step t - L
        (``HOLD_ACTION`` for the first L steps).
    Reward: Meta-World v3's dense reward (0..10) of the executed action.
    info: ``success`` (bool, Meta-World's success test this step), ``episode_success`` (bool, any success so
        far), ``progress`` (dict with exactly ``PROGRESS_KEYS``: Meta-World's reward components; floats) and,
        from ``step``, ``action``: the command taken this step, (4,) float32 clipped to [-1, 1] (what the
        store keeps; with latency L it executes L steps later). A step whose physics diverged (MuJoCo's
        bad qpos/qvel/qacc reset, ``sim.stability``) ends the episode: ``terminated``, ``success`` False,
        ``info["termination"] = "sim_unstable"``.
    Episodes terminate ``steps_after_success`` steps after the first success and truncate after
    ``max_episode_steps`` steps. ``reset(seed=s)`` makes the episode a function of (task, unit, s) and the
    actions only: object/goal placement, observation noise and physics are reproduced bit for bit.

    Args: see ``make_env``.

    Raises:
        ValueError: unknown task, camera or unit id (the message lists the valid ones), bad config values.
        RuntimeError: images requested but no offscreen GL backend works (message says what to install).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": CONTROL_HZ}  # noqa: RUF012 - gymnasium convention
    control_hz: float = CONTROL_HZ
    """Control steps per second, Hz."""
    CAMERAS = CAMERAS
    ROTATED_CAMERAS = ROTATED_CAMERAS   # Meta-World's corner cameras are rolled 180 degrees (sim.gl)
    FAMILY = "Meta-World"
    BASE_BODY = "base"   # the Sawyer's base, at the world origin
    # the table top (z = 0) and the wall behind the objects (y ~ 0.98) cut off; the arm's links and every task's
    # objects stay (reach's goal marker included)
    POINT_CROP = ((-0.6, 0.25, 0.005), (0.6, 0.95, 0.7))
    DEFAULT_MAX_EPISODE_STEPS = MAX_EPISODE_STEPS = MW_MAX_PATH_LENGTH

    def __init__(self, task: str, unit_id: int = 0, robot_cfg: Any = None, obs_cfg: Any = None,
                 task_cfg: Any = None, render_mode: str | None = None) -> None:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        check_task(task)
        check_unit(unit_id, robot_cfg)
        self.unit = RobotUnit.draw(unit_id, robot_cfg)
        self.task = task

        self._options(obs_cfg, task_cfg, render_mode)

        # Meta-World's own task class, set up as its goal-observable MT envs do (metaworld/env_dict.py).
        mw = ALL_V3_ENVIRONMENTS[task]()
        mw._partially_observable = False
        if "sawyer_observation_space" in mw.__dict__:
            del mw.sawyer_observation_space  # cached with the goal masked to zero: recompute with goal bounds
        mw._freeze_rand_vec = False
        mw.seeded_rand_vec = True  # goals from mw.np_random, which reset() seeds
        mw._set_task_called = True
        mw.max_path_length = 10**9   # this env truncates episodes itself; continue_episode() may chain them past 500
        mw.action_scale = mw.action_scale * np.asarray(self.unit.action_gain, dtype=np.float64)
        self._mw = mw
        self._variation = ModelVariation(mw.model)
        self._variation.apply(self.unit, mw.data)

        self._spaces(mw.model)
        self._raw: np.ndarray | None = None

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode; ``seed`` fixes it (see class doc). Returns ``(obs, info)``."""
        super().reset(seed=seed)
        mw_seed = int(self.np_random.integers(2**31 - 1))
        noise_seed = int(self.np_random.integers(2**63 - 1))
        self._variation.apply(self.unit, self._mw.data)  # from stored nominal values: never compounds
        self._mw.seed(mw_seed)
        raw, _ = self._mw.reset()
        if self.images or self.cloud_spec is not None:
            # Meta-World places the goal site after its last physics update; without a forward pass the reset
            # frame draws the goal marker where the previous episode had it (2-17 cm off). Kinematics only: the
            # state is unchanged, and step() does the same pass after every physics update.
            import mujoco

            mujoco.mj_forward(self._mw.model, self._mw.data)
        self._raw = np.asarray(raw, dtype=np.float64)
        self._noise_rng = np.random.default_rng([noise_seed, self.unit.unit_id])
        self._start_episode(self.unit.action_latency)
        _, mw_info = self._mw.evaluate_state(self._raw, HOLD_ACTION)
        return self._observation(), self._info(mw_info)

    def step(self, action):
        """Apply one action (see class doc); returns ``(obs, reward, terminated, truncated, info)``.

        Raises:
            ValueError: action not of shape (4,) or not finite.
            RuntimeError: ``reset()`` not called since the last episode ended.
        """
        a, executed = self._command(action)
        self._monitor.before(self._mw.data)
        raw, reward, _, _, mw_info = self._mw.step(executed.astype(np.float64))
        diverged = self._monitor.after(self._mw.data)
        self._raw = np.asarray(raw, dtype=np.float64)
        self._t += 1
        if diverged is not None:   # MuJoCo reset the simulation: this is not the episode any more
            info = {**self._info(mw_info), "success": False, "termination": SIM_UNSTABLE, "sim_unstable": diverged}
            info["episode_success"] = self._first_success is not None
            info["action"] = a
            self._done = self._unstable = True
            return self._observation(), float(reward), True, False, info
        if mw_info["success"] and self._first_success is None:
            self._first_success = self._t
        terminated, truncated = self._ends()
        self._done = terminated or truncated
        info = self._info(mw_info)
        info["action"] = a
        return self._observation(), float(reward), bool(terminated), bool(truncated), info

    def render(self) -> np.ndarray | None:
        """(H, W, 3) uint8 image of the first configured camera (``render_mode='rgb_array'``), else None."""
        return self._render_first_camera(self._mw.model, self._mw.data)

    def close(self) -> None:
        """Free the renderer's GL context and Meta-World's env."""
        self._close_renderer()
        self._mw.close()

    # ------------------------------------------------------------------ helpers
    @property
    def raw_observation(self) -> np.ndarray:
        """Privileged, noise-free 39-d Meta-World observation of the current step (float64; for experts).

        Layout (Meta-World v3): hand xyz, gripper, 14 object entries, the same 18 of the previous step, goal xyz.
        """
        if self._raw is None:
            raise RuntimeError("raw_observation: call reset() first")
        return self._raw.copy()

    @property
    def action_scale(self) -> np.ndarray:
        """End-effector displacement per action unit on this unit, metres, (3,) (Meta-World 0.01 x action_gain)."""
        return np.broadcast_to(np.asarray(self._mw.action_scale, dtype=np.float64), (3,)).copy()

    @property
    def mj_model(self):
        """The (unit-varied) ``mujoco.MjModel`` of this env."""
        return self._mw.model

    @property
    def mj_data(self):
        """The ``mujoco.MjData`` of this env."""
        return self._mw.data

    def _observation(self) -> dict[str, np.ndarray]:
        raw = self._raw
        state = raw[0:4].astype(np.float32)
        env_state = np.concatenate([raw[4:18], raw[36:39]]).astype(np.float32)
        std = self.unit.obs_noise_std
        if std > 0:
            noise = self._noise_rng.normal(0.0, std, size=12)  # always 12 draws: 3 hand + 9 object/goal positions
            state[:3] += noise[:3].astype(np.float32)
            present = np.ones(9, dtype=bool)
            present[3:6] = np.any(raw[11:18] != 0)  # object 2 slot is zero padding for one-object tasks
            env_state[_ENV_POS_DIMS[present]] += noise[3:][present].astype(np.float32)
        obs = {"observation.state": state, "observation.environment_state": env_state}
        if self.images:
            for c in self.cameras:
                obs[f"observation.images.{c}"] = self._renderer.render(self._mw.data, c)
        return self._with_cloud(self._with_embodiment(obs), self._mw.model, self._mw.data)

    def _info(self, mw_info: dict) -> dict[str, Any]:
        success = bool(mw_info["success"])
        return {"success": success, "episode_success": self._first_success is not None or success,
                "progress": {k: float(mw_info[k]) for k in PROGRESS_KEYS}}

    def spec_dict(self) -> dict[str, Any]:
        """JSON-able feature spec (docs/INTERFACES.md): per feature shape, dtype, names, unit; plus ``control_hz``."""
        return self._spec_with_embodiment(feature_spec(
            STATE_NAMES, ENV_STATE_NAMES, ACTION_NAMES, state_unit="m (gripper: normalised opening 0..1)",
            action_unit="1 = 1 cm end-effector displacement (x, y, z); gripper effort -1 open .. +1 close",
            cameras=self.cameras if self.images else None, image_hw=self.image_hw, control_hz=CONTROL_HZ))


def make_env(task: str, unit_id: int = 0, robot_cfg: Any = None, obs_cfg: Any = None, task_cfg: Any = None,
             render_mode: str | None = None) -> MetaWorldEnv:
    """Build the Gymnasium env of ``task`` (a Meta-World v3 name, e.g. ``"push-v3"``) on robot unit ``unit_id``.

    Args:
        task: a Meta-World v3 task name (``sim.list_tasks()``).
        unit_id: robot unit; must be in ``robot_cfg``'s ``train_units`` or ``heldout_units`` when a config is given.
        robot_cfg: the ``robot`` config (embodiment, fleet_seed, unit lists, variation ranges); None: nominal robot.
        obs_cfg: the ``obs`` config: ``images`` (bool), ``cameras`` (names), ``image_size`` (int or [H, W]),
            optional ``shadows``/``reflections`` (bool, default False), ``shadowsize`` (default 256); None: state only.
        task_cfg: the ``task`` config: ``max_episode_steps`` (<= 500), ``steps_after_success``; None: 500 / 10.
        render_mode: None or ``"rgb_array"``.

    Raises:
        ValueError: unknown task / camera / unit id (lists the valid choices) or bad config values.
        RuntimeError: images requested and no GL backend works.
    """
    return MetaWorldEnv(task, unit_id=unit_id, robot_cfg=robot_cfg, obs_cfg=obs_cfg, task_cfg=task_cfg,
                        render_mode=render_mode)
