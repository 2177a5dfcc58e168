"""``FleetmindSO100Sim``: a LeRobot ``Robot`` whose arm is the SO-100 MuJoCo twin (``sim.so100.env.SO100Env``).

Same observation and action features and units as LeRobot's ``so101_follower`` (``use_degrees=True``): joint
positions ``<joint>.pos`` in degrees and ``gripper.pos`` in 0..100 (0 = the twin's ``JAW_CLOSED``, 100 =
``JAW_OPEN``), plus one image per rendered camera and, sim-only, the object state ``sim.<name>``.

Time: lock-step. Each ``send_action`` applies the joint targets for one control period of the twin
(1/30 s: 16 physics steps of 1/480 s); the deploy loop paces the calls at the policy's control rate, so the
simulated arm runs in real time under ``scripts/deploy.py`` and as fast as possible in tests.

Robot units (``config.unit_id``, or ``reset_scene(seed, unit_id=...)``): the twin is then built as that unit of the
fleet, exactly as fleetmind's evaluation builds it (``sim.make_env(task, unit_id, robot_cfg)``): its object mass and
friction, cameras, light and colours, and the observation noise of the object state come with the env. Two of the
unit's properties live in the twin's end-effector controller, which a LeRobot robot does not have (the deploy
bridge runs it): its action latency delays every joint target here by the env's ``latency_steps`` control periods
(the first ones hold the arm with the gripper open, as the env's ``HOLD_ACTION`` does), and its action gain is
exposed as ``action_scale_m`` for the bridge's controller (``fleet.deploy.deployer.Deployer`` hands it over at
every episode start). The tcp noise of ``observation.state`` is not reproduced: the bridge computes the state by
forward kinematics from the joint readings.
"""

from __future__ import annotations

import logging
from collections import deque
from functools import cached_property
from typing import Any

import numpy as np
from lerobot.robots.robot import Robot
from lerobot.utils.errors import DeviceAlreadyConnectedError, DeviceNotConnectedError

from fleet.deploy.lerobot_bridge import (
    DEPTH_RGB_SUFFIX,
    DEPTH_SUFFIX,
    MOTOR_KEYS,
    JointMap,
    sim_feature_names,
)
from fleet.deploy.so100_sim_robot.config_fleetmind_so100_sim import ROBOT_TYPE, FleetmindSO100SimConfig

log = logging.getLogger(__name__)
_NEVER = 2**31 - 1  # the deploy loop, not the twin, ends episodes


