"""Config of the LeRobot robot backed by the SO-100 twin (registered as ``fleetmind_so100_sim``)."""

from dataclasses import dataclass, field
from typing import Any

from lerobot.robots.config import RobotConfig

ROBOT_TYPE = "fleetmind_so100_sim"


@RobotConfig.register_subclass(ROBOT_TYPE)
@dataclass
class FleetmindSO100SimConfig(RobotConfig):
    """The simulated SO-100 follower (``fleet.deploy.so100_sim_robot.FleetmindSO100Sim``).

    Attributes:
        task: the twin's scene (``sim.so100.TASKS``: so100-reach, so100-push-cube, so100-pick-place).
        seed: placement seed of the first scene (``FleetmindSO100Sim.reset_scene`` takes others).
        unit_id: the fleet's robot unit the twin is built as (``sim.units.RobotUnit.draw`` from ``fleet_robot``):
            that unit's cube mass and friction, camera jitter, light and colours, action gain, action latency and
            observation noise on the object state, as ``sim.make_env(task, unit_id, robot_cfg)`` builds it for
            fleetmind's own evaluation. Null (the default): the nominal twin (unit 0 without variation).
            ``FleetmindSO100Sim.reset_scene(seed, unit_id=...)`` rebuilds it as another unit.
        fleet_robot: the fleet's ``robot`` config the unit is drawn from (``fleet_seed``, ``variation``, the unit
            lists; a mapping of ``configs.sim_groups.RobotConfig``'s keys); null: that config's defaults (what
            ``scripts/eval.py`` uses unless ``robot=`` is overridden). ``scripts/deploy.py`` passes its
            composed ``robot`` group. Only read with a ``unit_id``.
        render_cameras: twin cameras rendered as observation images (``corner``, ``topview``); empty: none.
        image_size: rendered image height = width, pixels.
        depth_cameras: twin cameras that also give a depth image, feature ``"<camera>_depth"`` (H, W, 1) float32
            metres, as an RGB-D sensor does (``FleetmindSO100Sim.depth_calibration()`` gives their intrinsics and
            poses in the arm's base frame, for the deploy bridge's point cloud); empty: none.
        depth_size: depth image height = width, pixels.
        depth_color: the depth cameras also give their depth-aligned colour image, feature ``"<camera>_depth_rgb"``
            (H, W, 3) uint8 (an RGB-D sensor's colour stream aligned to depth), for a policy that reads the cloud's
            colours (``observation.point_colors``).
        object_state: also give the sim-only ``sim.<name>`` features (the cube pose and goal, what a state-only
            policy's ``observation.environment_state`` holds). No real arm has them.
        max_steps: sim-only: after this many ``send_action`` calls the episode is over, as fleetmind's evaluation
            ends a trial at ``task.max_episode_steps``: later actions are not applied (the twin holds still, so a
            rollout's return to its start pose does not change the outcome); null: never.
        result_file: sim-only: append the episode's outcome here as one JSON line ``{"task", "unit_id", "seed",
            "steps", "success", "first_success_step"}`` (the simulator's success, ever reached within the steps
            taken) once ``max_steps`` is reached, or at ``disconnect``: what ``scripts/twin_vs_eval.py`` compares
            with the evaluation of the same trial; null: none.
        joint_signs / joint_offsets_deg: the simulated calibration, LeRobot degrees = sign x MJCF degrees + offset
            per arm joint (shoulder_pan .. wrist_roll); the default is the identity. Set them to emulate a real
            arm's calibration (the bridge's ``deploy.bridge`` values must then match).

    Raises:
        ValueError: an unknown task or camera, an image size under 8, or a ``unit_id`` that is not one of
            ``fleet_robot``'s training or held-out units (the valid ones are listed).
    """

    task: str = "so100-reach"
    seed: int = 0
    unit_id: int | None = None
    fleet_robot: dict[str, Any] | None = None
    render_cameras: list[str] = field(default_factory=lambda: ["corner"])
    image_size: int = 96
    depth_cameras: list[str] = field(default_factory=list)
    depth_size: int = 64
    depth_color: bool = False
    object_state: bool = True
    max_steps: int | None = None
    result_file: str | None = None
    joint_signs: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0, 1.0, 1.0])
    joint_offsets_deg: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0, 0.0])

    def __post_init__(self):
        super().__post_init__()
        if self.id is None:
            self.id = "so100_sim"
        from sim.so100.env import CAMERAS, check_task

        check_task(self.task)
        for c in self.render_cameras:
            if c not in CAMERAS:
                raise ValueError(f"render_cameras: unknown camera {c!r}; the twin's cameras: {', '.join(CAMERAS)}")
        for c in self.depth_cameras:
            if c not in CAMERAS:
                raise ValueError(f"depth_cameras: unknown camera {c!r}; the twin's cameras: {', '.join(CAMERAS)}")
        if self.max_steps is not None and int(self.max_steps) < 1:
            raise ValueError(f"max_steps: expected >= 1 or null, given {self.max_steps}")
        if int(self.image_size) < 8 or int(self.depth_size) < 8:
            raise ValueError(f"image_size / depth_size: expected >= 8 pixels, given {self.image_size} / "
                             f"{self.depth_size}")
        if self.unit_id is not None:
            from sim.units import check_unit

            check_unit(int(self.unit_id), self.unit_robot_cfg())

    def unit_robot_cfg(self) -> dict[str, Any]:
        """The ``robot`` config units are drawn from: ``fleet_robot`` over ``configs.sim_groups.RobotConfig``'s
        defaults (a plain dict; ``variation`` merged key by key).

        Raises:
            ValueError: an unknown key or a value out of range (``configs.rules.ConfigError``).
        """
        from configs.sim_groups import RobotConfig as FleetRobotConfig

        return FleetRobotConfig.from_dict(dict(self.fleet_robot or {})).to_dict()
