"""Config of the LeRobot robot backed by the SO-100 twin (registered as ``fleetmind_so100_sim``)."""

from dataclasses import dataclass, field

from lerobot.robots.config import RobotConfig

ROBOT_TYPE = "fleetmind_so100_sim"


@RobotConfig.register_subclass(ROBOT_TYPE)
@dataclass
class FleetmindSO100SimConfig(RobotConfig):
    """The simulated SO-100 follower (``fleet.deploy.so100_sim_robot.FleetmindSO100Sim``).

    Attributes:
        task: the twin's scene (``sim.so100.TASKS``: so100-reach, so100-push-cube, so100-pick-place).
        seed: placement seed of the first scene (``FleetmindSO100Sim.reset_scene`` takes others).
        render_cameras: twin cameras rendered as observation images (``corner``, ``topview``); empty: none.
        image_size: rendered image height = width, pixels.
        object_state: also give the sim-only ``sim.<name>`` features (the cube pose and goal, what a state-only
            policy's ``observation.environment_state`` holds). No real arm has them.
        joint_signs / joint_offsets_deg: the simulated calibration, LeRobot degrees = sign x MJCF degrees + offset
            per arm joint (shoulder_pan .. wrist_roll); the default is the identity. Set them to emulate a real
            arm's calibration (the bridge's ``deploy.bridge`` values must then match).
    """

    task: str = "so100-reach"
    seed: int = 0
    render_cameras: list[str] = field(default_factory=lambda: ["corner"])
    image_size: int = 96
    object_state: bool = True
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
        if int(self.image_size) < 8:
            raise ValueError(f"image_size: expected >= 8 pixels, given {self.image_size}")
