"""Bridge between a LeRobot SO-100/SO-101 arm and a fleetmind policy: feature names, units and kinematics.

Plain dicts in, plain dicts out: this module does not import LeRobot (``fleet.deploy.deployer`` and
``fleet.deploy.so100_sim_robot`` do), only numpy, MuJoCo and mink (through the SO-100 twin's model and IK).

LeRobot side (``so100_follower`` / ``so101_follower`` with ``use_degrees=True``, LeRobot 0.6.1's
``lerobot/robots/so_follower/so_follower.py``): observation and action features ``<joint>.pos`` for
``shoulder_pan, shoulder_lift, elbow_flex, wrist_flex, wrist_roll`` in degrees and ``gripper.pos`` in 0..100,
plus one ``(H, W, 3)`` uint8 image per camera name. The simulated robot ``fleetmind_so100_sim`` also gives the
sim-only features ``sim.<name>`` (floats) for the 17 ``observation.environment_state`` names of the twin.

Policy side (the twin's contract, ``sim/so100/env.py``): ``observation.state`` = [ee_x, ee_y, ee_z, gripper]
(tcp position in metres in the twin's world frame, gripper opening 0 closed .. 1 open),
``observation.environment_state`` (17,), ``observation.images.<camera>`` (H, W, 3) uint8, for a mixed fleet's
policy ``observation.embodiment`` (the one-hot of ``so100``, constant), and the action
[dx, dy, dz, gripper] (tcp target displacement, 1 cm per unit; gripper -1 open .. +1 closed).

Joint naming and units (``JointMap``): LeRobot joint ``i`` in degrees = ``sign_i * degrees(q_i) + offset_i`` where
``q_i`` is the MJCF joint in radians:

    shoulder_pan <-> Rotation, shoulder_lift <-> Pitch, elbow_flex <-> Elbow, wrist_flex <-> Wrist_Pitch,
    wrist_roll <-> Wrist_Roll, gripper <-> Jaw

The default (sign +1, offset 0) is the convention of the simulated robot. A real arm calibrated by LeRobot
puts 0 degrees at the middle of each joint's recorded range of motion, so its signs and offsets must be measured
once (put the arm in the twin's home pose, ``SO100Env`` keyframe ``home``: pan 0, lift -90, elbow 90, wrist flex
90, roll 0 degrees, and read ``<joint>.pos``). ``gripper.pos`` maps linearly to the opening:
``opening = (pos - gripper_closed_pos) / (gripper_open_pos - gripper_closed_pos)``; the simulated robot maps
0..100 onto the twin's jaw angles ``JAW_CLOSED .. JAW_OPEN``.

End-effector actions to joint targets: ``SO100Bridge.propose`` runs the twin's own controller
(``sim.so100.env.EEDeltaController``: target += action x 1 cm, 3 cm leash to the tcp measured by forward
kinematics, workspace clip, mink differential IK from the last sent joints) on the SO-100 MJCF model, so a
policy trained in the twin gets the same joint targets on the LeRobot robot as in the twin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fleet.deploy.safety import EventLog, SafetyEvent
from policies.features import POINT_CLOUD, POINT_COLORS
from sim.units import EMBODIMENTS, embodiment_onehot

LEROBOT_ARM_JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll")
LEROBOT_JOINTS = (*LEROBOT_ARM_JOINTS, "gripper")
MOTOR_KEYS = tuple(f"{j}.pos" for j in LEROBOT_JOINTS)
SIM_PREFIX = "sim."   # sim-only observation features of fleetmind_so100_sim (object state)
EE_ACTION_NAMES = ["dx", "dy", "dz", "gripper"]
STATE_KEY, ENV_STATE_KEY, IMAGE_PREFIX = "observation.state", "observation.environment_state", "observation.images."
CLOUD_KEY, COLORS_KEY = POINT_CLOUD, POINT_COLORS   # from the robot's depth cameras and their aligned colour images
# a robot's depth image feature, LeRobot's naming (``so_follower`` with a RealSense ``use_depth``): "<camera>_depth",
# (H, W, 1) (or (H, W)) in its calibration's depth units (a RealSense: uint16 millimetres, depth_scale 0.001; the twin:
# float32 metres, depth_scale 1)
DEPTH_SUFFIX = "_depth"
DEPTH_RGB_SUFFIX = "_depth_rgb"   # "<camera>_depth_rgb": (H, W, 3) uint8, the colour image aligned to "<camera>_depth"
EMBODIMENT_KEY = "observation.embodiment"   # a mixed fleet's policy is told its robot (sim.units.embodiment_onehot)


def _env():
    from sim.so100 import env  # MuJoCo + mink, imported when a bridge is built

    return env


@dataclasses.dataclass
class JointMap:
    """LeRobot joint units <-> SO-100 MJCF joints (see the module doc).

    Attributes:
        signs: (5,) +1 or -1 per arm joint (``LEROBOT_ARM_JOINTS`` order).
        offsets_deg: (5,) degrees added after the sign.
        gripper_closed_pos / gripper_open_pos: ``gripper.pos`` values of a closed and an open (twin ``JAW_OPEN``)
            gripper.
    Raises:
        ValueError: wrong lengths, a sign not +-1, equal gripper positions.
    """

    signs: Sequence[float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    offsets_deg: Sequence[float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    gripper_closed_pos: float = 0.0
    gripper_open_pos: float = 100.0

    def __post_init__(self) -> None:
        self.signs = np.asarray(self.signs, dtype=np.float64).reshape(-1)
        self.offsets_deg = np.asarray(self.offsets_deg, dtype=np.float64).reshape(-1)
        if self.signs.shape != (5,) or not np.all(np.isin(self.signs, (-1.0, 1.0))):
            raise ValueError(f"joint_signs: expected 5 values of +1 or -1 for {list(LEROBOT_ARM_JOINTS)}, "
                             f"given {self.signs.tolist()}")
        if self.offsets_deg.shape != (5,) or not np.all(np.isfinite(self.offsets_deg)):
            raise ValueError(f"joint_offsets_deg: expected 5 finite values for {list(LEROBOT_ARM_JOINTS)}, "
                             f"given {self.offsets_deg.tolist()}")
        if self.gripper_open_pos == self.gripper_closed_pos:
            raise ValueError(f"gripper_open_pos and gripper_closed_pos must differ, both are {self.gripper_open_pos}")

    def arm_to_robot(self, q_rad: np.ndarray) -> np.ndarray:
        """(..., 5) MJCF arm joints, radians -> LeRobot degrees."""
        return self.signs * np.rad2deg(np.asarray(q_rad, dtype=np.float64)) + self.offsets_deg

    def arm_to_mjcf(self, deg: np.ndarray) -> np.ndarray:
        """(..., 5) LeRobot degrees -> MJCF arm joints, radians."""
        return np.deg2rad((np.asarray(deg, dtype=np.float64) - self.offsets_deg) * self.signs)

    def opening_from_pos(self, pos: float) -> float:
        """``gripper.pos`` -> opening (0 closed .. 1 open), not clipped."""
        return (float(pos) - self.gripper_closed_pos) / (self.gripper_open_pos - self.gripper_closed_pos)

    def pos_from_opening(self, opening: float) -> float:
        """Opening (0 closed .. 1 open) -> ``gripper.pos``."""
        return self.gripper_closed_pos + float(opening) * (self.gripper_open_pos - self.gripper_closed_pos)

    def pos_from_command(self, command: float) -> float:
        """Policy gripper command (-1 open .. +1 closed) -> ``gripper.pos`` target."""
        return self.pos_from_opening((1.0 - float(command)) / 2.0)

    def limits(self) -> np.ndarray:
        """(6, 2) [low, high] per LeRobot joint from the SO-100 MJCF joint ranges (sign flips swap the ends);
        the gripper from ``gripper_closed_pos`` to ``gripper_open_pos`` widened to LeRobot's 0..100."""
        env = _env()
        model = SO100Kinematics.shared().model
        rng = np.array([model.joint(f"so_arm100_right/{j}").range for j in env.ARM_JOINTS])  # (5, 2) rad
        ends = self.arm_to_robot(rng.T).T  # (5, 2)
        g = sorted((self.gripper_closed_pos, self.gripper_open_pos))
        return np.vstack([np.sort(ends, axis=1), [[min(g[0], 0.0), max(g[1], 100.0)]]])