class FleetmindSO100Sim(Robot):
    """The SO-100 twin behind LeRobot's ``Robot`` API (``connect / get_observation / send_action / disconnect``).

    Sim-only extras (the deploy loop uses them when present): ``reset_scene(seed, unit_id=None)`` places a new
    cube/goal and homes the arm (on another robot unit when given), ``sim_info()`` returns the twin's ``info`` of
    the last step (``success``, ``episode_success``, ``progress``, ``reward``) for the success classifier and the
    store, ``action_scale_m`` the unit's EE action scale for the bridge, ``unit`` / ``unit_id`` /
    ``latency_steps`` the unit played, ``env`` is the ``SO100Env``.

    Raises (from the methods): ``DeviceNotConnectedError`` / ``DeviceAlreadyConnectedError`` as LeRobot's robots;
    ``ValueError`` for an action that lacks a joint or holds NaN/inf.
    """

    config_class = FleetmindSO100SimConfig
    name = ROBOT_TYPE

    def __init__(self, config: FleetmindSO100SimConfig):
        super().__init__(config)
        self.config = config
        self.joint_map = JointMap(config.joint_signs, config.joint_offsets_deg)
        self._limits = self.joint_map.limits()  # (6, 2) the MJCF ranges in LeRobot units
        self.env = None
        self.unit_id: int | None = None if config.unit_id is None else int(config.unit_id)
        self._info: dict[str, Any] = {}
        self._sim_names = sim_feature_names()
        self._pending: deque = deque()   # (q_arm rad (5,), jaw rad) waiting out the unit's action latency
        self._depth: tuple | None = None  # (env, DepthPointCloud) of config.depth_cameras (_depth_sensor)
        self._episode: dict[str, Any] = {}   # this scene's outcome (config.max_steps / result_file)

    # ------------------------------------------------------------------ features
    @cached_property
    def observation_features(self) -> dict[str, type | tuple]:
        s = int(self.config.image_size)
        feats: dict[str, type | tuple] = dict.fromkeys(MOTOR_KEYS, float)
        feats.update({c: (s, s, 3) for c in self.config.render_cameras})
        d = int(self.config.depth_size)
        feats.update({f"{c}{DEPTH_SUFFIX}": (d, d, 1) for c in self.config.depth_cameras})
        if self.config.depth_color:
            feats.update({f"{c}{DEPTH_RGB_SUFFIX}": (d, d, 3) for c in self.config.depth_cameras})
        if self.config.object_state:
            feats.update(dict.fromkeys(self._sim_names, float))
        return feats

    @cached_property
    def action_features(self) -> dict[str, type]:
        return dict.fromkeys(MOTOR_KEYS, float)

    @property
    def control_hz(self) -> float:
        """The twin's control rate (Hz): one ``send_action`` = one control period of physics."""
        from sim.so100.env import CONTROL_HZ

        return float(CONTROL_HZ)

    # ------------------------------------------------------------------ connection
    @property
    def is_connected(self) -> bool:
        return self.env is not None

    def _make_env(self, unit_id: int | None):
        """The twin env of ``config.task``: the nominal twin (unit_id None) or robot unit ``unit_id`` drawn from
        ``config.unit_robot_cfg()``. Raises ValueError for a unit the fleet's robot config does not name."""
        from sim.so100.env import make_so100_env

        cams = list(self.config.render_cameras)
        return make_so100_env(self.config.task, unit_id=0 if unit_id is None else int(unit_id),
                              robot_cfg=None if unit_id is None else self.config.unit_robot_cfg(),
                              obs_cfg={"images": bool(cams), "cameras": cams or None,
                                       "image_size": int(self.config.image_size)},
                              task_cfg={"max_episode_steps": _NEVER, "steps_after_success": _NEVER})

    def connect(self, calibrate: bool = True) -> None:
        """Build the twin (model, renderer; as ``config.unit_id`` when set) and place the first scene
        (``config.seed``)."""
        if self.is_connected:
            raise DeviceAlreadyConnectedError(f"{self} is already connected.")
        self.env = self._make_env(self.unit_id)
        self.reset_scene(self.config.seed)
        log.info("%s connected (task %s, %s)", self, self.config.task,
                 "nominal unit" if self.unit_id is None else f"unit {self.unit_id}")

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        """Nothing to calibrate: the simulated calibration is ``joint_signs`` / ``joint_offsets_deg``."""

    def configure(self) -> None:
        """Nothing to configure."""

    def _check(self) -> None:
        if not self.is_connected:
            raise DeviceNotConnectedError(f"{self.__class__.__name__} is not connected. Run `.connect()` first.")

    def reset_scene(self, seed: int | None = None, unit_id: int | None = None) -> None:
        """Sim-only: home the arm and place a new cube and goal (``seed``: the twin's placement seed, as
        ``SO100Env.reset(seed=...)``); with ``unit_id`` other than the current unit, first rebuild the twin as
        that robot unit (see the module doc; ~0.4 s). Pending latency-delayed targets are dropped.

        Raises:
            ValueError: a unit the fleet's robot config (``config.fleet_robot``) does not name (the twin is kept).
        """
        self._check()
        if unit_id is not None and int(unit_id) != self.unit_id:
            env = self._make_env(int(unit_id))   # raises before the current twin is closed
            self.env.close()
            self.env, self.unit_id = env, int(unit_id)
        _obs, info = self.env.reset(seed=None if seed is None else int(seed))
        self._info = {**info, "reward": 0.0}
        from sim.so100.env import JAW_OPEN

        hold = (self.env.arm_joints, JAW_OPEN)   # the env's HOLD_ACTION: no motion, gripper open
        self._pending = deque([hold] * int(self.env.latency_steps))
        self._episode = {"task": self.config.task, "unit_id": self.unit_id, "seed": None if seed is None else int(seed),
                         "steps": 0, "success": False, "first_success_step": None, "written": False}

    @property
    def episode_over(self) -> bool:
        """Sim-only: ``config.max_steps`` actions were applied to this scene (later ones are not)."""
        return self.config.max_steps is not None and self._episode.get("steps", 0) >= int(self.config.max_steps)

    def episode_result(self) -> dict[str, Any]:
        """Sim-only: this scene's outcome so far ``{"task", "unit_id", "seed", "steps", "success",
        "first_success_step"}`` (the simulator's success, ever reached)."""
        return {k: v for k, v in self._episode.items() if k != "written"}

    def _write_result(self) -> None:
        if self.config.result_file and self._episode and not self._episode["written"]:
            import json
            from pathlib import Path

            path = Path(self.config.result_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(self.episode_result()) + "\n")
            self._episode["written"] = True

    @property
    def unit(self):
        """Sim-only: the twin's ``sim.units.RobotUnit`` (the nominal unit 0 unless built as a unit)."""
        self._check()
        return self.env.unit

    @property
    def latency_steps(self) -> int:
        """Sim-only: control periods every joint target waits before it is applied (the unit's latency)."""
        self._check()
        return int(self.env.latency_steps)

    @property
    def action_scale_m(self) -> np.ndarray:
        """Sim-only: (3,) metres of tcp target motion per policy action unit on this unit (the twin's
        ``ACTION_SCALE_M`` times the unit's per-axis ``action_gain``), for the deploy bridge's EE controller."""
        self._check()
        return np.asarray(self.env.action_scale, dtype=np.float64)

    def sim_info(self) -> dict[str, Any]:
        """Sim-only: the twin's ``info`` of the last step plus ``reward`` (see ``SO100Env.step``)."""
        self._check()
        return dict(self._info)

    # ------------------------------------------------------------------ I/O
    def joint_positions(self) -> np.ndarray:
        """(6,) measured joints in LeRobot units (``MOTOR_KEYS`` order)."""
        arm = self.joint_map.arm_to_robot(self.env.arm_joints)
        return np.array([*arm, self.joint_map.pos_from_opening(self.env.gripper_opening())])

    def get_observation(self) -> dict[str, Any]:
        """``{"<joint>.pos": float, <camera>: (H, W, 3) uint8, "<depth camera>_depth": (H, W, 1) float32 metres (LeRobot's
        depth feature), "<depth camera>_depth_rgb": (H, W, 3) uint8 (with ``depth_color``), "sim.<name>": float}`` of
        the twin now."""
        self._check()
        obs: dict[str, Any] = dict(zip(MOTOR_KEYS, (float(v) for v in self.joint_positions())))
        twin = self.env.observation()
        for c in self.config.render_cameras:
            obs[c] = twin[f"observation.images.{c}"]
        if self.config.object_state:
            obs.update(zip(self._sim_names, (float(v) for v in twin["observation.environment_state"])))
        if self.config.depth_cameras:
            depth = self._depth_sensor()
            if self.config.depth_color:
                colors, depths = depth.rgbd_images(self.env.mj_data)
                obs.update({f"{c}{DEPTH_RGB_SUFFIX}": rgb for c, rgb in zip(depth.spec.cameras, colors)})
            else:
                depths = depth.depth_images(self.env.mj_data)
            obs.update({f"{c}{DEPTH_SUFFIX}": np.asarray(d, np.float32)[..., None]
                        for c, d in zip(depth.spec.cameras, depths)})
        return obs

    def _depth_sensor(self):
        """The twin's depth cameras (``sim.pointcloud.DepthPointCloud`` on the current env's model, made on first
        use and again after ``reset_scene`` rebuilt the twin as another unit): depth images and calibration only."""
        if self._depth is None or self._depth[0] is not self.env:
            from sim.pointcloud import CloudSpec, DepthPointCloud

            lo, hi = self.env.POINT_CROP
            d = int(self.config.depth_size)
            spec = CloudSpec(tuple(self.config.depth_cameras), (d, d), 1, tuple(lo), tuple(hi), self.env.BASE_BODY)
            if self._depth is not None:
                self._depth[1].close()
            self._depth = (self.env, DepthPointCloud(self.env.mj_model, spec))
        return self._depth[1]

    def depth_calibration(self) -> dict[str, dict]:
        """Sim-only: ``{camera: sim.pointcloud.DepthCamera.to_dict()}`` of ``config.depth_cameras`` (intrinsics, the
        optical frame in the arm's base frame, metres; this unit's camera pose): what a real RGB-D sensor's driver
        and hand-eye calibration give the deploy bridge (``deploy.bridge.depth_cameras``)."""
        self._check()
        depth = self._depth_sensor()
        return {c: cam.to_dict() for c, cam in zip(depth.spec.cameras, depth.calibration(self.env.mj_data))}

    def send_action(self, action: dict[str, Any]) -> dict[str, Any]:
        """Joint targets ``{"<joint>.pos": float}`` (degrees; gripper 0..100) for one control period.

        Targets are clipped to the MJCF joint ranges and the gripper to 0..100, as a servo's own limits would;
        the clipped action is returned (LeRobot's contract: "the action actually sent"). On a unit with action
        latency the twin applies the targets sent ``latency_steps`` calls earlier (see the module doc).
        """
        self._check()
        missing = [k for k in MOTOR_KEYS if k not in action]
        if missing:
            raise ValueError(f"{self}: action lacks {missing} (expected keys {list(MOTOR_KEYS)})")
        t = np.array([float(action[k]) for k in MOTOR_KEYS])
        if not np.all(np.isfinite(t)):
            raise ValueError(f"{self}: non-finite joint targets {dict(zip(MOTOR_KEYS, t.tolist()))}")
        t = np.clip(t, self._limits[:, 0], self._limits[:, 1])
        if self.episode_over:   # the trial is over (config.max_steps): the twin holds still
            return dict(zip(MOTOR_KEYS, (float(v) for v in t)))
        from sim.so100.env import JAW_CLOSED, JAW_OPEN

        jaw = JAW_CLOSED + self.joint_map.opening_from_pos(t[5]) * (JAW_OPEN - JAW_CLOSED)
        self._pending.append((self.joint_map.arm_to_mjcf(t[:5]), jaw))
        q_arm, jaw = self._pending.popleft()
        _obs, reward, _term, _trunc, info = self.env.step_joint_targets(q_arm, jaw)
        self._info = {**info, "reward": float(reward)}
        ep = self._episode
        ep["steps"] += 1
        if bool(info.get("success")) and not ep["success"]:
            ep["success"], ep["first_success_step"] = True, ep["steps"]
        if self.episode_over:
            self._write_result()
        return dict(zip(MOTOR_KEYS, (float(v) for v in t)))

    def disconnect(self) -> None:
        """Write the episode's outcome (``config.result_file``) if not yet written; free the renderer and the twin."""
        self._check()
        self._write_result()
        if self._depth is not None:
            self._depth[1].close()
            self._depth = None
        self.env.close()
        self.env = None
        log.info("%s disconnected", self)
