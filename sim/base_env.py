"""The base of the fleet's simulated robot envs: what every embodiment's Gymnasium env shares.

``sim.metaworld_env.MetaWorldEnv`` and ``sim.so100.env.SO100Env`` subclass :class:`UnitEnv`, which implements once
the parts the two used to write twice: the ``obs`` / ``task`` / ``render_mode`` options (cameras, image size,
renderer flags, episode length), the observation and action spaces of docs/INTERFACES.md, the action check (shape
and finiteness, then the clip to [-1, 1]) and the unit's action latency queue. A subclass sets the class
attributes ``CAMERAS``, ``FAMILY``, ``DEFAULT_MAX_EPISODE_STEPS`` and ``MAX_EPISODE_STEPS`` and writes its
physics, observation and progress signals. New embodiments register a suite with ``sim.register_suite``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from configs.sim_groups import TaskConfig
from sim.gl import CameraRenderer
from sim.stability import StepMonitor
from sim.units import EMBODIMENTS, as_dict, embodiment_onehot, embodiment_spec

HOLD_ACTION = np.array([0.0, 0.0, 0.0, -1.0], dtype=np.float32)  # no motion, gripper open (as after reset)
STATE_DIM, ENV_STATE_DIM, ACTION_DIM = 4, 17, 4


class UnitEnv(gym.Env):
    """One task on one simulated robot unit: the options, spaces, action check and latency queue of every
    fleetmind env (subclasses: ``MetaWorldEnv``, ``SO100Env``).

    Observation: ``observation.state`` (4,) float32, ``observation.environment_state`` (17,) float32 and, with
    ``obs.images``, ``observation.images.<camera>`` (H, W, 3) uint8 per configured camera. Action: (4,) float32
    in [-1, 1] (end-effector displacement x, y, z and the gripper).
    """

    CAMERAS: tuple[str, ...] = ()
    """The camera names this embodiment's model defines."""
    ROTATED_CAMERAS: frozenset[str] = frozenset()
    """Cameras whose raw render is rolled 180 degrees in this model (rendered upright by turning them back)."""
    BASE_BODY: str = "base"
    """The robot's base body: ``observation.point_cloud`` is in its frame."""
    POINT_CROP: tuple[tuple[float, float, float], tuple[float, float, float]] = ((-1.0, -1.0, 0.005), (1.0, 1.0, 1.0))
    """The workspace box of the point cloud in the base frame, metres: (lower corner, upper corner)."""
    FAMILY: str = "sim"
    """The embodiment's name in messages (``Meta-World``, ``SO-100``)."""
    DEFAULT_MAX_EPISODE_STEPS: int = 500
    """Episode length when ``task.max_episode_steps`` is not given."""
    MAX_EPISODE_STEPS: int | None = None
    """The longest episode the simulator allows (None: no limit)."""
    control_hz: float = 0.0
    """Control steps per second, Hz (each embodiment's env sets it; recorded with every stored episode)."""

    def _options(self, obs_cfg: Any, task_cfg: Any, render_mode: str | None) -> None:
        """Parse the ``obs`` options (``images``, ``cameras``, ``image_size`` int or [H, W] pixels, renderer
        ``shadows`` / ``reflections`` / ``shadowsize``), the ``task`` options (``max_episode_steps``,
        ``steps_after_success``) and ``render_mode``.

        Raises:
            ValueError: an unknown camera (the valid ones listed), images without a camera, a bad image size,
                episode length or render mode.
        """
        ocfg = as_dict(obs_cfg)
        self.images = bool(ocfg.get("images", False))
        self.embodiment_feature = bool(ocfg.get("embodiment_feature", False))
        self.cameras = list(ocfg.get("cameras", ["corner"]) or [])
        size = ocfg.get("image_size", 96)
        self.image_hw = (int(size), int(size)) if np.isscalar(size) else tuple(int(s) for s in size)
        if len(self.image_hw) != 2 or min(self.image_hw) <= 0:
            raise ValueError(f"obs.image_size: expected a positive int or [height, width], given {size!r}")
        for c in self.cameras:
            if c not in self.CAMERAS:
                raise ValueError(f"unknown camera {c!r}; valid {self.FAMILY} cameras: {', '.join(self.CAMERAS)}")
        if self.images and not self.cameras:
            raise ValueError(f"obs.images is true but obs.cameras is empty; name at least one of "
                             f"{', '.join(self.CAMERAS)}")
        self.cloud_spec = None
        if bool(ocfg.get("point_cloud", False)):
            from sim.pointcloud import CloudSpec

            psize = ocfg.get("point_image_size", 64)
            phw = (int(psize), int(psize)) if np.isscalar(psize) else tuple(int(s) for s in psize)
            for c in ocfg.get("point_cameras", ["corner"]) or []:
                if c not in self.CAMERAS:
                    raise ValueError(f"obs.point_cameras: unknown camera {c!r}; valid {self.FAMILY} cameras: "
                                     f"{', '.join(self.CAMERAS)}")
            lo = ocfg.get("crop_min") or self.POINT_CROP[0]
            hi = ocfg.get("crop_max") or self.POINT_CROP[1]
            self.cloud_spec = CloudSpec(tuple(ocfg.get("point_cameras", ["corner"]) or ()), phw,
                                        int(ocfg.get("num_points", 512)), tuple(float(x) for x in lo),
                                        tuple(float(x) for x in hi), self.BASE_BODY,
                                        color=bool(ocfg.get("point_color", False)))
        self._render_kw = {"shadows": bool(ocfg.get("shadows", False)),
                           "reflections": bool(ocfg.get("reflections", False)),
                           "shadowsize": int(ocfg.get("shadowsize", 256))}
        tcfg = as_dict(task_cfg)
        self.max_episode_steps = int(tcfg.get("max_episode_steps", self.DEFAULT_MAX_EPISODE_STEPS))
        by = tcfg.get("max_episode_steps_by_embodiment") or {}
        if self.unit.embodiment in by:   # a mixed fleet: each robot's own episode length (set self.unit first)
            self.max_episode_steps = int(by[self.unit.embodiment])
        self.steps_after_success = int(tcfg.get("steps_after_success", TaskConfig.steps_after_success))
        self.stop_on_success = bool(tcfg.get("stop_on_success", True))
        limit = self.MAX_EPISODE_STEPS
        if self.max_episode_steps < 1 or (limit is not None and self.max_episode_steps > limit):
            raise ValueError(f"task.max_episode_steps: expected 1..{limit if limit is not None else 'inf'}"
                             + (f" ({self.FAMILY}'s limit)" if limit is not None else "")
                             + f", given {self.max_episode_steps}")
        self._episode_steps = self.max_episode_steps   # restored by every reset (continue_episode changes it)
        if self.steps_after_success < 0:
            raise ValueError(f"task.steps_after_success: expected >= 0, given {self.steps_after_success}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode: expected None or 'rgb_array', given {render_mode!r}")
        self.render_mode = render_mode

    def _spaces(self, model) -> None:
        """The observation and action spaces; with ``obs.images``, the renderer of ``model`` (an ``MjModel``).

        Raises:
            RuntimeError: images requested but no offscreen GL backend works (``sim.gl``).
        """
        obs_spaces = {"observation.state": spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32),
                      "observation.environment_state": spaces.Box(-np.inf, np.inf, (ENV_STATE_DIM,), np.float32)}
        self._renderer: CameraRenderer | None = None
        if self.embodiment_feature:
            obs_spaces["observation.embodiment"] = spaces.Box(0.0, 1.0, (len(EMBODIMENTS),), np.float32)
        if self.images:
            for c in self.cameras:
                obs_spaces[f"observation.images.{c}"] = spaces.Box(0, 255, (*self.image_hw, 3), np.uint8)
            self._renderer = CameraRenderer(model, *self.image_hw, rotated=self.ROTATED_CAMERAS, **self._render_kw)
        self._cloud = None
        if self.cloud_spec is not None:
            from sim.pointcloud import DepthPointCloud

            obs_spaces["observation.point_cloud"] = spaces.Box(-np.inf, np.inf, (self.cloud_spec.num_points, 3),
                                                               np.float32)
            if self.cloud_spec.color:
                obs_spaces["observation.point_colors"] = spaces.Box(0, 255, (self.cloud_spec.num_points, 3), np.uint8)
            self._cloud = DepthPointCloud(model, self.cloud_spec)
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self._t, self._done, self._first_success, self._unstable = 0, True, None, False
        self._first_reset_pending = True
        self._queue: deque = deque()
        self._monitor = StepMonitor()
        self._noise_rng = np.random.default_rng(0)

    def _with_embodiment(self, obs: dict) -> dict:
        """``obs`` with ``observation.embodiment`` (``sim.units.embodiment_onehot`` of this unit's embodiment)
        when ``obs.embodiment_feature`` is on."""
        if self.embodiment_feature:
            obs["observation.embodiment"] = embodiment_onehot(self.unit.embodiment)
        return obs

    def _spec_with_embodiment(self, spec: dict) -> dict:
        """``spec`` with the ``observation.embodiment`` entry when ``obs.embodiment_feature`` is on, and the
        ``observation.point_cloud`` entry with ``obs.point_cloud``."""
        if self.embodiment_feature:
            spec = {**spec, "observation.embodiment": embodiment_spec()}
        if self.cloud_spec is not None:
            from sim.pointcloud import GRID_M

            cs = self.cloud_spec
            spec = {**spec, "observation.point_cloud": {
                "shape": [cs.num_points, 3], "dtype": "float32", "names": ["point", "xyz"], "grid_m": GRID_M,
                "unit": f"m, the robot's base frame ({cs.base_body}); depth cameras {list(cs.cameras)} at "
                        f"{cs.image_hw[0]}x{cs.image_hw[1]}, cropped to {list(cs.crop_min)}..{list(cs.crop_max)}, "
                        "farthest-point sampled"}}
            if cs.color:
                spec["observation.point_colors"] = {
                    "shape": [cs.num_points, 3], "dtype": "uint8", "names": ["point", "rgb"],
                    "unit": "RGB 0..255 of each point of observation.point_cloud (row i: point i), from its depth "
                            "camera's depth-aligned colour image"}
        return spec

    def _with_cloud(self, obs: dict, model, data) -> dict:
        """``obs`` with ``observation.point_cloud`` (and ``observation.point_colors`` with ``obs.point_color``) of the
        current ``data`` when ``obs.point_cloud`` is on."""
        if self._cloud is not None:
            obs.update(self._cloud.observation(data))
        return obs

    def _start_episode(self, latency_steps: int) -> None:
        """A new episode: step 0, no success yet, ``latency_steps`` hold actions queued."""
        self._queue = deque([HOLD_ACTION.copy() for _ in range(latency_steps)])
        self._first_reset_pending = False
        self.max_episode_steps = self._episode_steps
        self._t, self._first_success, self._done, self._unstable = 0, None, False, False

    def _ends(self) -> tuple[bool, bool]:
        """``(terminated, truncated)`` after this step: terminated ``steps_after_success`` steps after the first
        success when ``stop_on_success`` (``task.stop_on_success``; false: the simulator's success never ends an
        episode, a deployment's success detector does), truncated at ``max_episode_steps`` steps."""
        terminated = (self.stop_on_success and self._first_success is not None
                      and self._t - self._first_success >= self.steps_after_success)
        return bool(terminated), bool(not terminated and self._t >= self.max_episode_steps)

    def continue_episode(self, max_steps: int) -> None:
        """Start a new episode from the state where the last one ended, without a reset: nothing in the world
        moves back (what a real robot can do after a failure: keep trying from where it is). The step count and
        the success record start anew; the physics, the objects, the unit's pending actions and its observation
        noise stream go on.

        Args:
            max_steps: the new episode's length at most, control steps (>= 1).

        Raises:
            RuntimeError: no episode has started since the env was made (``reset()`` first), or the last one
                ended in a simulator fault (``sim_unstable``: the world is no longer the episode's).
            ValueError: ``max_steps < 1``.
        """
        if int(max_steps) < 1:
            raise ValueError(f"continue_episode: expected max_steps >= 1, given {max_steps}")
        if self._unstable or self._first_reset_pending:
            raise RuntimeError(f"{self.task} unit {self.unit.unit_id}: no episode to continue "
                               "(call reset(); a diverged simulation cannot be continued)")
        self.max_episode_steps = int(max_steps)
        self._t, self._first_success, self._done = 0, None, False

    def _command(self, action) -> tuple[np.ndarray, np.ndarray]:
        """Check, clip and queue ``action``: returns ``(command, executed)``, both (4,) float32: the command
        taken this step (clipped to [-1, 1]; what the store keeps) and the one the unit's latency lets execute
        now.

        Raises:
            RuntimeError: no episode running (``reset()`` not called since the last one ended).
            ValueError: action not of shape (4,) or not finite.
        """
        if self._done:
            raise RuntimeError(f"{self.task} unit {self.unit.unit_id}: call reset() before step() "
                               "(no episode running, or the last one ended)")
        a = np.asarray(action, dtype=np.float32)
        if a.shape != (ACTION_DIM,):
            raise ValueError(f"action: expected shape (4,) [dx, dy, dz, gripper], given {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"action: expected finite values, given {a}")
        command = np.clip(a, -1.0, 1.0)
        self._queue.append(command)
        return command, self._queue.popleft()

    def _render_first_camera(self, model, data) -> np.ndarray | None:
        """``render()``: (H, W, 3) uint8 image of the first configured camera (``corner`` when none) with
        ``render_mode='rgb_array'``, else None."""
        if self.render_mode != "rgb_array":
            return None
        if self._renderer is None:
            self._renderer = CameraRenderer(model, *self.image_hw, rotated=self.ROTATED_CAMERAS, **self._render_kw)
        return self._renderer.render(data, (self.cameras or ["corner"])[0])

    def _close_renderer(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        if getattr(self, "_cloud", None) is not None:
            self._cloud.close()
            self._cloud = None

    @property
    def pending_actions(self) -> np.ndarray:
        """Actions given but not yet executed because of the unit's latency, oldest first; (L, 4) float32."""
        return np.array(list(self._queue), dtype=np.float32).reshape(-1, ACTION_DIM)