class SO100Kinematics:
    """Forward kinematics of the SO-100 tcp on the twin's MJCF model (``sim.so100.env.build_model``).

    ``fk(q_arm_rad (5,)) -> (3,)`` tcp position in metres (the twin's world frame); the other joints stay at the
    ``home`` keyframe. ``home_qpos`` (nq,), ``home_rot`` (3, 3) and ``arm_idx`` (5,) feed the EE controller.
    """

    _shared: SO100Kinematics | None = None

    def __init__(self) -> None:
        import mujoco

        env = _env()
        self._mj = mujoco
        self.model = env.build_model()
        self.data = mujoco.MjData(self.model)
        mujoco.mj_resetDataKeyframe(self.model, self.data, 0)
        mujoco.mj_forward(self.model, self.data)
        self.arm_idx = np.array([self.model.joint(f"so_arm100_right/{j}").qposadr[0] for j in env.ARM_JOINTS])
        self.tcp_site = self.model.site("tcp").id
        self.home_qpos = self.data.qpos.copy()
        self.home_rot = self.data.site_xmat[self.tcp_site].reshape(3, 3).copy()

    @classmethod
    def shared(cls) -> SO100Kinematics:
        """One instance per process (model compilation takes ~0.1 s)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def fk(self, q_arm_rad: np.ndarray) -> np.ndarray:
        q = np.asarray(q_arm_rad, dtype=np.float64)
        if q.shape != (5,):
            raise ValueError(f"fk: expected 5 arm joint angles (rad), given shape {q.shape}")
        self.data.qpos[self.arm_idx] = q
        self._mj.mj_kinematics(self.model, self.data)
        return self.data.site_xpos[self.tcp_site].copy()


def _depth_image(obs: Mapping[str, Any], key: str) -> np.ndarray:
    """(H, W) depth image of ``obs[key]`` given as (H, W) or LeRobot's (H, W, 1).

    Raises:
        KeyError: ``obs`` lacks ``key``. ValueError: another shape."""
    if key not in obs:
        raise KeyError(f"robot observation lacks depth image {key!r} (keys given: {sorted(obs)})")
    d = np.asarray(obs[key])
    if d.ndim == 3 and d.shape[2] == 1:
        d = d[..., 0]
    if d.ndim != 2:
        raise ValueError(f"depth image {key!r}: expected (H, W) or (H, W, 1), given {d.shape}")
    return d


def sim_feature_names() -> list[str]:
    """The sim-only observation features of ``fleetmind_so100_sim``: ``sim.<name>`` for the twin's 17
    ``observation.environment_state`` names (metres; quaternion entries unitless)."""
    return [SIM_PREFIX + n for n in _env().ENV_STATE_NAMES]


class SO100Bridge:
    """Maps one LeRobot SO-100/SO-101 robot to one exported fleetmind policy and back.

    Args:
        input_shapes: the policy's observation features ``{name: shape}`` (``PolicyRuntime.input_shapes``).
        action_names: the policy's action names (``export.json`` ``features.action.names``); must be the
            end-effector actions ``EE_ACTION_NAMES``.
        joint_map: LeRobot <-> MJCF joint convention (default: the simulated robot's).
        cameras: ``{policy camera: robot camera}`` for ``observation.images.<policy camera>`` (default: same name).
        action_scale_m: metres of tcp target motion per action unit, one value or (3,) per axis (default: the
            twin's ``ACTION_SCALE_M``; ``set_action_scale`` changes it between episodes).
        events: the deploy loop's ``EventLog`` (``action_range`` events are added to it).
        depth_cameras: for a policy reading ``observation.point_cloud``: ``{robot camera: calibration}`` (a
            ``sim.pointcloud.DepthCamera`` or its ``to_dict``: intrinsics, the optical frame's pose in the arm's base
            frame, depth units); the robot gives ``"<camera>_depth"`` images (the twin robot
            ``fleetmind_so100_sim`` with ``depth_cameras``, and its ``depth_calibration()``). The cloud is made as
            the fleet's envs make it (``sim.pointcloud.cloud_from_depth``, the twin's workspace box).
        crop_min, crop_max: the cloud's workspace box (base frame, metres); None: the twin's ``POINT_CROP``.
    Raises:
        ValueError: actions that are not end-effector deltas, an unsupported observation feature.
    """

    def __init__(self, input_shapes: Mapping[str, Sequence[int]], action_names: Sequence[str],
                 joint_map: JointMap | None = None, cameras: Mapping[str, str] | None = None,
                 action_scale_m: float | None = None, events: EventLog | None = None,
                 depth_cameras: Mapping[str, Any] | None = None, crop_min: Sequence[float] | None = None,
                 crop_max: Sequence[float] | None = None) -> None:
        env = _env()
        self.input_shapes = {k: [int(s) for s in v] for k, v in input_shapes.items()}
        if list(action_names) != EE_ACTION_NAMES:
            raise ValueError(f"the policy's actions are {list(action_names)}; the SO-100 bridge maps end-effector "
                             f"actions {EE_ACTION_NAMES} (export.json features.action.names) to joint targets")
        for k, shape in self.input_shapes.items():
            if k == STATE_KEY and shape != [4]:
                raise ValueError(f"policy feature {k!r}: expected shape [4] {env.STATE_NAMES}, given {shape}")
            if k == ENV_STATE_KEY and shape != [len(env.ENV_STATE_NAMES)]:
                raise ValueError(f"policy feature {k!r}: expected shape [{len(env.ENV_STATE_NAMES)}], given {shape}")
            if k == EMBODIMENT_KEY and shape != [len(EMBODIMENTS)]:
                raise ValueError(f"policy feature {k!r}: expected shape [{len(EMBODIMENTS)}] (one-hot over "
                                 f"{list(EMBODIMENTS)}), given {shape}")
            if k == CLOUD_KEY and (len(shape) != 2 or shape[1] != 3):
                raise ValueError(f"policy feature {k!r}: expected shape [N, 3], given {shape}")
            if k == COLORS_KEY and (shape != list(self.input_shapes.get(CLOUD_KEY, [None, 3]))):
                raise ValueError(f"policy feature {k!r}: expected the shape of {CLOUD_KEY!r} "
                                 f"({self.input_shapes.get(CLOUD_KEY)}), given {shape}")
            if k not in (STATE_KEY, ENV_STATE_KEY, EMBODIMENT_KEY, CLOUD_KEY, COLORS_KEY) \
                    and not k.startswith(IMAGE_PREFIX):
                raise ValueError(f"policy feature {k!r} has no mapping to an SO-100 robot; the bridge maps "
                                 f"{STATE_KEY!r}, {ENV_STATE_KEY!r} (simulated robot only), {EMBODIMENT_KEY!r} "
                                 f"(constant: so100), {CLOUD_KEY!r} and {COLORS_KEY!r} (depth cameras) and "
                                 f"'{IMAGE_PREFIX}<camera>'")
        from sim.pointcloud import DepthCamera

        self.depth_cameras = {str(c): v if isinstance(v, DepthCamera) else DepthCamera.from_dict(dict(v))
                              for c, v in (depth_cameras or {}).items()}
        if CLOUD_KEY in self.input_shapes and not self.depth_cameras:
            raise ValueError(f"the policy reads {CLOUD_KEY!r}: give the robot's depth cameras and their calibration "
                             "(deploy.bridge.depth_cameras={<camera>: {fx, fy, cx, cy, base_from_camera, "
                             "depth_scale}}; the twin robot's: FleetmindSO100Sim.depth_calibration())")
        self.crop = (tuple(crop_min or env.SO100Env.POINT_CROP[0]), tuple(crop_max or env.SO100Env.POINT_CROP[1]))
        self.joint_map = joint_map or JointMap()
        self.cameras = {k[len(IMAGE_PREFIX):]: k[len(IMAGE_PREFIX):] for k in self.input_shapes
                        if k.startswith(IMAGE_PREFIX)}
        for cam, robot_cam in (cameras or {}).items():
            if cam not in self.cameras:
                raise ValueError(f"bridge camera mapping names policy camera {cam!r}, but the policy reads "
                                 f"cameras {sorted(self.cameras)}")
            self.cameras[cam] = str(robot_cam)
        self.kin = SO100Kinematics.shared()
        scale = env.ACTION_SCALE_M if action_scale_m is None else _scale3(action_scale_m)
        self.controller = env.EEDeltaController(self.kin.model, self.kin.home_qpos, self.kin.home_rot,
                                                self.kin.arm_idx, scale)
        self.events = events if events is not None else EventLog()
        self._sim_names = sim_feature_names()

    # ------------------------------------------------------------------ checks
    def required_observation_features(self) -> dict[str, Any]:
        """LeRobot observation features this policy needs: ``{name: float | (H, W, 3) | None (any size)}``."""
        need: dict[str, Any] = dict.fromkeys(MOTOR_KEYS, float)
        if ENV_STATE_KEY in self.input_shapes:
            need.update(dict.fromkeys(self._sim_names, float))
        for robot_cam in self.cameras.values():
            need[robot_cam] = None
        if CLOUD_KEY in self.input_shapes:
            need.update({c + DEPTH_SUFFIX: None for c in self.depth_cameras})
        if COLORS_KEY in self.input_shapes:
            need.update({c + DEPTH_RGB_SUFFIX: None for c in self.depth_cameras})
        return need

    def check_robot(self, observation_features: Mapping[str, Any], action_features: Mapping[str, Any],
                    robot_type: str = "robot") -> None:
        """Raise ValueError naming what the robot lacks for this policy (features, cameras, action keys)."""
        missing_motors = [k for k in MOTOR_KEYS if k not in observation_features]
        if missing_motors:
            raise ValueError(f"robot type {robot_type!r} gives no joint readings {missing_motors}; the SO-100 "
                             f"bridge needs {list(MOTOR_KEYS)} (an SO-100/SO-101 follower)")
        missing_actions = [k for k in MOTOR_KEYS if k not in action_features]
        if missing_actions:
            raise ValueError(f"robot type {robot_type!r} accepts no actions {missing_actions}; the SO-100 bridge "
                             f"sends {list(MOTOR_KEYS)}")
        if ENV_STATE_KEY in self.input_shapes:
            lacks = [k for k in self._sim_names if k not in observation_features]
            if lacks:
                raise ValueError(f"the export reads {ENV_STATE_KEY!r} (the object state), which robot type "
                                 f"{robot_type!r} does not provide (it lacks {lacks[:3]}...); only the simulated "
                                 "robot 'fleetmind_so100_sim' does. On a real arm deploy a policy trained without it "
                                 "(scripts/train.py obs=vision policy=aed_diffusion_image "
                                 "'policy.input_keys=[observation.state,observation.images.<camera>]')")
        if CLOUD_KEY in self.input_shapes:
            lacks = [c + DEPTH_SUFFIX for c in self.depth_cameras if c + DEPTH_SUFFIX not in observation_features]
            if lacks:
                raise ValueError(f"the export reads {CLOUD_KEY!r} from depth images {lacks}, which robot type "
                                 f"{robot_type!r} does not give (its features: {sorted(observation_features)})")
        if COLORS_KEY in self.input_shapes:
            lacks = [c + DEPTH_RGB_SUFFIX for c in self.depth_cameras
                     if c + DEPTH_RGB_SUFFIX not in observation_features]
            if lacks:
                raise ValueError(f"the export reads {COLORS_KEY!r} from depth-aligned colour images {lacks}, which "
                                 f"robot type {robot_type!r} does not give (the twin: depth_color=true; a RealSense: "
                                 "its colour stream aligned to depth)")
        for cam, robot_cam in self.cameras.items():
            shape = observation_features.get(robot_cam)
            if not (isinstance(shape, tuple) and len(shape) == 3 and shape[2] == 3):
                cams = [k for k, v in observation_features.items() if isinstance(v, tuple)]
                raise ValueError(f"the export reads '{IMAGE_PREFIX}{cam}' from robot camera {robot_cam!r}, which "
                                 f"robot type {robot_type!r} does not have (its cameras: {cams}); map it with "
                                 f"deploy.bridge.cameras={{{cam}: <robot camera>}}")

    # ------------------------------------------------------------------ observations
    def joints(self, obs: Mapping[str, Any]) -> np.ndarray:
        """(6,) float64 joint readings in LeRobot units (``LEROBOT_JOINTS`` order). KeyError names a missing one."""
        try:
            return np.array([float(obs[k]) for k in MOTOR_KEYS])
        except KeyError as e:
            raise KeyError(f"robot observation lacks {e.args[0]!r} (keys given: {sorted(obs)})") from None

    def fk(self, joints: np.ndarray) -> np.ndarray:
        """(6,) LeRobot joints -> (3,) tcp position, metres (the twin's world frame)."""
        return self.kin.fk(self.joint_map.arm_to_mjcf(np.asarray(joints)[:5]))

    def policy_observation(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """LeRobot observation -> the policy's observation dict (float32 vectors, uint8 (H, W, 3) images;
        camera images of another size are resized bilinearly with Pillow)."""
        out: dict[str, np.ndarray] = {}
        j = self.joints(obs)
        if STATE_KEY in self.input_shapes:
            out[STATE_KEY] = np.array([*self.fk(j), self.joint_map.opening_from_pos(j[5])], dtype=np.float32)
        if ENV_STATE_KEY in self.input_shapes:
            out[ENV_STATE_KEY] = np.array([float(obs[k]) for k in self._sim_names], dtype=np.float32)
        if EMBODIMENT_KEY in self.input_shapes:   # a mixed fleet's policy: this robot is an SO-100
            out[EMBODIMENT_KEY] = embodiment_onehot("so100")
        if CLOUD_KEY in self.input_shapes:   # the fleet's path from depth images to the cloud (sim.pointcloud)
            from sim.pointcloud import cloud_from_depth

            cams = list(self.depth_cameras)
            colors = ([np.asarray(obs[c + DEPTH_RGB_SUFFIX], dtype=np.uint8) for c in cams]
                      if COLORS_KEY in self.input_shapes else None)
            cloud = cloud_from_depth([_depth_image(obs, c + DEPTH_SUFFIX) for c in cams],
                                     [self.depth_cameras[c] for c in cams], *self.crop,
                                     self.input_shapes[CLOUD_KEY][0], colors=colors)
            if colors is None:
                out[CLOUD_KEY] = cloud
            else:
                out[CLOUD_KEY], out[COLORS_KEY] = cloud
        for cam, robot_cam in self.cameras.items():
            img = np.asarray(obs[robot_cam])
            h, w, _ = self.input_shapes[IMAGE_PREFIX + cam]
            if img.shape[:2] != (h, w):
                from PIL import Image

                img = np.asarray(Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8)).resize(
                    (w, h), Image.BILINEAR))
            out[IMAGE_PREFIX + cam] = np.ascontiguousarray(img, dtype=np.uint8)
        return out

    # ------------------------------------------------------------------ actions
    def reset(self, obs: Mapping[str, Any]) -> None:
        """Episode start: the EE controller starts from the measured joints and tcp."""
        j = self.joints(obs)
        self.controller.reset(self.joint_map.arm_to_mjcf(j[:5]), self.fk(j))

    def propose(self, action: np.ndarray, obs: Mapping[str, Any], step: int = 0) -> np.ndarray:
        """Policy action (4,) -> proposed joint targets (6,) in LeRobot units, for the safety filter.

        A non-finite action gives NaN targets (the controller's state is left untouched); an action outside
        [-1, 1] is clipped as the twin does and logged as an ``action_range`` event.
        """
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (4,):
            raise ValueError(f"policy action: expected shape (4,) {EE_ACTION_NAMES}, given {a.shape}")
        if not np.all(np.isfinite(a)):
            return np.full(6, np.nan)
        if np.any(np.abs(a) > 1.0):
            self.events.add(SafetyEvent(step, "action_range", {"action": a.tolist(), "clipped_to": [-1.0, 1.0]}))
            a = np.clip(a, -1.0, 1.0)
        j = self.joints(obs)
        q_cmd, _jaw = self.controller.step(a, self.fk(j))
        return np.array([*self.joint_map.arm_to_robot(q_cmd), self.joint_map.pos_from_command(a[3])])

    def set_depth_cameras(self, depth_cameras: Mapping[str, Any]) -> None:
        """The depth cameras' calibration from now on ``{robot camera: DepthCamera or its dict}`` (the simulated robot
        built as another fleet unit has its own camera poses: ``FleetmindSO100Sim.depth_calibration()``).

        Raises:
            ValueError: a calibration that does not parse, or other cameras than before."""
        from sim.pointcloud import DepthCamera

        cams = {str(c): v if isinstance(v, DepthCamera) else DepthCamera.from_dict(dict(v))
                for c, v in depth_cameras.items()}
        if self.depth_cameras and list(cams) != list(self.depth_cameras):
            raise ValueError(f"depth cameras {list(cams)}: the bridge reads {list(self.depth_cameras)}")
        self.depth_cameras = cams

    def set_action_scale(self, action_scale_m: float | Sequence[float]) -> None:
        """Metres of tcp target motion per action unit from now on: one value or (3,) per axis (the simulated
        robot built as a fleet unit gives its ``action_scale_m``: the twin's 1 cm times the unit's action gain).

        Raises:
            ValueError: not one or three finite positive values.
        """
        self.controller.scale = _scale3(action_scale_m)

    @property
    def action_scale_m(self) -> np.ndarray:
        """(3,) metres of tcp target motion per action unit, per axis."""
        return self.controller.scale.copy()

    def sent(self, targets: np.ndarray) -> None:
        """Tell the controller what was actually sent (after the safety filter): the IK continues from there."""
        self.controller.q_cmd = self.joint_map.arm_to_mjcf(np.asarray(targets, dtype=np.float64)[:5])

    @staticmethod
    def robot_action(targets: np.ndarray) -> dict[str, float]:
        """(6,) joint targets -> LeRobot action ``{"<joint>.pos": float}``."""
        return {k: float(v) for k, v in zip(MOTOR_KEYS, np.asarray(targets, dtype=np.float64))}


def _scale3(action_scale_m: float | Sequence[float]) -> np.ndarray:
    """One or three metres-per-action-unit values -> (3,) float64. Raises ValueError unless finite and > 0."""
    a = np.asarray(action_scale_m, dtype=np.float64).reshape(-1)
    if a.size not in (1, 3) or not np.all(np.isfinite(a)) or not np.all(a > 0):
        raise ValueError(f"action_scale_m: expected one or three finite values > 0 (metres per action unit), "
                         f"given {action_scale_m!r}")
    return np.broadcast_to(a, (3,)).copy()


# ---------------------------------------------------------------------------------------------- embodiments
@runtime_checkable
class EmbodimentBridge(Protocol):
    """What ``fleet.deploy.deployer.Deployer`` needs from an embodiment's bridge (``SO100Bridge`` is one):
    observation and action mapping between a LeRobot robot and an exported fleetmind policy.

    ``check_robot(observation_features, action_features, robot_type)`` raises ValueError for a robot that cannot
    serve the policy; ``joints(obs)`` -> measured joint vector; ``fk(joints)`` -> tool position (m, for the
    workspace check); ``policy_observation(obs)`` -> the policy's features; ``reset(obs)`` at an episode start;
    ``propose(action, obs, step)`` -> joint targets for one policy action; ``sent(targets)`` records what was
    sent; ``robot_action(targets)`` -> the LeRobot action dict. Optional: ``set_action_scale(metres per action
    unit)``, which the deploy loop calls with a simulated robot unit's ``action_scale_m`` (``SO100Bridge`` has it).
    """

    def check_robot(self, observation_features: Mapping[str, Any], action_features: Mapping[str, Any],
                    robot_type: str) -> None: ...
    def joints(self, obs: Mapping[str, Any]) -> np.ndarray: ...
    def fk(self, joints: np.ndarray) -> np.ndarray: ...
    def policy_observation(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]: ...
    def reset(self, obs: Mapping[str, Any]) -> None: ...
    def propose(self, action: np.ndarray, obs: Mapping[str, Any], step: int = 0) -> np.ndarray: ...
    def sent(self, targets: np.ndarray) -> None: ...
    def robot_action(self, targets: np.ndarray) -> dict[str, float]: ...


BRIDGES: dict[str, Callable[..., EmbodimentBridge]] = {}


def register_bridge(embodiment: str, factory: Callable[..., EmbodimentBridge]) -> None:
    """Register the bridge of an embodiment (``deploy.bridge.embodiment``): ``factory(input_shapes,
    action_names, joint_map=, cameras=, events=)``.

    Raises:
        ValueError: the embodiment already has a bridge.
    """
    if embodiment in BRIDGES:
        raise ValueError(f"register_bridge: embodiment {embodiment!r} already has a bridge ({BRIDGES[embodiment]})")
    BRIDGES[embodiment] = factory


def make_bridge(embodiment: str, input_shapes: Mapping[str, Sequence[int]], action_names: Sequence[str],
                **kw: Any) -> EmbodimentBridge:
    """The bridge of ``embodiment`` for a policy with these features.

    Raises:
        ValueError: no bridge for the embodiment (the message lists the known ones), or the bridge's own checks.
    """
    if embodiment not in BRIDGES:
        raise ValueError(f"deploy.bridge.embodiment: no bridge for {embodiment!r}; known: {sorted(BRIDGES)}")
    return BRIDGES[embodiment](input_shapes, action_names, **kw)


register_bridge("so100", SO100Bridge)   # SO-100 and SO-101 (same kinematics)
