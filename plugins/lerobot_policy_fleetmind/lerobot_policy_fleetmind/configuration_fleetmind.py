"""The LeRobot config of a fleetmind policy: ``--policy.type=fleetmind`` (LeRobot 0.6.1 ``PreTrainedConfig``).

A LeRobot policy folder of this type holds LeRobot's ``config.json`` (this class, draccus-encoded with its
``type``), the two processor pipelines (``policy_preprocessor.json`` / ``policy_postprocessor.json``) and, in
``fleetmind/``, a fleetmind export (``policies.export``: safetensors weights, ``config.json`` of the fleetmind
policy, statistics, tokenizer, ``export.json``; optionally the success critic and ONNX graphs), which
:class:`lerobot_policy_fleetmind.FleetmindPolicy` loads with fleetmind's lean runtime
(``policies.runtime.PolicyRuntime``). ``python -m lerobot_policy_fleetmind.export`` writes such a folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lerobot.configs.policies import PreTrainedConfig
from lerobot.optim.optimizers import AdamWConfig

POLICY_TYPE = "fleetmind"
EXPORT_SUBDIR = "fleetmind"


@PreTrainedConfig.register_subclass(POLICY_TYPE)
@dataclass
class FleetmindConfig(PreTrainedConfig):
    """A fleetmind export run inside LeRobot (evaluation and deployment; training is fleetmind's own).

    Attributes:
        export_subdir: the fleetmind export's folder, relative to the LeRobot policy folder.
        backend: ``PolicyRuntime``'s backend: ``torch`` (the default; any batch size), ``onnx`` (the export's ONNX
            graph; its batch size only) or ``auto`` (ONNX when the export has a graph, else torch).
        num_inference_steps: DDIM denoising steps per chunk (None: the export's); diffusion policies only.
        num_threads: ONNX Runtime's intra-op threads (None: torch's setting).
        use_critic: let the export's success critic choose each chunk among its samples, when the export has one
            (``policies.critic``; as ``fert_critic`` in fleetmind's evaluation). False: the policy alone.
        robot_bridge: None (the policy takes and returns its own features, as on fleetmind's envs), or the
            embodiment whose LeRobot robot the policy drives directly (``"so100"``: SO-100 / SO-101 followers and
            the twin ``fleetmind_so100_sim``): ``observation.state`` is then the robot's six joint readings
            (``<joint>.pos``, degrees; gripper 0..100) and the action its six joint targets, mapped to and from the
            policy's end-effector features by ``fleet.deploy.lerobot_bridge.SO100Bridge`` (forward kinematics in,
            the twin's controller and IK out), so ``lerobot-rollout --robot.type=so100_follower`` can run it.
        action_scale_m: with ``robot_bridge``: metres of tool motion per action unit (None: the twin's 1 cm).
        action_feature_names: the action's names in order (with ``robot_bridge``: the robot's joint keys), read by
            ``lerobot-rollout`` to map the action tensor to the robot's action dict.
        depth_cameras: with ``robot_bridge``, for a policy that reads ``observation.point_cloud``: ``{robot camera:
            calibration}`` (``sim.pointcloud.DepthCamera.to_dict``: fx, fy, cx, cy in pixels, ``base_from_camera``
            4 x 4, the optical frame's pose in the arm's base frame, metres; ``depth_scale``: metres per depth unit,
            0.001 for a RealSense's uint16 millimetres, 1 for the twin's float32 metres). The robot gives each as
            LeRobot's depth feature ``<camera>_depth`` (H, W, 1) and, for ``observation.point_colors``, the aligned
            colour image ``<camera>_depth_rgb`` (H, W, 3). ``export --robot so100`` writes the twin's.
        point_crop: with ``depth_cameras``: the cloud's workspace box ``[[x, y, z] min, [x, y, z] max]`` in the
            base frame, metres (None: the twin's ``SO100Env.POINT_CROP``, what the fleet's SO-100 envs crop to).
    """

    export_subdir: str = EXPORT_SUBDIR
    backend: str = "torch"
    num_inference_steps: int | None = None
    num_threads: int | None = None
    use_critic: bool = True
    robot_bridge: str | None = None
    action_scale_m: float | None = None
    action_feature_names: list[str] | None = None
    depth_cameras: dict[str, dict[str, Any]] | None = None
    point_crop: list[list[float]] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in ("torch", "onnx", "auto"):
            raise ValueError(f"policy.backend: expected torch, onnx or auto, given {self.backend!r}")
        if self.num_inference_steps is not None and self.num_inference_steps < 1:
            raise ValueError(f"policy.num_inference_steps: expected >= 1, given {self.num_inference_steps}")
        if self.robot_bridge not in (None, "so100"):
            raise ValueError(f"policy.robot_bridge: expected null or so100, given {self.robot_bridge!r}")
        if self.action_scale_m is not None and not self.action_scale_m > 0:
            raise ValueError(f"policy.action_scale_m: expected metres > 0, given {self.action_scale_m}")
        if self.depth_cameras is not None and self.robot_bridge is None:
            raise ValueError("policy.depth_cameras: only with policy.robot_bridge (the bridge makes the point cloud "
                             "from the robot's depth images)")
        if self.point_crop is not None and (len(self.point_crop) != 2 or any(len(v) != 3 for v in self.point_crop)
                                            or any(a >= b for a, b in zip(*self.point_crop))):
            raise ValueError(f"policy.point_crop: expected [[x, y, z] min, [x, y, z] max] with min < max (metres), "
                             f"given {self.point_crop}")

    # LeRobot's training-time windows: fleetmind trains its policies itself (scripts/train.py, the fleet job)
    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> None:
        return None

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self) -> AdamWConfig:
        """The optimiser fleetmind's trainer uses (AdamW); LeRobot's trainer is refused by the policy's ``forward``."""
        return AdamWConfig(lr=1e-4, weight_decay=1e-6)

    def get_scheduler_preset(self) -> None:
        return None

    def validate_features(self) -> None:
        """Nothing to check here: the runtime checks every observation's name and shape against the export's
        ``export.json`` features when it acts (a ValueError names the feature, the expected and given shape)."""
